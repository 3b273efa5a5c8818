"""torch_dist checkpoints: resharding on load, exact resume, clear errors on bad input."""

from __future__ import annotations

import pytest
import torch

from rl.runtime.launch import spawn
from tests.helpers.workers import random_batches, run_layout

BASE = ["trainer.micro_batch_size=2", "trainer.global_batch_size=8", "trainer.optim.lr=1e-3"]
BASE += ["trainer.optim.warmup_steps=0", "trainer.optim.decay_style=constant"]


def _layout(tp: int, pp: int) -> list[str]:
    return [*BASE, f"trainer.tp={tp}", f"trainer.pp={pp}", "trainer.dp=1"]


def test_tp2_pp2_checkpoint_loads_at_tp1_pp1(tmp_path):
    ckpt = str(tmp_path / "tp2pp2")
    src = spawn(run_layout, 4, _layout(2, 2), random_batches(2), None, None, False, ckpt)
    after_training = src[0]["logprobs"][-1]
    assert not (tmp_path / "tp2pp2.tmp").exists()
    dst = spawn(run_layout, 1, _layout(1, 1), [], None, ckpt)[0]
    torch.testing.assert_close(dst["logprobs"][0], after_training, atol=1e-5, rtol=0)
    # ...and it is not just the initial model: training moved the log-probs.
    assert (src[0]["logprobs"][0] - after_training).abs().max() > 1e-3


def test_resume_with_optimizer_state_is_exact(tmp_path):
    batches = random_batches(4)
    straight = spawn(run_layout, 2, _layout(2, 1), batches)[0]
    mid = str(tmp_path / "mid")
    first = spawn(run_layout, 2, _layout(2, 1), batches[:2], None, None, False, mid)[0]
    second = spawn(run_layout, 2, _layout(2, 1), batches[2:], None, mid, True, None, batches[0])[0]
    assert second["step"] == 4
    torch.testing.assert_close(
        first["losses"] + second["losses"], straight["losses"], atol=1e-6, rtol=0
    )
    torch.testing.assert_close(second["logprobs"][-1], straight["logprobs"][-1], atol=1e-6, rtol=0)


def test_missing_and_corrupt_checkpoints_fail_clearly(tmp_path):
    from rl.weights.dist_ckpt import CheckpointError, check

    with pytest.raises(CheckpointError, match="does not exist"):
        check(tmp_path / "nope")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "__0_0.distcp").write_bytes(b"\0" * 10)
    with pytest.raises(CheckpointError, match="not a Megatron torch_dist checkpoint"):
        check(tmp_path / "half")


def test_a_checkpoint_index_that_would_run_code_is_refused_by_every_reader(tmp_path):
    """A checkpoint the trainer wrote is read through the restricted reader of its index
    (rl/weights/dcp_guard.py; the trainer's load applies it too, so every test here that
    resumes from a checkpoint loads through it). Prefixed with a
    pickled ``exec``, that index is refused, naming the file, by the launcher's check, by
    dist_ckpt's check, by Megatron's own reader and by the converters' reader; the payload
    never runs."""
    import megatron_patches

    megatron_patches.apply_all("cpu")  # before Megatron is imported, as every rank does
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader

    from rl.config import ckpt_check
    from rl.config.dcp_metadata import RefusedPickle
    from rl.weights import dcp_guard
    from rl.weights.dist_ckpt import CheckpointError, check
    from rl.weights.megatron_io import checkpoint_tensors
    from tests.unit.test_dcp_metadata import exec_prefix

    ckpt = tmp_path / "ckpt"
    spawn(run_layout, 1, _layout(1, 1), random_batches(1), None, None, False, str(ckpt))
    check(ckpt)
    assert dcp_guard.applied()  # check() put the restricted reader in place
    assert "embedding.word_embeddings.weight" in checkpoint_tensors(str(ckpt))
    assert dist_checkpointing.load_tensors_metadata(str(ckpt))

    index, marker = ckpt / ".metadata", tmp_path / "pwned"
    index.write_bytes(exec_prefix(marker) + index.read_bytes()[2:])
    refused = f"{index}: refused: it would load builtins.exec, not checkpoint metadata"
    assert ckpt_check.problem(ckpt) == f"cannot be loaded: {refused}"
    with pytest.raises(CheckpointError) as e:
        check(ckpt)
    assert str(e.value) == f"checkpoint {str(ckpt)!r} cannot be loaded: {refused}"
    for read in (
        lambda: FileSystemReader(str(ckpt)).read_metadata(),
        lambda: dist_checkpointing.load_tensors_metadata(str(ckpt)),
        lambda: checkpoint_tensors(str(ckpt)),
    ):
        with pytest.raises(RefusedPickle) as r:
            read()
        assert str(r.value) == refused
    assert not marker.exists()
