"""The pre-launch checks as a user meets them: ``python -m rl.train`` with a bad file or a
rollout that cannot fit exits at once, in one line naming the field and value, and never
starts a rank (each of these used to fail a minute or more into the run).

No rank started: the launcher prints "starting ..." just before it spawns; nothing
written: the run directory does not exist (every check runs before Hydra creates it).
The checkpoints are written here by torch's own distributed-checkpoint writer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FAST_S = 30.0  # interpreter, Hydra and torch imports on a shared 2-core machine: ~5 s


def _launch(out: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "rl.train", f"run.output_dir={out}", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    return res, time.monotonic() - t0


def _fails_before_launch(out: Path, *args: str) -> str:
    """Run, check the failure is fast, one line and rank-free; return that line."""
    res, seconds = _launch(out, *args)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr and "msrl:" not in res.stderr + res.stdout
    assert "starting" not in res.stdout
    assert seconds < FAST_S, f"took {seconds:.1f} s"
    assert not out.exists(), os.listdir(out)  # not even Hydra's log: nothing written
    return lines[0]


def write_checkpoint(path: Path, model_config: dict) -> Path:
    """A torch_dist directory as Megatron lays it out: DCP shards and index, the common
    state (torch.save) and metadata.json."""
    import torch
    import torch.distributed.checkpoint as dcp

    state = {f"w{i}": torch.full((256,), float(i)) for i in range(4)}
    with warnings.catch_warnings():  # "assuming ... a single process": as intended
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    torch.save({"format_version": 1, "model_config": model_config}, path / "common.pt")
    meta = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    (path / "metadata.json").write_text(json.dumps(meta))
    return path


@pytest.fixture(scope="module")
def tiny_model() -> dict:
    from omegaconf import OmegaConf

    from rl.compose import compose

    return OmegaConf.to_container(compose().model)  # type: ignore[return-value]


def test_a_rollout_longer_than_the_context(tmp_path: Path) -> None:
    line = _fails_before_launch(
        tmp_path / "run", "rollout.context_length=200", "rollout.sampling.max_new_tokens=100"
    )
    assert line == (
        "config error: rollout.context_length=200 exceeds model.max_position_embeddings=64 "
        "(the servers refuse a longer context; null: the model's)"
    )
    line = _fails_before_launch(tmp_path / "run", "rollout.sampling.max_new_tokens=58")
    assert line.startswith(
        "config error: rollout.sampling.max_new_tokens=58 + the longest prompt (7 tokens) "
        "exceeds the context of 64 tokens"
    )
    line = _fails_before_launch(tmp_path / "run", "rollout.max_total_tokens=8")
    assert line.startswith("config error: rollout.max_total_tokens=8 (a server's KV cache)")


def test_a_missing_or_truncated_checkpoint(tmp_path: Path, tiny_model: dict) -> None:
    out = tmp_path / "run"
    line = _fails_before_launch(out, f"trainer.load_dir={tmp_path / 'none'}")
    assert line == f"config error: trainer.load_dir={str(tmp_path / 'none')!r} does not exist"
    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_model)
    shard = sorted(ckpt.glob("*.distcp"))[0]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 100)
    line = _fails_before_launch(out, f"trainer.load_dir={ckpt}")
    assert line == (
        f"config error: trainer.load_dir={str(ckpt)!r} shard {str(shard)!r} is truncated: "
        f"{size - 100} of {size} bytes"
    )


def test_a_checkpoint_of_another_model(tmp_path: Path, tiny_model: dict) -> None:
    ckpt = write_checkpoint(tmp_path / "ckpt", {**tiny_model, "num_layers": 2})
    line = _fails_before_launch(tmp_path / "run", f"trainer.load_dir={ckpt}")
    assert line == (
        f"config error: trainer.load_dir={str(ckpt)!r} is for a different model: num_layers: "
        "checkpoint 2 vs config 4"
    )


@pytest.mark.parametrize("field", ["model.hf_checkpoint", "rollout.model_path"])
def test_a_missing_model_directory(tmp_path: Path, field: str) -> None:
    missing = tmp_path / "no_model"
    line = _fails_before_launch(tmp_path / "run", f"{field}={missing}")
    assert line == f"config error: {field}={str(missing)!r} does not exist"


def test_an_output_dir_that_cannot_be_written(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    line = _fails_before_launch(afile / "run")
    assert line == (
        f"config error: run.output_dir={str(afile / 'run')!r} cannot be written: Not a directory "
        f"({afile} is a file)"
    )
    # Writable by its permission bits (to root), yet no directory can be made there: Hydra's
    # own mkdir printed a 12-line traceback.
    line = _fails_before_launch(Path("/proc/msrl_out"))
    assert line.startswith("config error: run.output_dir='/proc/msrl_out' cannot be written: ")


def test_a_shard_damaged_after_launch_is_named_by_the_load(tmp_path, tiny_model, monkeypatch):
    """Cut short after the launcher's check: Megatron's load fails on some rank with a
    CheckpointException around a bare EOFError; dist_ckpt.load names the file instead."""
    import megatron_patches

    megatron_patches.apply_all("cpu")  # before Megatron is imported, as every rank does
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import CheckpointException

    from rl.weights.dist_ckpt import CheckpointError, load

    ckpt = write_checkpoint(tmp_path / "ckpt", tiny_model)

    def fails(state, path):
        raise CheckpointException("load failed", {0: EOFError()})

    monkeypatch.setattr(dist_checkpointing, "load", fails)
    with pytest.raises(CheckpointError) as e:  # whole files: the rank's own error, one line
        load({}, ckpt)
    assert str(e.value) == f"checkpoint {str(ckpt)!r} cannot be read: EOFError"
    shard = sorted(ckpt.glob("*.distcp"))[0]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError) as e:
        load({}, ckpt)
    assert str(e.value) == (
        f"checkpoint {str(ckpt)!r} shard {str(shard)!r} is truncated: 10 of {size} bytes"
    )


@pytest.mark.parametrize(
    ("override", "said"),
    [
        ("trainer.bogus=1", "Could not override 'trainer.bogus'."),
        ("experiment=nope", "In 'config': Could not find 'experiment/nope'"),
    ],
)
def test_an_override_hydra_cannot_compose_is_one_line(tmp_path: Path, override, said) -> None:
    line = _fails_before_launch(tmp_path / "run", override)
    assert line.startswith(f"config error: {said}"), line


def test_a_cut_or_planted_resume_state_fails_in_one_line_writing_nothing(tmp_path: Path) -> None:
    """rl_state.json is read, and the checkpoint it names checked, before Hydra writes its
    log and before any rank starts: a cut state created hydra/ and train.log first, and a
    planted checkpoint started 5 ranks and ended in a 28-line traceback."""
    import pickle

    from tests.unit.test_prelaunch import make_checkpoint

    out = tmp_path / "run"
    out.mkdir()
    state = out / "rl_state.json"
    state.write_text('{"step": 3, "checkp')
    res, _ = _launch(out)
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith(f"resume error: {state}: unreadable resume state")
    assert sorted(p.name for p in out.iterdir()) == ["rl_state.json"]  # nothing written

    ckpt = make_checkpoint(out / "checkpoint", {"__0_0.distcp": 10})
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Planted(str(tmp_path / "pwned"))))
    state.write_text(json.dumps({"step": 3, "checkpoint": str(ckpt), "start_accuracy": 0.1,
                                 "warmup_accuracy": None}))  # fmt: skip
    res, _ = _launch(out)
    lines = res.stderr.strip().splitlines()
    assert res.returncode != 0 and len(lines) == 1, res.stderr
    assert lines[0].startswith(f"resume error: {state}: step 3's checkpoint {str(ckpt)!r} ")
    assert "refused: it would load posix.system" in lines[0] and "a restart refuses" in lines[0]
    assert "starting" not in res.stdout and not (tmp_path / "pwned").exists()
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint", "rl_state.json"]


class _Planted:
    def __init__(self, mark: str) -> None:
        self.mark = mark

    def __reduce__(self):
        import os

        return (os.system, ("touch " + self.mark,))
