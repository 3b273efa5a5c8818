"""Checkpoints written beside and renamed into place, and the resume point after a kill at
any moment of a save: it always names a complete checkpoint of the step it records."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rl.checkpoints import files as ckpt_files
from rl.checkpoints import resume
from rl.checkpoints.resume import ResumeError, ResumePoint


def _ckpt(path: Path, tag: str) -> Path:
    """A finished checkpoint directory (Megatron writes metadata.json last)."""
    path.mkdir(parents=True)
    (path / "shard.distcp").write_text(tag)
    (path / "metadata.json").write_text("{}")
    return path


def _tag(path: Path) -> str:
    return (path / "shard.distcp").read_text()


def _save(out: Path, step: int) -> Path:
    """The full sequence of an RL save: write beside, keep the previous, record."""
    final = out / "checkpoint"
    _ckpt(ckpt_files.tmp_of(final), f"step {step}")
    if final.exists():
        final.rename(ckpt_files.old_of(final))
    ckpt_files.tmp_of(final).rename(final)
    resume.write(out, ResumePoint(step, str(final), 0.1, 0.2))
    return final


def test_a_recorded_save_leaves_only_the_checkpoint_and_its_step(tmp_path) -> None:
    final = _save(tmp_path, 2)
    _save(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", resume.STATE]
    assert ckpt_files.marked_step(final) == 4 and _tag(final) == "step 4"
    assert resume.read(tmp_path) == ResumePoint(4, str(final), 0.1, 0.2)


@pytest.mark.parametrize("killed", ["writing", "after_old", "after_swap", "after_mark"])
def test_a_kill_mid_save_resumes_from_the_previous_checkpoint(tmp_path, killed) -> None:
    final = _save(tmp_path, 2)
    tmp, old = ckpt_files.tmp_of(final), ckpt_files.old_of(final)
    tmp.mkdir()
    (tmp / "shard.distcp").write_text("step 4, half")  # no metadata.json yet
    if killed != "writing":
        (tmp / "metadata.json").write_text("{}")
        (tmp / "shard.distcp").write_text("step 4")
        final.rename(old)
    if killed in ("after_swap", "after_mark"):
        tmp.rename(final)
    if killed == "after_mark":
        ckpt_files.mark(final, 4)  # the state was about to name step 4
    point = resume.read(tmp_path)
    assert point is not None and point.step == 2
    assert _tag(final) == "step 2" and ckpt_files.marked_step(final) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", resume.STATE]
    assert resume.read(tmp_path) == point  # nothing left to recover


def test_a_kill_after_the_state_was_written_keeps_the_new_checkpoint(tmp_path) -> None:
    final = _save(tmp_path, 2)
    _ckpt(ckpt_files.old_of(final), "step 0")  # resume.write died before removing it
    point = resume.read(tmp_path)
    assert point is not None and point.step == 2 and _tag(final) == "step 2"
    assert not ckpt_files.old_of(final).exists()


def test_an_incomplete_checkpoint_is_never_a_resume_point(tmp_path) -> None:
    final = tmp_path / "checkpoint"
    final.mkdir()
    (final / "shard.distcp").write_text("half")
    (tmp_path / resume.STATE).write_text(
        json.dumps({"step": 3, "checkpoint": str(final), "start_accuracy": 0, "warmup_accuracy": 0})
    )
    with pytest.raises(ResumeError, match=r"step 3's checkpoint .* is missing or incomplete"):
        resume.read(tmp_path)


def test_describe_says_what_a_stopped_run_leaves(tmp_path) -> None:
    assert resume.describe(tmp_path) == f"saved: no checkpoint yet in {tmp_path}"
    _ckpt(tmp_path / "warmup", "warm")
    assert resume.describe(tmp_path).startswith("saved: the warm-up checkpoint")
    final = _save(tmp_path, 6)
    assert resume.describe(tmp_path) == f"saved: RL step 6 in {final} (a restart resumes there)"


def test_a_companion_checkpoint_is_kept_and_recovered_as_the_checkpoint_is(tmp_path) -> None:
    """A critic's checkpoint of the step (``companions``) is marked, its previous one
    dropped once the state names it, and a kill mid-save of it resumes its previous one."""
    policy, critic = _ckpt(tmp_path / "checkpoint", "step 2"), _ckpt(tmp_path / "c", "step 2")
    resume.write(tmp_path, ResumePoint(2, str(policy), 0.1, 0.2, companions=(str(critic),)))
    assert ckpt_files.marked_step(critic) == 2
    critic.rename(ckpt_files.old_of(critic))  # the next save of it, killed half-way
    _ckpt(ckpt_files.tmp_of(critic), "step 4, half")
    point = resume.read(tmp_path)
    assert point is not None and point.companions == (str(critic),)
    assert _tag(critic) == "step 2" and not ckpt_files.tmp_of(critic).exists()
    shutil.rmtree(critic)
    with pytest.raises(ResumeError, match=r"step 2's checkpoint '.*/c' is missing"):
        resume.read(tmp_path)
