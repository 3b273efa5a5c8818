"""The next batch taken ahead (rl/controller/prefetch.py) and the loop's phase timings."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from rl.config.sampling import SamplingParams
from rl.controller.prefetch import BatchPrefetch
from rl.controller.rollouts import RolloutStream, StreamClosed
from rl.controller.staleness import StalenessGate
from rl.controller.weight_sync import WeightSync
from rl.tasks.common import Example
from rl.tasks.scoring import ScoreResult
from rl.trainer.service import Pushed
from tests.helpers.fake_generator import InstantClient, SilentClient
from tests.unit.test_weight_sync import FakeTarget, FakeTrainer


class FakeStream:
    """next_batch(v) waits until ``release`` is set, then hands out groups named by v."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[int] = []

    def next_batch(self, version: int) -> tuple[list, dict[str, float]]:
        self.calls.append(version)
        if not self.release.wait(5):
            raise TimeoutError("never released")
        if version < 0:
            raise ValueError(f"bad version {version}")
        return [f"g{version}a", f"g{version}b"], {"wait_batch_s": 99.0, "lag_mean": 1.0}


def test_a_batch_is_taken_and_assembled_while_the_trainer_trains():
    stream = FakeStream()
    fetch = BatchPrefetch(stream, lambda groups, v, m: {"n": len(groups), "first": groups[0]})  # type: ignore[arg-type]
    fetch.request(7)  # returns at once: the stream is not ready yet
    assert stream.calls == [7] or not stream.calls  # the thread may not have started yet
    with pytest.raises(RuntimeError, match="already requested"):
        fetch.request(8)
    stream.release.set()
    groups, batch, m = fetch.take(7)
    assert groups == ["g7a", "g7b"] and batch == {"n": 2, "first": "g7a"}
    assert m["assemble_s"] >= 0 and m["lag_mean"] == 1.0
    # The trainer's wait is what take() waited, not the stream's (99 s in the fake).
    assert m["wait_batch_s"] < 5
    groups, _, _ = fetch.take(8)  # nothing requested: taken now
    assert groups == ["g8a", "g8b"] and stream.calls == [7, 8]


def test_a_batch_checked_against_another_version_is_refused_and_errors_reach_take():
    stream = FakeStream()
    stream.release.set()
    fetch = BatchPrefetch(stream, lambda groups, v, m: {})  # type: ignore[arg-type]
    fetch.request(3)
    with pytest.raises(RuntimeError, match="version 3, not the trainer's 4"):
        fetch.take(4)
    fetch = BatchPrefetch(stream, lambda groups, v, m: {})  # type: ignore[arg-type]
    fetch.request(-1)
    with pytest.raises(ValueError, match="bad version -1"):
        fetch.take(-1)


def _stream(score_delay: float = 0.0) -> tuple[RolloutStream, StalenessGate]:
    def score(group):
        f: Future = Future()

        def later():
            time.sleep(score_delay)
            f.set_result([ScoreResult(float(k % 2)) for k in range(2)])

        threading.Thread(target=later, daemon=True).start()
        return f

    prompts = (Example(f"p{i}", (i + 1, 7), "") for i in range(10_000))
    gate = StalenessGate(max_lag=0, mode="throttle", per_step=2)
    stream = RolloutStream(InstantClient(), score, lambda: next(prompts),
                           SamplingParams(n=2), gate=gate, version=1)  # fmt: skip
    return stream, gate


def test_the_stream_reports_generation_and_reward_time_per_batch():
    stream, _ = _stream(score_delay=0.01)
    stream.start()
    try:
        t0 = time.perf_counter()
        groups, stats = stream.next_batch(1)
        span = time.perf_counter() - t0
    finally:
        stream.close()
    assert len(groups) == 2
    # Every group waited for its (delayed) rewards; generation took no longer than the call.
    assert 0.01 <= stats["reward_s"] < 5
    assert 0 <= stats["gen_busy_s"] <= span + 0.05


def test_closing_the_stream_wakes_a_waiting_batch():
    prompts = (Example(f"p{i}", (i + 1, 7), "") for i in range(100))
    stream = RolloutStream(
        SilentClient(),
        lambda g: Future(),
        lambda: next(prompts),
        SamplingParams(n=2),
        gate=StalenessGate(0, per_step=2),
        version=1,
    )
    stream.start()
    box: list[BaseException] = []

    def wait() -> None:
        try:
            stream.next_batch(1)
        except BaseException as e:
            box.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.02)
    stream.close()
    waiter.join(5)
    assert not waiter.is_alive() and box and isinstance(box[0], StreamClosed)


class SlowTrainer(FakeTrainer):
    def push(self, version: int, servers: list[int] | None = None) -> Pushed:
        time.sleep(0.01)
        return super().push(version, servers)


def test_the_sync_reports_its_parts():
    log: list[str] = []
    sync = WeightSync(SlowTrainer(log), [FakeTarget(log, "s0")], weight_version=1)  # type: ignore[arg-type]
    stats = sync.push()
    m = stats.metrics()
    parts = [m[k] for k in ("sync_begin_s", "sync_send_s", "sync_commit_s")]
    assert all(isinstance(p, float) and p >= 0 for p in parts)
    assert parts[1] >= 0.01  # the trainer ranks' transfer
    assert sum(parts) == pytest.approx(m["sync_s"], abs=1e-6)


def test_background_calls_run_in_order_and_their_errors_surface():
    from rl.controller.prefetch import Background

    seen: list[int] = []
    bg = Background("step-log")
    for i in range(5):
        bg.submit(lambda i: (time.sleep(0.001), seen.append(i)), i)
    bg.drain()
    assert seen == [0, 1, 2, 3, 4]

    def boom() -> None:
        raise OSError("disk full")

    bg.submit(boom)
    with pytest.raises(OSError, match="disk full"):
        bg.drain()
    with pytest.raises(OSError, match="disk full"):
        bg.submit(seen.append, 5)  # the failed call is reported before the next one runs
    with pytest.raises(OSError, match="disk full"):
        bg.close()  # and when the job ends
    assert seen == [0, 1, 2, 3, 4]

    # A failure followed by more calls before anyone looked is not lost, and nothing
    # after it runs.
    late = Background("step-log")
    late.submit(lambda: (time.sleep(0.02), boom()))
    late.submit(seen.append, 6)
    with pytest.raises(OSError, match="disk full"):
        late.close()
    assert seen == [0, 1, 2, 3, 4]
