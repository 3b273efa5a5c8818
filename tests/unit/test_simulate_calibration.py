"""The simulator's step rule predicts this machine's committed async-vs-sync benchmark
(tools/bench/results/async_vs_sync.json) from the CPU profile built from it."""

from __future__ import annotations

import copy
import json

import pytest

from rl.simulate.calibrate import BENCH, CpuProfile, calibrate

GOAL = 0.10


def test_calibration_predicts_the_committed_benchmark_within_10_percent() -> None:
    bench = json.loads(BENCH.read_text())
    cal = calibrate(bench)
    err = cal.errors()
    assert abs(err["sync"]) <= GOAL, err
    assert abs(err["async"]) <= GOAL, err
    # The prediction is not the measurement copied: the async run's step time is no input.
    moved = copy.deepcopy(bench)
    moved["splits"]["split"]["async"]["step_s"] *= 2
    assert calibrate(moved).predicted_async == pytest.approx(cal.predicted_async)


def test_profile_comes_from_the_sync_run() -> None:
    s = {"step_s": 1.0, "train_s": 0.4, "sync_s": 0.05, "wait_batch_s": 0.5}
    a = {"step_s": 0.7, "train_s": 0.44, "sync_s": 0.07}
    p = CpuProfile.from_bench({"splits": {"split": {"sync": s, "async": a}}})
    assert p.generate == 0.5 and p.train == 0.4 and p.sync == 0.05
    assert p.overhead == pytest.approx(0.05)
    assert p.contention == pytest.approx(1.1)
    # Generator-bound: the generator's batch (slowed by the contention) plus the pause
    # for the weight sync, plus the overhead.
    cal = calibrate({"splits": {"split": {"sync": s, "async": a}}})
    assert cal.predicted_async == pytest.approx(0.5 * 1.1 + 0.07 + 0.05)
    assert cal.contention_free == pytest.approx(0.5 + 0.05 + 0.05)
