"""A generator rank's watchdog with stand-in servers: which failures restart a server, and
when the restart budget is spent. Milliseconds."""

from __future__ import annotations

import pytest

from rl.serving.watchdog import Watchdog


class FakeServer:
    def __init__(self, index: int) -> None:
        self.index, self.url = index, f"http://127.0.0.1:{9000 + index}"
        self.up, self.answers = True, True

    def alive(self) -> bool:
        return self.up

    def healthy(self, timeout: float = 5.0) -> bool:
        return self.answers

    def error(self, what: str) -> Exception:
        return RuntimeError(f"server {self.index} {what}; last log lines: ...")


class FakeLauncher:
    def __init__(self, n: int) -> None:
        self.servers = [FakeServer(i) for i in range(n)]
        self.restarted: list[int] = []

    def restart(self, index: int) -> None:
        self.restarted.append(index)
        self.servers[index].up = self.servers[index].answers = True


def _dog(launcher, now, max_restarts=2, window=100.0, failures=3):
    return Watchdog(
        launcher, max_restarts, window, 1.0, health_failures=failures, clock=lambda: now[0]
    )


def test_an_exited_server_is_reported_then_restarted_at_once():
    launcher, now = FakeLauncher(2), [0.0]
    seen: list[tuple[int, str, list[int]]] = []

    def down(i: int, why: str) -> None:
        seen.append((i, why, list(launcher.restarted)))

    dog = Watchdog(launcher, 2, 100.0, 1.0, health_failures=3, clock=lambda: now[0], on_down=down)
    assert dog.check() == []
    launcher.servers[1].up = False
    (done,) = dog.check()
    assert (done.index, done.why) == (1, "exited") and launcher.restarted == [1]
    assert seen == [(1, "exited", [])]  # reported before the restart began
    assert dog.check() == [] and dog.restarts == 1


def test_an_unresponsive_server_is_restarted_after_consecutive_failed_checks():
    launcher, now = FakeLauncher(1), [0.0]
    dog = _dog(launcher, now, failures=3)
    launcher.servers[0].answers = False
    assert dog.check() == [] and dog.check() == []
    launcher.servers[0].answers = True  # one good answer resets the count
    assert dog.check() == []
    launcher.servers[0].answers = False
    assert dog.check() == [] and dog.check() == []
    (done,) = dog.check()
    assert done.why == "failed 3 health checks in a row" and launcher.restarted == [0]


def test_restarts_beyond_the_budget_in_the_window_fail_with_the_servers_log():
    launcher, now = FakeLauncher(1), [0.0]
    dog = _dog(launcher, now, max_restarts=2, window=100.0)
    for t in (0.0, 50.0):
        now[0] = t
        launcher.servers[0].up = False
        assert len(dog.check()) == 1
    now[0] = 90.0
    launcher.servers[0].up = False
    with pytest.raises(
        RuntimeError, match=r"exited, after 2 restarts within 100s .*max_restarts=2"
    ):
        dog.check()
    now[0] = 101.0  # the first restart left the window: one more is allowed
    assert len(dog.check()) == 1 and launcher.restarted == [0, 0, 0]


def test_no_restarts_allowed():
    launcher, now = FakeLauncher(1), [0.0]
    dog = _dog(launcher, now, max_restarts=0)
    launcher.servers[0].up = False
    with pytest.raises(RuntimeError, match="after 0 restarts"):
        dog.check()
    assert launcher.restarted == []
