"""The job's plumbing on real processes: one process group per executor role, typed
channels over the job store (chunked past the store's 8 MB limit), remote failures."""

from __future__ import annotations

import pytest

from rl.config import compose
from rl.dist.launch import spawn
from tests.helpers.channel_workers import role_rank


@pytest.fixture(scope="module")
def cfg():
    return compose(["rl.steps=0", "cluster.roles.generator=0", "cluster.roles.reward=0"])


def test_roles_get_their_own_groups_and_channels_carry_big_messages(cfg):
    out = spawn(role_rank, 3, cfg, setup=False)
    ctrl = out[0]
    assert ctrl["world"] == 1  # the controller's group is itself alone
    assert sorted(p.rank for p in ctrl["got"]) == [1, 2]
    assert all(p.group_size == 2 and p.total == 3.0 for p in ctrl["got"])  # 1 + 2
    want = float(sum(range(3_000_000)))
    assert out[1]["sum"] == out[2]["sum"] == pytest.approx(want)
    assert "carries Ping, not Pong" in ctrl["wrong_type"]
    assert "within 1s" in ctrl["timed_out"]


def test_a_failed_executor_is_reported_with_its_traceback(cfg):
    ctrl = spawn(role_rank, 3, cfg, 2, setup=False)[0]
    assert len(ctrl["got"]) == 1
    assert "trainer rank 1 failed" in ctrl["remote"]
    assert "ValueError: boom on purpose" in ctrl["remote"]


def test_wait_outlasts_the_channel_timeout_where_get_gives_up():
    """An idle executor's inbox may stay quiet for longer than rl.channel_timeout (a
    generator rank waits for Stop during the whole run): ``wait`` keeps waiting, ``get``
    raises ChannelTimeout."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from rl.dist.channel import Channel, ChannelTimeout
    from rl.dist.net import free_port
    from tests.helpers.channel_workers import Pong

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True,
                          timeout=timedelta(seconds=5))  # fmt: skip
    inbox = Channel(store, "idle/in", (Pong,), timeout=0.3)
    with pytest.raises(ChannelTimeout, match="within 0s"):
        inbox.get()
    sender = Channel(store, "idle/in", (Pong,), timeout=5)
    later = threading.Timer(1.2, lambda: sender.put(Pong(3, 1.0, 1)))
    later.start()
    t0 = time.monotonic()
    assert inbox.wait() == Pong(3, 1.0, 1)
    assert time.monotonic() - t0 > 1.0  # it outlasted several timeouts
    later.join()
