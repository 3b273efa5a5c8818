"""Score rollouts in worker processes, in parallel with training, without ever crashing.

Why processes and our own dispatch: scorers are CPU-bound Python (sympy inside
``math-verify``) and can hang on adversarial text. A stuck worker is killed and replaced
when its item overruns ``timeout_s``; an exception or a dead worker gives that item
reward 0. Each outcome is counted (``timeouts``, ``failures``) so a run can report them,
and the trainer never waits on a hung scorer for longer than the timeout.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import multiprocessing.connection
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from rl.reward.scorers import resolve


def _worker(scorer_name: str, conn: Any) -> None:
    scorer = resolve(scorer_name)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        task_id, response, answer = msg
        try:
            conn.send((task_id, True, float(scorer(response, answer))))
        except Exception as e:  # the item scores 0; the worker lives on
            conn.send((task_id, False, f"{type(e).__name__}: {e}"))


@dataclass
class _Slot:
    proc: Any
    conn: Any
    task: tuple[int, float] | None = None  # (task id, deadline)


@dataclass
class RewardStats:
    scored: int = 0
    failures: int = 0
    timeouts: int = 0
    last_error: str = ""


class RewardExecutor:
    """``submit(response, answer)`` -> Future[float]; ``score(pairs)`` blocks for a batch."""

    def __init__(self, scorer: str = "exact", workers: int = 2, timeout_s: float = 5.0):
        resolve(scorer)  # bad names fail here, before any process starts
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"reward workers={workers} must be >= 1, timeout_s={timeout_s} > 0")
        self.scorer, self.timeout_s = scorer, timeout_s
        self.stats = RewardStats()
        self._ctx = mp.get_context("spawn")
        self._ids = itertools.count()
        self._queue: deque[tuple[int, str, str]] = deque()
        self._futures: dict[int, Future] = {}
        self._lock = threading.Condition()
        self._slots = [self._spawn() for _ in range(workers)]
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="reward-dispatch", daemon=True)
        self._thread.start()

    def _spawn(self) -> _Slot:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker, args=(self.scorer, child), daemon=True)
        proc.start()
        child.close()
        return _Slot(proc, parent)

    # ------------------------------------------------------------------ API
    def submit(self, response: str, answer: str) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("reward executor is closed")
            task_id = next(self._ids)
            self._futures[task_id] = fut
            self._queue.append((task_id, response, answer))
            self._lock.notify()
        return fut

    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        return [f.result() for f in [self.submit(r, a) for r, a in pairs]]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=10)
        for s in self._slots:
            if s.proc.is_alive():
                s.proc.kill()
            s.proc.join(timeout=5)

    def __enter__(self) -> RewardExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ dispatch
    def _finish(self, task_id: int, reward: float) -> None:
        fut = self._futures.pop(task_id, None)
        if fut is not None:
            fut.set_result(reward)

    def _fail(self, slot: _Slot, why: str, timeout: bool, score: bool = True) -> None:
        """Give the slot a fresh worker; with ``score``, its item gets reward 0 and counts
        as a timeout or a failure (without, the caller re-queues the item)."""
        task_id = slot.task[0]  # type: ignore[index]
        slot.proc.kill()
        slot.proc.join(timeout=5)
        fresh = self._spawn()
        slot.proc, slot.conn, slot.task = fresh.proc, fresh.conn, None
        if score:
            if timeout:
                self.stats.timeouts += 1
            else:
                self.stats.failures += 1
            self.stats.last_error = why
            self._finish(task_id, 0.0)

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    for s in self._slots:
                        if s.task is None and s.proc.is_alive():
                            s.conn.send(None)
                    return
                for s in self._slots:
                    if s.task is None and self._queue:
                        item = self._queue.popleft()
                        s.task = (item[0], time.monotonic() + self.timeout_s)
                        try:
                            s.conn.send(item)
                        except OSError:  # the idle worker died: retry on a fresh one
                            self._queue.appendleft(item)
                            self._fail(s, "reward worker died", timeout=False, score=False)
            busy = [s for s in self._slots if s.task is not None]
            conns = [s.conn for s in busy]
            ready = multiprocessing.connection.wait(conns, timeout=0.05) if busy else []
            if not busy:
                with self._lock:
                    if not self._queue and not self._closed:
                        self._lock.wait(timeout=0.5)
                continue
            for s in busy:
                if s.conn in ready:
                    try:
                        task_id, ok, value = s.conn.recv()
                    except (EOFError, OSError):
                        self._fail(s, "reward worker died", timeout=False)
                        continue
                    s.task = None
                    if ok:
                        self.stats.scored += 1
                        self._finish(task_id, value)
                    else:
                        self.stats.failures += 1
                        self.stats.last_error = value
                        self._finish(task_id, 0.0)
                elif time.monotonic() > s.task[1]:  # type: ignore[index]
                    self._fail(s, f"scorer exceeded {self.timeout_s}s", timeout=True)
