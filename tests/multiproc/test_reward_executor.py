"""The reward executor's worker processes (timeouts, dead workers, replaced workers) and
the reward rank's service, driven through its handle."""

from __future__ import annotations

import pickle
import queue
import threading
import time
from pathlib import Path

from rl.reward.executor import RewardExecutor
from rl.tasks.scoring import ScoreResult
from tests.helpers.reward_scorers import item

FAILED = ScoreResult(0.0, {}, failed=True)


def test_batch_scores_in_order():
    with RewardExecutor("exact", workers=2) as ex:
        got = ex.score([item("1", "1"), item("2", "3"), item("4", 4), item("5", "6")])
    assert [r.score for r in got] == [1.0, 0.0, 1.0, 0.0]
    assert not any(r.failed for r in got)
    assert ex.stats.scored == 4 and ex.stats.failures == 0


def test_builtin_and_file_fns_load_in_the_workers(tmp_path, monkeypatch):
    (tmp_path / "rewards.py").write_text(
        "def fn(prompt, response, label, metadata):\n"
        "    return {'score': float(response == label), 'depth': metadata['depth']}\n"
    )
    monkeypatch.chdir(tmp_path)
    with RewardExecutor("rewards.py:fn", workers=1) as ex:
        monkeypatch.chdir(Path(__file__).parent)  # workers got the absolute path
        got = ex.score([item("a", "a", depth=2), item("a", "b", depth=3)])
    assert got == [ScoreResult(1.0, {"depth": 2.0}), ScoreResult(0.0, {"depth": 3.0})]
    with RewardExecutor("math_verify", workers=1, timeout_s=2.0) as ex:
        got = ex.score([item("\\boxed{\\frac{2}{4}}", "0.5"), item("it is 7", 8)])
    assert [r.score for r in got] == [1.0, 0.0] and ex.stats.timeouts == 0


def test_misbehaving_fns_cost_one_item_each():
    cases = ["a", "boom", "str", "none", "nan", "hang", "die", "b"]
    with RewardExecutor("tests.helpers.reward_scorers:flaky", workers=2, timeout_s=1.0) as ex:
        t0 = time.monotonic()
        got = ex.score([item(c, c) for c in cases])
        elapsed = time.monotonic() - t0
        ok = ScoreResult(1.0, {})
        assert got == [ok, FAILED, FAILED, FAILED, FAILED, FAILED, FAILED, ok]
        assert ex.stats.failures == 5  # the exception, 3 bad values and the dead worker
        assert ex.stats.timeouts == 1
        assert ex.stats.scored == 2
        assert elapsed < 15  # the hang cost its timeout, not its 60 s
        # Still serving afterwards, with replaced workers.
        assert ex.score([item("c", "c")]) == [ok]


def test_workers_that_cannot_start_fail_items_instead_of_hanging(tmp_path):
    # Loads in the parent (so the spec passes its check) but kills every worker process.
    (tmp_path / "child_dies.py").write_text(
        "import multiprocessing, os\n"
        "if multiprocessing.parent_process() is not None:\n"
        "    os._exit(3)\n"
        "def fn(prompt, response, label, metadata):\n"
        "    return 1.0\n"
    )
    with RewardExecutor(f"{tmp_path}/child_dies.py:fn", workers=1, timeout_s=1.0) as ex:
        assert ex.score([item("a", "a"), item("b", "b")]) == [FAILED, FAILED]
        assert ex.stats.failures == 2 and "failed to start" in ex.stats.last_error
        assert ex.score([item("c", "c")]) == [FAILED]


# ---------------------------------------------------------------------- service
class _Queue:
    """A channel stand-in: pickles each message as the store-backed channel does."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()

    def put(self, msg: object) -> None:
        self.q.put(pickle.dumps(msg))

    def get(self) -> object:
        return pickle.loads(self.q.get(timeout=30))

    wait = get  # an executor's inbox waits as long as it takes; here 30 s is plenty


class _Job:
    role_rank = 0

    def __init__(self) -> None:
        self.queues: dict[str, _Queue] = {}

    def channel(self, name: str, *types: type) -> _Queue:
        return self.queues.setdefault(name, _Queue())

    def role_size(self, role: str) -> int:
        return 1


def test_handle_scores_through_a_reward_rank():
    from types import SimpleNamespace

    from rl.reward.service import RewardHandle, serve

    job = _Job()
    reward = SimpleNamespace(fn="tests.helpers.reward_scorers:flaky", workers=1, timeout_s=2)
    rank = threading.Thread(target=serve, args=(reward, job), kwargs={"output_dir": ""},
                            daemon=True)  # fmt: skip
    rank.start()
    handle = RewardHandle(job)
    try:
        a = handle.score([item("x", "x"), item("boom", "x"), item("y", "x")])
        empty = handle.score([])
        assert [r.score for r in a.result(timeout=30)] == [1.0, 0.0, 0.0]
        assert a.result()[1].failed and empty.result(timeout=30) == []
        assert handle.failures == 1 and handle.timeouts == 0
    finally:
        handle.stop()
        rank.join(timeout=15)
    assert not rank.is_alive()
