"""The reward executor in the RL job: ranks with reward-function worker pools, and the handle.

The controller sends a group's items (prompt, response, label, metadata) to a reward rank
(round robin) and gets a future back at once; the rank scores them in its worker processes
(rl/reward/executor.py: a raising, hanging or dying function gives a failed 0 and a
counter, never a crash) and answers when the whole group is scored. So scoring runs in
parallel with generation and training, on ranks of its own. Training rollouts and
evaluation go through the same handle, so one function (``reward.fn``) scores both.

The messages are plain dataclasses of strings, numbers, lists and dicts, so any channel
encoding that handles those can carry them.
"""

from __future__ import annotations

import itertools
import threading
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from rl.dist.channel import Failed
from rl.tasks.scoring import ScoreItem, ScoreResult

if TYPE_CHECKING:
    from rl.config.schema import RootConfig
    from rl.dist.channel import Channel
    from rl.dist.job import Job
    from rl.reward.executor import RewardExecutor


@dataclass
class Score:
    request: int
    items: list[ScoreItem]


@dataclass
class Scored:
    request: int
    results: list[ScoreResult]  # in the order of the request's items
    failures: int  # this rank's function errors, bad return values and dead workers, in all
    timeouts: int


@dataclass
class Stop:
    pass


def serve(cfg: RootConfig, job: Job) -> None:
    from rl.reward.executor import RewardExecutor

    inbox = job.channel(f"reward/in/{job.role_rank}", Score, Stop)
    reply = job.channel("reward/out", Scored)
    lock = threading.Lock()  # answers come from the executor's dispatch thread
    r = cfg.reward
    try:
        with RewardExecutor(r.fn, r.workers, r.timeout_s) as ex:
            while isinstance(msg := inbox.wait(), Score):
                futures = [ex.submit(item) for item in msg.items]
                _answer_when_done(msg.request, futures, ex, reply, lock)
    except BaseException:
        reply.put(Failed("reward", job.role_rank, traceback.format_exc()))
        raise


def _answer_when_done(
    request: int,
    futures: list[Future[ScoreResult]],
    ex: RewardExecutor,
    reply: Channel,
    lock: threading.Lock,
) -> None:
    left = [len(futures)]
    if not futures:  # no callback would ever answer an empty request
        with lock:
            reply.put(Scored(request, [], ex.stats.failures, ex.stats.timeouts))
        return

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0] == 0:
                st = ex.stats
                results = [f.result() for f in futures]
                reply.put(Scored(request, results, st.failures, st.timeouts))

    for f in futures:
        f.add_done_callback(one_done)


class RewardHandle:
    """``score(items)`` -> Future[list[ScoreResult]], answered by the reward ranks."""

    def __init__(self, job: Job):
        n = job.role_size("reward")
        self._to = [job.channel(f"reward/in/{r}", Score, Stop) for r in range(n)]
        self._from = job.channel("reward/out", Scored)  # read by the reply thread only
        self._wake = job.channel("reward/out", Scored)
        self._ids = itertools.count()
        self._next = itertools.cycle(range(n))
        # request -> (its future, the rank scoring it)
        self._pending: dict[int, tuple[Future[list[ScoreResult]], int]] = {}
        self._lock = threading.Lock()
        self._per_rank: dict[int, tuple[int, int]] = {}
        self._thread = threading.Thread(target=self._receive, name="reward-replies", daemon=True)
        self._thread.start()

    def score(self, items: list[ScoreItem]) -> Future[list[ScoreResult]]:
        fut: Future[list[ScoreResult]] = Future()
        with self._lock:
            request, rank = next(self._ids), next(self._next)
            self._pending[request] = (fut, rank)
            self._to[rank].put(Score(request, list(items)))
        return fut

    def _receive(self) -> None:
        while True:
            try:
                msg = cast(Scored, self._from.get())  # the one type the channel carries
            except BaseException as e:  # a reward rank failed: fail everything waiting
                with self._lock:
                    waiting, self._pending = list(self._pending.values()), {}
                for f, _ in waiting:
                    f.set_exception(e)
                return
            if msg.request < 0:  # stop() woke us
                return
            with self._lock:
                fut, rank = self._pending.pop(msg.request)
            self._per_rank[rank] = (msg.failures, msg.timeouts)
            fut.set_result(msg.results)

    @property
    def failures(self) -> int:
        return sum(f for f, _ in self._per_rank.values())

    @property
    def timeouts(self) -> int:
        return sum(t for _, t in self._per_rank.values())

    def stop(self) -> None:
        for ch in self._to:
            ch.put(Stop())
        self._wake.put(Scored(-1, [], 0, 0))  # wakes the reply thread
        self._thread.join(timeout=5)
