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
