"""A generator rank's watch over its servers: notice a dead or unresponsive one, restart it.

Why on the generator rank: it owns the server processes (their launcher, their logs, their
ports), so it is the one place that can tell "exited" from "stopped answering" and start
the same server again on the same port, where clients already send to. What the restarted
server serves is not its business: it reports the restart, and the controller brings the
server to the current policy version (a DDMA push) before routing rollouts to it again.

Restarts are bounded: more than ``max_restarts`` within ``window_s`` seconds (a server
that cannot stay up: a bad node, a model that no longer fits) fails the job with the
server's own last log lines.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


class WatchedServer(Protocol):
    index: int
    url: str

    def alive(self) -> bool: ...

    def healthy(self, timeout: float = 5.0) -> bool: ...

    def error(self, what: str) -> Exception: ...


class Restarter(Protocol):
    @property
    def servers(self) -> Sequence[WatchedServer]: ...

    def restart(self, index: int) -> object: ...


@dataclass
class Restart:
    index: int  # the server's index on this rank
    why: str
    seconds: float  # how long the restart took (server ready again)


class Watchdog:
    """``check()`` once per watch period: returns the restarts it made, raises the
    server's error once its restart budget is spent. ``on_down(index, why)`` is called
    as soon as a server is found lost, before its restart."""

    def __init__(
        self,
        launcher: Restarter,
        max_restarts: int,
        window_s: float,
        health_timeout_s: float,
        *,
        health_failures: int,
        clock: Callable[[], float] = time.monotonic,
        on_down: Callable[[int, str], None] = lambda index, why: None,
        who: str = "generator",
        fields: str = "rollout",
    ) -> None:
        """``who``: how its lines name the servers; ``fields``: the config group of the
        restart budget, named when it is spent."""
        self.launcher, self.on_down = launcher, on_down
        self.who, self.fields = who, fields
        self.max_restarts, self.window_s = max_restarts, window_s
        self.health_timeout_s, self.health_failures = health_timeout_s, health_failures
        self.clock = clock
        self._failed = [0] * len(launcher.servers)  # consecutive failed health checks
        self._recent: deque[float] = deque()  # times of this rank's recent restarts
        self.restarts = 0

    def problem(self, i: int) -> str | None:
        """Why server ``i`` needs a restart, or None."""
        s = self.launcher.servers[i]
        if not s.alive():
            return "exited"
        if s.healthy(self.health_timeout_s):
            self._failed[i] = 0
            return None
        self._failed[i] += 1
        if self._failed[i] >= self.health_failures:
            return f"failed {self._failed[i]} health checks in a row"
        return None

    def check(self) -> list[Restart]:
        done = []
        for i in range(len(self.launcher.servers)):
            why = self.problem(i)
            if why is not None:
                done.append(self._restart(i, why))
        return done

    def _restart(self, i: int, why: str) -> Restart:
        now = self.clock()
        while self._recent and now - self._recent[0] > self.window_s:
            self._recent.popleft()
        s = self.launcher.servers[i]
        if len(self._recent) >= self.max_restarts:
            raise s.error(
                f"{why}, after {len(self._recent)} restarts within {self.window_s:.0f}s "
                f"({self.fields}.max_restarts={self.max_restarts}, "
                f"{self.fields}.restart_window_s={self.window_s:g})"
            )
        self._recent.append(now)
        self._failed[i] = 0
        print(f"[{self.who}] server {s.index} ({s.url}) {why}: restarting it", flush=True)
        self.on_down(i, why)  # before the restart: its clients stop using it now
        t0 = time.perf_counter()
        self.launcher.restart(i)
        self.restarts += 1
        took = time.perf_counter() - t0
        print(f"[{self.who}] server {s.index} ({s.url}) is back up after {took:.1f}s", flush=True)
        return Restart(i, why, took)
