"""A line when the RL loop stops moving: what it waits for, every ``rl.stall_warn_s``.

A run that waits for ever in silence (a lost message, a peer that hangs without dying)
looks to its user exactly like a slow one. The loop says where it is (:meth:`StallWatch.at`)
and the watch thread prints, once per quiet period, one line naming that place and what
the handles report waiting for (the reward requests in flight, say); the loop itself
is never interrupted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from rl.threads import start_thread


class StallWatch:
    """Say in one line, each ``after_s`` without a call to :meth:`at`, what the loop waits
    for: its place and each non-empty ``waiting()`` of ``sources``. ``after_s`` 0: off."""

    def __init__(
        self,
        after_s: float,
        sources: Sequence[Callable[[], str]] = (),
        say: Callable[[str], None] = lambda line: print(line, flush=True),
    ) -> None:
        self.after_s, self.sources, self.say = after_s, list(sources), say
        self._where, self._since = "setup", time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def at(self, where: str) -> None:
        """The loop moved on and now waits for ``where`` ("the batch of step 3")."""
        self._where, self._since = where, time.monotonic()

    def start(self) -> StallWatch:
        if self.after_s > 0:
            self._thread = start_thread("stall-watch", self._watch)
        return self

    def line(self, quiet_s: float) -> str:
        """The line for ``quiet_s`` seconds without progress."""
        said = [f"no progress for {quiet_s:.0f}s: waiting for {self._where}"]
        said += [w for w in (source() for source in self.sources) if w]
        return "; ".join(said)

    def _watch(self) -> None:
        said_at = self._since  # the last line, or the start
        while not self._stop.wait(min(self.after_s, 5.0) / 5):
            now = time.monotonic()
            if now - max(said_at, self._since) >= self.after_s:  # quiet since both
                said_at = now
                self.say(self.line(now - self._since))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
