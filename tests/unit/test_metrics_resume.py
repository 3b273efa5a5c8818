"""A resumed run's metrics: every step once in the JSONL and in TensorBoard, even for the
steps the lost attempt had logged after its last checkpoint."""

from __future__ import annotations

import json
from collections import Counter

from rl.metrics import MetricsLogger, read_jsonl


def _tb_steps(out) -> Counter[tuple[str, int]]:
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    seen: Counter[tuple[str, int]] = Counter()
    for f in sorted((out / "tensorboard").glob("events.out.tfevents.*")):
        for ev in EventFileLoader(str(f)).Load():
            for v in ev.summary.value:
                seen[(v.tag, ev.step)] += 1
    return seen


def _attempt(out, warmup: range, rl: range, resume_step: int | None) -> None:
    log = MetricsLogger(out, resume_step=resume_step)
    for s in warmup:
        log.log(s, {"loss": 1.0 / s}, phase="warmup", echo=False)
    for s in rl:
        log.log(s, {"reward_mean": s / 10}, phase="rl", echo=False)
        if s % 3 == 0:
            log.log(s, {"eval_accuracy": s / 10}, phase="rl_eval", echo=False)
    log.close()


def test_resumed_steps_appear_once_in_jsonl_and_tensorboard(tmp_path) -> None:
    _attempt(tmp_path, range(1, 21), range(1, 8), None)  # checkpoint at 4, killed after 7
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"phase": "rl", "st')  # the line the kill cut short
    _attempt(tmp_path, range(0), range(5, 11), resume_step=4)

    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in recs if r["phase"] == "rl"] == list(range(1, 11))
    assert [r["step"] for r in recs if r["phase"] == "rl_eval"] == [3, 6, 9]
    assert [r["step"] for r in recs if r["phase"] == "warmup"] == list(range(1, 21))
    seen = _tb_steps(tmp_path)
    assert max(seen.values()) == 1, [k for k, n in seen.items() if n > 1]
    assert {s for (t, s) in seen if t == "rl/reward_mean"} == set(range(1, 11))
    # The warm-up's steps above the resume step stay (purge_step would have hidden them).
    assert {s for (t, s) in seen if t == "warmup/loss"} == set(range(1, 21))
    assert seen[("rl/reward_mean", 7)] == 1
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2


def test_a_fresh_run_rewrites_nothing(tmp_path) -> None:
    _attempt(tmp_path, range(1, 4), range(1, 3), None)
    before = sorted(p.name for p in (tmp_path / "tensorboard").iterdir())
    _attempt(tmp_path, range(0), range(3, 4), resume_step=2)
    after = sorted(p.name for p in (tmp_path / "tensorboard").iterdir())
    assert set(before) <= set(after)


def test_a_job_that_starts_over_logs_each_step_once(tmp_path) -> None:
    """An attempt killed before its first RL checkpoint: the next starts over, warm-up
    included (rl/controller/loop.py), and what the lost one logged goes from the JSONL
    and TensorBoard; the plot draws each step once even from a dir written before that."""
    from rl.metrics import RESUMED_PHASES, WARMUP_PHASES, last_attempts

    _attempt(tmp_path, range(1, 6), range(1, 4), None)  # killed after RL step 3
    with open(tmp_path / "metrics.jsonl") as f:
        written_twice = f.read()
    log = MetricsLogger(tmp_path, resume_step=-1, redo_phases=(*WARMUP_PHASES, *RESUMED_PHASES))
    for s in range(1, 6):
        log.log(s, {"loss": 2.0 / s}, phase="warmup", echo=False)
    for s in range(1, 5):
        log.log(s, {"reward_mean": s / 5}, phase="rl", echo=False)
        if s == 3:
            log.log(s, {"eval_accuracy": 0.5}, phase="rl_eval", echo=False)
    log.close()
    recs = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["phase"], r["step"]) for r in recs] == [
        *(("warmup", s) for s in range(1, 6)), ("rl", 1), ("rl", 2), ("rl", 3),
        ("rl_eval", 3), ("rl", 4)]  # fmt: skip
    assert all(r["loss"] == 2.0 / r["step"] for r in recs if r["phase"] == "warmup")
    seen = _tb_steps(tmp_path)
    assert max(seen.values()) == 1, [k for k, n in seen.items() if n > 1]
    # A dir that kept both attempts: readers take each step's last record.
    both = [json.loads(x) for x in (written_twice + (tmp_path / "metrics.jsonl").read_text())
            .splitlines()]  # fmt: skip
    assert last_attempts(both) == recs
