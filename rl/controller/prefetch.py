"""Off the critical path between two trainer steps: the next batch, taken from the rollout
stream and assembled ahead of time (:class:`BatchPrefetch`), and the finished step's
records, written while the next step runs (:class:`Background`).

Why: the controller's loop is train -> push weights -> take the next batch -> assemble it
-> train. Taking and assembling only after the push puts them on the critical path
between two trainer steps, although the groups of the next batch are usually finished
long before (async mode generates them while the trainer trains). :meth:`request` starts
taking them on a thread of its own as soon as the current step's training starts, and
:meth:`take` hands the assembled batch over, waiting only for what is not ready yet.

The batch of step t+1 is checked against the trainer's version after step t's push,
``version + 1`` (every push publishes exactly the next version, or raises): a group that
is too old for that version is dropped and counted exactly as it would be after the push,
and none can be too new (version + 1 reaches the servers only with that push). Groups
taken ahead are out of the stream, so the loop never requests across a step whose end
saves the stream's state (rl/controller/rollout_state.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from rl.threads import start_thread, thread_pool

if TYPE_CHECKING:
    from rl.batch import TrainBatch
    from rl.controller.rollouts import Group, RolloutStream

Batch = tuple[list["Group"], "TrainBatch", dict[str, float]]


Assemble = Callable[[list["Group"], int, dict[str, float]], "TrainBatch"]


class BatchPrefetch:
    """``assemble(groups, trainer_version, metrics)`` builds the trainer's batch from a
    step's groups (and may add its own timings to the stream's ``metrics``)."""

    def __init__(self, stream: RolloutStream, assemble: Assemble) -> None:
        self.stream, self.assemble = stream, assemble
        self._next: Future[Batch] | None = None
        self._version: int | None = None

    def request(self, trainer_version: int) -> None:
        """Start taking (and assembling) the batch the trainer will train on at
        ``trainer_version``."""
        if self._next is not None:
            raise RuntimeError(f"a batch for version {self._version} is already requested")
        fut: Future[Batch] = Future()
        self._next, self._version = fut, trainer_version

        def run() -> None:
            try:
                groups, m = self.stream.next_batch(trainer_version)
                t0 = time.perf_counter()
                batch = self.assemble(groups, trainer_version, m)
                m["assemble_s"] = time.perf_counter() - t0
                fut.set_result((groups, batch, m))
            except BaseException as e:  # handed to take(); the stream's own errors too
                fut.set_exception(e)

        # A daemon: a thread still waiting for a batch when the job ends must not hold it.
        start_thread("batch-prefetch", run)

    def take(self, trainer_version: int) -> Batch:
        """The batch for ``trainer_version`` (requested now if it was not), with the
        stream's stats; ``wait_batch_s`` is how long this call waited for it."""
        if self._next is None:
            self.request(trainer_version)
        assert self._next is not None
        if self._version != trainer_version:
            raise RuntimeError(
                f"the batch taken ahead was checked against version {self._version}, "
                f"not the trainer's {trainer_version}"
            )
        t0 = time.perf_counter()
        fut, self._next = self._next, None
        groups, batch, m = fut.result()
        m["wait_batch_s"] = time.perf_counter() - t0
        return groups, batch, m


class Background:
    """Runs calls one at a time, in order, on a thread of its own (a step's metrics and
    rollout records: file writes the next step need not wait for). The first call that
    raised raises again from the next :meth:`submit`, :meth:`drain` or :meth:`close`."""

    def __init__(self, name: str) -> None:
        self._pool = thread_pool(name, 1)
        self._last: Future[None] | None = None
        self._error: BaseException | None = None

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def submit(self, fn: Callable[..., object], *args: object) -> None:
        self._raise()

        def call() -> None:
            if self._error is None:  # nothing runs after a failed call
                try:
                    fn(*args)
                except BaseException as e:
                    self._error = e

        self._last = self._pool.submit(call)

    def drain(self) -> None:
        """Wait until every call submitted before this one has run."""
        if self._last is not None:
            self._last.result()
        self._raise()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.drain()
