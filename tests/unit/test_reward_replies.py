"""The controller's reward reply thread: an answer it cannot place, or a failed reward rank,
fails every waiting and every later request, and the thread ends by raising (which ends the
controller's rank, so the job fails in seconds instead of waiting forever). No message, even
one signed with the job's key, can stop it quietly, and a protocol error is
reported in one line naming the channel."""

from __future__ import annotations

import queue
import threading

import pytest

from rl.reward.service import RewardHandle, Scored, Wake
from rl.runtime import launch
from rl.runtime.channel import ChannelError, ChannelTimeout, ProtocolError
from rl.tasks.scoring import ScoreItem, ScoreResult


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
    with pytest.raises(ProtocolError) as e:
        waiting.result(timeout=5)
    assert str(e.value) == "reward/out: a reply to request 99, which is not pending"
    handle._thread.join(5)
    assert not handle._thread.is_alive() and died == [e.value]
    with pytest.raises(ChannelError):  # nothing would ever answer a later request
        handle.score([ScoreItem("p", "r", "1")]).result(timeout=1)


def test_a_quiet_reply_channel_is_not_an_error(died):
    handle, job = _handle()
    job.queues["reward/out"].put(ChannelTimeout("no message within 1800s"))
    fut = handle.score([ScoreItem("p", "r", "1")])
    job.queues["reward/out"].put(Scored(0, [ScoreResult(1.0)], 0, 0))
    assert fut.result(timeout=5) == [ScoreResult(1.0)]
    handle.stop()
    assert not died and not handle._thread.is_alive()


@pytest.mark.parametrize(
    ("msg", "error"),
    [
        # The stop signal was this reply: the thread ended quietly, the group hung forever.
        (Scored(-1, [], 0, 0), "reward/out: a reply to request -1, which is not pending"),
        (Wake(), "reward/out: a stop that this controller did not send"),
        (Scored(0, [], 0, 0), "reward/out: a reply to request 0 with 0 results for its 1 items"),
    ],
)
def test_no_signed_message_stops_the_replies_quietly(died, msg: object, error: str) -> None:
    handle, job = _handle()
    waiting = handle.score([ScoreItem("p", "r", "1")])
    job.queues["reward/out"].put(msg)
    with pytest.raises(ProtocolError) as e:
        waiting.result(timeout=5)  # failed at once, not left waiting
    assert str(e.value) == error
    handle._thread.join(5)
    assert not handle._thread.is_alive() and died == [e.value]


def test_a_protocol_error_ends_the_rank_with_one_line(monkeypatch) -> None:
    """What the launcher gets when the reply thread dies of one (a traceback otherwise)."""
    reports: list[str] = []
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)  # restored after
    monkeypatch.setattr(launch.os, "_exit", lambda code: reports.append(f"exit {code}"))
    launch.install_thread_hook(reports.append)

    def die(e: BaseException) -> None:
        raise e

    for e in (ProtocolError("reward/out: a reply to request 7, which is not pending"),
              ValueError("a bug")):  # fmt: skip
        t = threading.Thread(target=die, args=(e,), name="reward-replies")
        t.start()
        t.join(5)
    assert reports[:2] == [
        "thread 'reward-replies' died: ProtocolError: reward/out: a reply to request 7, "
        "which is not pending",
        "exit 1",
    ]
    assert reports[2].startswith("thread 'reward-replies' died:\nTraceback") and len(reports) == 4
