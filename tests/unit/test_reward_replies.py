"""The controller's reward reply thread: an answer it cannot place, or a failed reward rank,
fails every waiting and every later request, and the thread ends by raising (which ends the
controller's rank, so the job fails in seconds instead of waiting forever)."""

from __future__ import annotations

import queue
import threading

import pytest

from rl.reward.service import RewardHandle, Scored
from rl.runtime.channel import ChannelError, ChannelTimeout
from rl.tasks.scoring import ScoreItem


class _Channel:
    def __init__(self, q: queue.Queue):
        self.q = q

    def put(self, msg: object) -> None:
        self.q.put(msg)

    def get(self, timeout: float | None = None) -> object:
        msg = self.q.get()
        if isinstance(msg, BaseException):
            raise msg
        return msg


class _Job:
    def __init__(self):
        self.queues: dict[str, queue.Queue] = {}

    def role_size(self, role: str) -> int:
        return 1

    def channel(self, name: str, *types: type) -> _Channel:
        return _Channel(self.queues.setdefault(name, queue.Queue()))


@pytest.fixture
def died(monkeypatch):
    """The exceptions that ended threads (instead of pytest's unhandled-thread warning)."""
    seen: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: seen.append(a.exc_value))
    return seen


def _handle() -> tuple[RewardHandle, _Job]:
    job = _Job()
    return RewardHandle(job), job  # type: ignore[arg-type]


def test_an_answer_to_no_pending_request_fails_everything_and_ends_the_thread(died):
    handle, job = _handle()
    waiting = handle.score([ScoreItem("p", "r", "1")])
    job.queues["reward/out"].put(Scored(99, [], 0, 0))  # answers nothing that was asked
    with pytest.raises(ChannelError, match="request 99, which is not pending"):
        waiting.result(timeout=5)
    handle._thread.join(5)
    assert not handle._thread.is_alive() and isinstance(died[0], ChannelError)
    with pytest.raises(ChannelError):  # nothing would ever answer a later request
        handle.score([ScoreItem("p", "r", "1")]).result(timeout=1)


def test_a_quiet_reply_channel_is_not_an_error(died):
    handle, job = _handle()
    job.queues["reward/out"].put(ChannelTimeout("no message within 1800s"))
    fut = handle.score([ScoreItem("p", "r", "1")])
    job.queues["reward/out"].put(Scored(0, [], 0, 0))
    assert fut.result(timeout=5) == []
    handle.stop()
    assert not died and not handle._thread.is_alive()
