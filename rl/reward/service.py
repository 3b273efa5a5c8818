"""The reward executor in the RL job: ranks with reward-function worker pools, and the handle.

The controller sends a group's items (prompt, response, label, metadata) to a reward rank
(round robin) and gets a future back at once; the rank scores them in its worker processes
(rl/reward/executor.py: a raising, hanging or dying function gives a failed 0 and a
counter, never a crash), or asks the LLM judge the rank serves (``reward.fn=judge``,
rl/reward/judge.py) and answers when the whole group is scored. So scoring runs in
parallel with generation and training, on ranks of its own. Training rollouts and
evaluation go through the same handle, so one function (``reward.fn``) scores both.

The messages are plain dataclasses of strings, numbers, lists and dicts, so any channel
encoding that handles those can carry them.

Every request has a deadline (:func:`reply_deadline`): a request lost on the way (a rank
that died, a message that never arrived) is sent again once, to the next rank, and if
that is not answered in time either its items score 0 as failed, counted
(``reward_resent``, ``reward_lost``), each in one line. A group is never left waiting.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
import traceback
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol, cast

from rl.runtime.channel import ChannelTimeout, Failed, ProtocolError
from rl.tasks.scoring import JUDGE, ScoreItem, ScoreResult, rule_fn
from rl.threads import start_thread

if TYPE_CHECKING:
    from rl.config.schema import RewardConfig
    from rl.reward.executor import RewardStats
    from rl.runtime.channel import Channel
    from rl.runtime.job import Job


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


@dataclass
class Wake:
    """The controller to its own reply thread, on ``reward/out``: look at your stop flag.
    Only that flag stops the thread, so no message can stop it quietly and leave every
    waiting group unanswered; a Wake it did not ask for is a protocol error."""


class Scorer(Protocol):
    """The rule function's worker pool (rl/reward/executor.py) or the LLM judge
    (rl/reward/judge.py)."""

    stats: RewardStats

    def submit(self, item: ScoreItem) -> Future[ScoreResult]: ...

    def __enter__(self) -> Scorer: ...

    def __exit__(self, *exc: object) -> None: ...


def _scorer(r: RewardConfig, output_dir: str, job: Job) -> Scorer:
    if rule_fn(r).strip() == JUDGE:
        from rl.reward.judge import JudgeScorer
        from rl.serving.server_api import job_keys

        logs = Path(output_dir) / "reward" / f"rank{job.role_rank}" / "logs"
        return JudgeScorer(r.judge, job_keys(), logs)
    from rl.reward.executor import RewardExecutor

    return RewardExecutor(rule_fn(r), r.workers, r.timeout_s)


def serve(reward: RewardConfig, job: Job, *, output_dir: str) -> None:
    """A reward rank's main loop: score what the controller sends with ``reward.fn`` (the
    judge's server logs go under ``output_dir``) until told to stop."""
    inbox = job.channel(f"reward/in/{job.role_rank}", Score, Stop)
    reply = job.channel("reward/out", Scored)
    scored: queue.SimpleQueue[tuple[int, list[Future[ScoreResult]]]] = queue.SimpleQueue()
    try:
        with _scorer(reward, output_dir, job) as ex:
            # Answers go out from a thread of their own, not from the executor's callbacks:
            # an error in a future's callback is only logged, so a reply that failed there
            # left its group unanswered and the job waiting forever. This thread dying
            # ends the rank instead (rl/runtime/launch.py install_thread_hook).
            out = job.channel("reward/out", Scored)  # this thread's own connection
            start_thread("reward-answers", _answer, scored, ex, out)
            while isinstance(msg := inbox.wait(), Score):
                futures = [ex.submit(item) for item in msg.items]
                _when_all_done(msg.request, futures, scored)
    except BaseException:
        reply.put(Failed("reward", job.role_rank, traceback.format_exc()))
        raise


def _when_all_done(
    request: int,
    futures: list[Future[ScoreResult]],
    scored: queue.SimpleQueue[tuple[int, list[Future[ScoreResult]]]],
) -> None:
    """Queue ``request`` for its answer once every one of its futures is done."""
    left = [len(futures)]
    lock = threading.Lock()
    if not futures:  # no callback would ever answer an empty request
        scored.put((request, futures))
        return

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            scored.put((request, futures))

    for f in futures:
        f.add_done_callback(one_done)


def _answer(
    scored: queue.SimpleQueue[tuple[int, list[Future[ScoreResult]]]],
    ex: Scorer,
    reply: Channel,
) -> None:
    while True:
        request, futures = scored.get()
        st = ex.stats
        reply.put(Scored(request, [f.result() for f in futures], st.failures, st.timeouts))


def reply_deadline(r: RewardConfig, items: int) -> float:
    """How long a request of ``items`` may take before it is sent again: its items scored
    ``workers`` at a time (the judge: ``concurrency``), each up to its timeout, plus
    ``reward.reply_margin_s`` for the requests queued before it."""
    judge = rule_fn(r).strip() == JUDGE
    each, width = (r.judge.timeout_s, r.judge.concurrency) if judge else (r.timeout_s, r.workers)
    return each * math.ceil(max(items, 1) / width) + r.reply_margin_s


class _Pending(NamedTuple):
    future: Future[list[ScoreResult]]
    rank: int
    items: list[ScoreItem]
    due: float  # time.monotonic() when it is overdue
    tries: int


POLL_S = 1.0  # how often the deadline thread looks for overdue requests


class RewardHandle:
    """``score(items)`` -> Future[list[ScoreResult]], answered by the reward ranks.
    ``reward``: the deadlines of :func:`reply_deadline` (None: a request waits as long as
    it takes)."""

    def __init__(self, job: Job, reward: RewardConfig | None = None):
        n = job.role_size("reward")
        self._reward = reward
        self._to = [job.channel(f"reward/in/{r}", Score, Stop) for r in range(n)]
        self._from = job.channel("reward/out", Scored, Wake)  # read by the reply thread only
        self._wake = job.channel("reward/out", Scored, Wake)
        self._stopping = threading.Event()  # what stops the reply thread: never a message
        self._ids = itertools.count()
        self._next = itertools.cycle(range(n))
        self._pending: dict[int, _Pending] = {}
        self._retired: set[int] = set()  # sent again or given up: a late answer is dropped
        self.resent = self.lost = self.late = 0
        self._lock = threading.Lock()
        self._per_rank: dict[int, tuple[int, int]] = {}
        self._error: BaseException | None = None
        self._thread = start_thread("reward-replies", self._receive)
        if reward is not None:  # a thread of its own: each store wait that times out warns
            start_thread("reward-deadlines", self._watch)

    def score(self, items: list[ScoreItem]) -> Future[list[ScoreResult]]:
        fut: Future[list[ScoreResult]] = Future()
        with self._lock:
            if self._error is not None:  # the reply thread is gone: nothing would answer
                fut.set_exception(self._error)
                return fut
            self._send(_Pending(fut, 0, list(items), 0.0, 1))
        return fut

    def _send(self, p: _Pending) -> None:
        """``p`` as a new request to the next rank, due by its deadline (under the lock)."""
        request, rank = next(self._ids), next(self._next)
        wait = reply_deadline(self._reward, len(p.items)) if self._reward else math.inf
        self._pending[request] = p._replace(rank=rank, due=time.monotonic() + wait)
        self._to[rank].put(Score(request, p.items))

    def _watch(self) -> None:
        while not self._stopping.wait(POLL_S):
            self._expire()

    def _expire(self) -> None:
        """Send each overdue request again, once; score a twice overdue one 0 (failed)."""
        now, lost = time.monotonic(), []
        with self._lock:
            for request, p in [(q, p) for q, p in self._pending.items() if p.due <= now]:
                del self._pending[request]
                self._retired.add(request)
                n = len(p.items)
                if p.tries == 1:
                    self.resent += 1
                    self._send(p._replace(tries=2))
                    print(f"reward: request {request} ({n} items) unanswered by reward rank "
                          f"{p.rank} by its deadline: sent again", flush=True)  # fmt: skip
                else:
                    self.lost += 1
                    lost.append(p)
                    print(f"reward: request {request} ({n} items) unanswered twice: scored 0 "
                          f"as failed (counted in reward_lost)", flush=True)  # fmt: skip
        for p in lost:
            p.future.set_result([ScoreResult(0.0, failed=True) for _ in p.items])

    def waiting(self) -> str:
        """What the handle waits for, in words ("" when nothing)."""
        with self._lock:
            pending = list(self._pending.values())
        if not pending:
            return ""
        ranks = sorted({p.rank for p in pending})
        oldest = max(time.monotonic() - p.due for p in pending)
        due = "overdue" if oldest > 0 else "none overdue"
        return f"{len(pending)} score requests on reward ranks {ranks} ({due})"

    def _receive(self) -> None:
        """Hand each answer to its future. Any error (a reward rank failed, a message
        that is not an answer to a pending request) fails every future waiting and every
        later ``score``, then ends this thread by raising, which ends the controller's
        rank (rl/runtime/launch.py install_thread_hook): once this thread is gone nothing
        answers, so returning quietly left the job waiting forever. A message that breaks
        the protocol is a :class:`ProtocolError`, reported in one line."""
        while True:
            try:
                try:
                    msg = self._from.get()  # a Scored or a Wake: the channel checked
                except ChannelTimeout:  # no group to score for a while (a long evaluation)
                    continue
                if isinstance(msg, Wake):
                    if self._stopping.is_set():  # stop() woke us
                        return
                    raise ProtocolError("reward/out: a stop that this controller did not send")
                self._deliver(cast(Scored, msg))
            except BaseException as e:
                with self._lock:
                    self._error = e
                    waiting, self._pending = list(self._pending.values()), {}
                for p in waiting:
                    p.future.set_exception(e)
                raise

    def _deliver(self, msg: Scored) -> None:
        """Give ``msg``'s results to the request it answers, which must be pending and of
        as many items (else :class:`ProtocolError`); a late answer to a request sent again
        or given up is dropped, counted."""
        with self._lock:
            if msg.request in self._retired:
                self._retired.discard(msg.request)
                self.late += 1
                return
            if msg.request not in self._pending:
                raise ProtocolError(
                    f"reward/out: a reply to request {msg.request}, which is not pending"
                )
            fut, rank, n = (p := self._pending[msg.request]).future, p.rank, len(p.items)
            if len(msg.results) != n:
                raise ProtocolError(
                    f"reward/out: a reply to request {msg.request} with {len(msg.results)} "
                    f"results for its {n} items"
                )
            del self._pending[msg.request]
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
        self._stopping.set()
        self._wake.put(Wake())  # wakes the reply thread, which then sees the flag
        self._thread.join(timeout=5)
