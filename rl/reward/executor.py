"""Score rollouts in worker processes, in parallel with training, without ever crashing.

Why processes and our own dispatch: reward functions are CPU-bound Python (sympy inside
``math-verify``), user code, and can hang on adversarial text. A stuck worker is killed
and replaced when its item overruns ``timeout_s``; an exception, a return value that is
not a score, or a dead worker gives that item a failed score of 0. Each outcome is counted
(``timeouts``, ``failures``) so a run can report them, and the trainer never waits on a
hung function for longer than the timeout.

Workers load the function themselves, by spec (rl/tasks/scoring.py): a function from a
file must load in a fresh process too. A worker says when it is ready, and only then gets
items, so its start-up (imports, sympy's first call) never counts against an item's limit.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import multiprocessing.connection
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import KW_ONLY, dataclass

from rl.tasks.scoring import ScoreItem, ScoreResult, absolute, call, load, prepare

_READY = -1  # the task id of a worker's "loaded, send me items" message
_START_S = 120.0  # a worker must load its function within this (imports can be slow)
_START_RETRIES = 3  # per worker, in a row, before the function is given up on


def _worker(spec: str, conn: multiprocessing.connection.Connection) -> None:
    try:
        fn, error = load(spec), ""
        prepare(fn)
    except Exception as e:  # every item fails with the reason; the worker stays up
        fn, error = None, f"loading {spec!r}: {type(e).__name__}: {e}"
    conn.send((_READY, True, None))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        task_id, item = msg
        if fn is None:
            conn.send((task_id, False, error))
            continue
        try:
            result = call(fn, item)
        except Exception as e:  # the item scores 0; the worker lives on
            conn.send((task_id, False, f"{type(e).__name__}: {e}"))
            continue
        conn.send((task_id, True, result))


@dataclass
class _Slot:
    proc: mp.process.BaseProcess
    conn: multiprocessing.connection.Connection
    task: tuple[int, float] | None = None  # (task id, deadline)
    ready: bool = False  # loaded its function; takes items
    _: KW_ONLY
    started: float = 0.0  # time.monotonic() at spawn
    dead: bool = False  # failed to start too often; never used again


@dataclass
class RewardStats:
    scored: int = 0
    failures: int = 0
    timeouts: int = 0
    last_error: str = ""


class RewardExecutor:
    """``submit(item)`` -> Future[ScoreResult]; ``score(items)`` blocks for a batch."""

    def __init__(self, fn_spec: str = "exact", workers: int = 2, timeout_s: float = 5.0):
        load(fn_spec)  # a bad spec fails here (RewardFnError), before any process starts
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"reward workers={workers} must be >= 1, timeout_s={timeout_s} > 0")
        self.fn_spec, self.timeout_s = absolute(fn_spec), timeout_s
        self.stats = RewardStats()
        self._ctx = mp.get_context("spawn")
        self._ids = itertools.count()
        self._queue: deque[tuple[int, ScoreItem]] = deque()
        self._futures: dict[int, Future] = {}
        self._lock = threading.Condition()  # re-entrant: _finish is called with it held
        self._start_failures = 0  # consecutive worker deaths before ready
        self._broken = ""  # set when no worker can start: items then fail at once
        self._slots = [self._spawn() for _ in range(workers)]
        self._closed = False
        self._thread = threading.Thread(target=self._dispatch, name="reward-dispatch", daemon=True)
        self._thread.start()

    def _spawn(self) -> _Slot:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker, args=(self.fn_spec, child), daemon=True)
        proc.start()
        child.close()
        return _Slot(proc, parent, started=time.monotonic())

    # ------------------------------------------------------------------ API
    def submit(self, item: ScoreItem) -> Future[ScoreResult]:
        fut: Future[ScoreResult] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("reward executor is closed")
            task_id = next(self._ids)
            self._futures[task_id] = fut
            self._queue.append((task_id, item))
            self._lock.notify()
        return fut

    def score(self, items: list[ScoreItem]) -> list[ScoreResult]:
        return [f.result() for f in [self.submit(item) for item in items]]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=10)
        with self._lock:  # nobody will score these now; do not leave their callers waiting
            left, self._futures = list(self._futures.values()), {}
        for fut in left:
            if not fut.done():
                fut.set_exception(RuntimeError("reward executor closed before scoring"))
        for s in self._slots:
            if s.proc.is_alive():
                s.proc.kill()
            s.proc.join(timeout=5)

    def __enter__(self) -> RewardExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ dispatch
    def _finish(self, task_id: int, result: ScoreResult) -> None:
        with self._lock:
            fut = self._futures.pop(task_id, None)
        if fut is not None:
            fut.set_result(result)

    def _failed(self, task_id: int, why: str, timeout: bool = False) -> None:
        if timeout:
            self.stats.timeouts += 1
        else:
            self.stats.failures += 1
        self.stats.last_error = why
        self._finish(task_id, ScoreResult(0.0, {}, failed=True))

    def _respawn(self, slot: _Slot, why: str, timeout: bool, score: bool = True) -> None:
        """Give the slot a fresh worker; with ``score``, its item gets a failed 0 and counts
        as a timeout or a failure (without, the caller re-queues the item, if any)."""
        task = slot.task
        slot.proc.kill()
        slot.proc.join(timeout=5)
        fresh = self._spawn()
        slot.proc, slot.conn, slot.task = fresh.proc, fresh.conn, None
        slot.ready, slot.started = False, fresh.started
        if score and task is not None:
            self._failed(task[0], why, timeout)
        else:
            self.stats.last_error = why

    def _send(self, slot: _Slot, entry: tuple[int, ScoreItem]) -> None:
        slot.task = (entry[0], time.monotonic() + self.timeout_s)
        try:
            slot.conn.send(entry)
        except OSError:  # the idle worker died: retry the item on a fresh one
            self._queue.appendleft(entry)
            self._respawn(slot, "reward worker died while idle", timeout=False, score=False)
        except Exception as e:  # the item does not pickle: it alone fails, the worker is fine
            slot.task = None
            self._failed(entry[0], f"cannot send the item to a worker: {type(e).__name__}: {e}")

    def _start_failed(self, slot: _Slot, why: str) -> None:
        """A worker that dies or hangs before it is ready: retry a few times, then give up
        on the function, failing every item rather than spawning processes forever."""
        self._start_failures += 1
        if self._start_failures < _START_RETRIES * len(self._slots):
            self._respawn(slot, why, timeout=False)
            return
        slot.proc.kill()
        slot.proc.join(timeout=5)
        slot.conn.close()
        slot.dead = True
        self.stats.last_error = why
        if all(s.dead for s in self._slots):
            self._broken = f"every reward worker failed to start ({why})"

    def _dispatch(self) -> None:
        try:
            self._run()
        except BaseException as e:  # a bug here must fail the callers, not leave them waiting
            with self._lock:
                self._closed = True
                left, self._futures = list(self._futures.values()), {}
            for fut in left:
                if not fut.done():
                    fut.set_exception(RuntimeError(f"reward dispatch failed: {e!r}"))
            raise

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    for s in self._slots:
                        if not s.dead and s.task is None and s.proc.is_alive():
                            try:
                                s.conn.send(None)
                            except OSError:
                                pass
                    return
                if self._broken:
                    while self._queue:
                        self._failed(self._queue.popleft()[0], self._broken)
                for s in self._slots:
                    if s.ready and s.task is None and self._queue:
                        self._send(s, self._queue.popleft())
            waiting = [s for s in self._slots if not s.dead and (s.task is not None or not s.ready)]
            if not waiting:
                with self._lock:
                    if not self._queue and not self._closed:
                        self._lock.wait(timeout=0.5)
                continue
            answered = multiprocessing.connection.wait([s.conn for s in waiting], timeout=0.05)
            now = time.monotonic()
            for s in waiting:
                if s.conn in answered:
                    try:
                        task_id, ok, value = s.conn.recv()
                    except (EOFError, OSError):
                        if s.ready:
                            self._respawn(s, "reward worker died", timeout=False)
                        else:
                            self._start_failed(s, "reward worker died while starting")
                        continue
                    if task_id == _READY:
                        s.ready, self._start_failures = True, 0
                    elif ok:
                        s.task = None
                        self.stats.scored += 1
                        self._finish(task_id, value)
                    else:
                        s.task = None
                        self._failed(task_id, value)
                elif s.task is not None and now > s.task[1]:
                    self._respawn(s, f"reward fn exceeded {self.timeout_s}s", timeout=True)
                elif not s.ready and now > s.started + _START_S:
                    self._start_failed(s, f"reward worker not ready after {_START_S}s")
