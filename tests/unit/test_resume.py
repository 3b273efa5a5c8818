"""Resume state of a requeued job (pure file logic; the end-to-end requeue is in test_slurm)."""

from __future__ import annotations

import json

import pytest

from rl.checkpoints import resume
from rl.checkpoints.resume import ResumeError, ResumePoint
from rl.metrics import drop_jsonl_after


def test_fresh_run_has_no_resume_point(tmp_path) -> None:
    assert resume.read(tmp_path) is None


def test_write_then_read_round_trips_and_leaves_no_temp_file(tmp_path) -> None:
    ckpt = tmp_path / "checkpoint"
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text("{}")  # a finished torch_dist save
    point = ResumePoint(step=6, checkpoint=str(ckpt), start_accuracy=0.25, warmup_accuracy=0.3)
    resume.write(tmp_path, point)
    assert resume.read(tmp_path) == point
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint", resume.STATE]


def test_corrupt_state_or_missing_checkpoint_is_a_clear_error(tmp_path) -> None:
    (tmp_path / resume.STATE).write_text('{"step": 3, "checkp')
    with pytest.raises(ResumeError, match="unreadable resume state"):
        resume.read(tmp_path)
    gone = str(tmp_path / "gone")
    resume.write(tmp_path, ResumePoint(3, gone, 0.1, None))
    with pytest.raises(ResumeError, match=r"step 3's checkpoint .*gone.* is missing"):
        resume.read(tmp_path)


def test_dropping_jsonl_records_after_the_checkpoint_keeps_the_rest(tmp_path) -> None:
    recs = [
        {"phase": "warmup", "step": 50},
        {"phase": "rl_eval", "step": 0},
        *({"phase": "rl", "step": s} for s in range(1, 6)),
        {"phase": "rl_eval", "step": 4},
        {"phase": "rl_eval", "step": 5},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"phase": "rl", "st')
    assert drop_jsonl_after(path, 4) == 3  # rl 5, rl_eval 5, the cut-off line
    kept = [json.loads(x) for x in path.read_text().splitlines()]
    assert kept == [r for r in recs if r["phase"] == "warmup" or r["step"] <= 4]
    assert drop_jsonl_after(path, 4) == 0
    assert drop_jsonl_after(tmp_path / "none.jsonl", 4) == 0


def test_a_planted_checkpoint_is_refused_in_one_line_without_running_it(tmp_path) -> None:
    """The checkpoint rl_state.json names gets trainer.load_dir's pre-launch check: an
    index that would run code is refused, and nothing runs."""
    import pickle

    from tests.unit.test_prelaunch import make_checkpoint

    good = make_checkpoint(tmp_path / "checkpoint", {"__0_0.distcp": 10})
    point = ResumePoint(4, str(good), 0.1, None)
    resume.check(tmp_path, point)  # a sound one passes

    class Evil:
        def __reduce__(self):
            import os

            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (good / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ResumeError) as e:
        resume.check(tmp_path, point)
    assert str(e.value) == (
        f"{tmp_path / resume.STATE}: step 4's checkpoint {str(good)!r} cannot be loaded: "
        f"{good / '.metadata'}: refused: it would load posix.system, not checkpoint metadata; "
        "a restart refuses it the same way: restore it, or delete the state file to start over"
    )
    assert "\n" not in str(e.value) and not (tmp_path / "pwned").exists()
