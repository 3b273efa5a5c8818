"""The controller's reward reply thread: an answer it cannot place, or a failed reward rank,
fails every waiting and every later request, and the thread ends by raising (which ends the
controller's rank, so the job fails in seconds instead of waiting forever). No message, even
one signed with the job's key, can stop it quietly, and a protocol error is
reported in one line naming the channel."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from rl.config.schema import RewardConfig
from rl.reward import service as reward_service
from rl.reward.service import RewardHandle, Score, Scored, Wake
from rl.runtime import launch
from rl.runtime.channel import ChannelError, ChannelTimeout, ProtocolError
from rl.tasks.scoring import ScoreItem, ScoreResult


class _Channel:
    def __init__(self, q: queue.Queue):
        self.q = q

    def put(self, msg: object) -> None:
        self.q.put(msg)

    def get(self, timeout: float | None = None) -> object:
        try:
            msg = self.q.get(timeout=timeout)
        except queue.Empty:
            raise ChannelTimeout(f"no message within {timeout}s") from None
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


def _handle(reward: RewardConfig | None = None) -> tuple[RewardHandle, _Job]:
    job = _Job()
    return RewardHandle(job, reward), job  # type: ignore[arg-type]


# Due 0.3 s after it is sent: one item of 0.1 s, plus a 0.2 s margin.
FAST = RewardConfig(timeout_s=0.1, reply_margin_s=0.2)


def _requests(job: _Job, until: float = 3.0) -> list[Score]:
    """The score requests sent until now (waiting until there is one more than taken)."""
    got = []
    q = job.queues["reward/in/0"]
    deadline = time.monotonic() + until
    while time.monotonic() < deadline:
        try:
            got.append(q.get(timeout=0.05))
        except queue.Empty:
            if got:
                return got
    return got


def test_a_lost_request_is_sent_again_once_and_a_late_answer_is_dropped(died, monkeypatch):
    """An outsider that pops a request (or a rank that loses it) does not leave its group
    waiting: it goes again after its deadline, and the first answer counts."""
    monkeypatch.setattr(reward_service, "POLL_S", 0.02)
    handle, job = _handle(FAST)
    t0 = time.monotonic()
    fut = handle.score([ScoreItem("p", "r", "1")])
    (lost,) = _requests(job)  # popped by someone else: never answered
    (again,) = _requests(job)
    assert again.items == lost.items and again.request != lost.request
    assert 0.3 <= time.monotonic() - t0 < 1.5 and handle.resent == 1
    job.queues["reward/out"].put(Scored(again.request, [ScoreResult(1.0)], 0, 0))
    assert fut.result(timeout=5) == [ScoreResult(1.0)]
    job.queues["reward/out"].put(Scored(lost.request, [ScoreResult(0.5)], 0, 0))  # late
    nxt = handle.score([ScoreItem("p", "r", "2")])
    (req,) = _requests(job)
    job.queues["reward/out"].put(Scored(req.request, [ScoreResult(0.0)], 0, 0))
    assert nxt.result(timeout=5) == [ScoreResult(0.0)]
    assert (handle.resent, handle.lost, handle.late) == (1, 0, 1) and not died
    handle.stop()


def test_a_request_lost_twice_scores_zero_as_failed_and_is_counted(died, monkeypatch, capsys):
    monkeypatch.setattr(reward_service, "POLL_S", 0.02)
    handle, job = _handle(FAST)
    fut = handle.score([ScoreItem("p", "r", "1"), ScoreItem("p", "s", "1")])
    assert len(_requests(job)) == 1 and len(_requests(job)) == 1  # both lost
    assert fut.result(timeout=5) == [ScoreResult(0.0, failed=True)] * 2
    assert (handle.resent, handle.lost) == (1, 1) and not died
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "reward: request 0 (2 items) unanswered by reward rank 0 by its deadline: sent again",
        "reward: request 1 (2 items) unanswered twice: scored 0 as failed (counted in reward_lost)",
    ]
    handle.stop()


def test_the_deadline_grows_with_the_items_a_rank_scores_at_a_time():
    r = RewardConfig(workers=4, timeout_s=5, reply_margin_s=60)
    assert [reward_service.reply_deadline(r, n) for n in (0, 1, 4, 5, 9)] == [65, 65, 65, 70, 75]
    judge = RewardConfig(fn="judge", reply_margin_s=1)
    judge.judge.timeout_s, judge.judge.concurrency = 30, 16
    assert reward_service.reply_deadline(judge, 17) == 61


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
