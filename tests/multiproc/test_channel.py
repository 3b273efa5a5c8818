"""The job's plumbing on real processes: one process group per executor role, typed
channels over the job store (chunked past the store's 8 MB limit), remote failures, and
a store that a process outside the job writes to."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rl.compose import compose
from rl.runtime import secret
from rl.runtime.launch import spawn
from tests.helpers.channel_workers import role_rank

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cfg():
    return compose(["rl.steps=0", "cluster.roles.generator=0", "cluster.roles.reward=0"])


@pytest.fixture(autouse=True)
def key(tmp_path, monkeypatch) -> bytes:
    """The job's secret, as rl.train's main makes it: every spawned rank reads this file."""
    monkeypatch.setenv(secret.ENV, str(tmp_path / secret.NAME))  # restored afterwards
    return secret.load(secret.ensure(tmp_path))


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
    assert ctrl["store_listens"] == ["127.0.0.1"]  # the job's store: loopback, not every interface


def test_a_failed_executor_is_reported_with_its_traceback(cfg):
    ctrl = spawn(role_rank, 3, cfg, 2, setup=False)[0]
    assert len(ctrl["got"]) == 1
    assert "trainer rank 1 failed" in ctrl["remote"]
    assert "ValueError: boom on purpose" in ctrl["remote"]


def test_wait_outlasts_the_channel_timeout_where_get_gives_up(key):
    """An idle executor's inbox may stay quiet for longer than rl.channel_timeout (a
    generator rank waits for Stop during the whole run): ``wait`` keeps waiting, ``get``
    raises ChannelTimeout."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from rl.runtime.channel import Channel, ChannelTimeout
    from rl.runtime.net import free_port
    from tests.helpers.channel_workers import Pong

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True,
                          timeout=timedelta(seconds=5))  # fmt: skip
    inbox = Channel(store, "idle/in", (Pong,), timeout=0.3, key=key)
    with pytest.raises(ChannelTimeout, match="within 0s"):
        inbox.get()
    sender = Channel(store, "idle/in", (Pong,), timeout=5, key=key)
    later = threading.Timer(1.2, lambda: sender.put(Pong(3, 1.0, 1)))
    later.start()
    t0 = time.monotonic()
    assert inbox.wait() == Pong(3, 1.0, 1)
    assert time.monotonic() - t0 > 1.0  # it outlasted several timeouts
    later.join()


# Run by a process outside the job: it reaches the store's port but holds no key.
OUTSIDER = textwrap.dedent(
    """
    import io, json, secrets, sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from rl.runtime import codec
    from tests.helpers.channel_workers import Pong

    port, name, target = int(sys.argv[1]), sys.argv[2], sys.argv[3]

    class Evil:  # unpickling it creates ``target``
        def __reduce__(self):
            return (open, (target, "w"))

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))
    buf = io.BytesIO()
    torch.save(Evil(), buf)  # what the old channel's torch.load would have run
    store.queue_push(name, b"I" + buf.getvalue())
    forged = codec.encode(Pong(66, 6.0, 6), (Pong,))  # well formed, but no valid tag
    store.queue_push(name, b"I" + secrets.token_bytes(32 + 24) + forged)
    # 8 MB of chunks under the channel's keys, and a descriptor naming them: unsigned, so
    # the reader must not fetch (nor delete) them.
    keys = [f"{name}/blob/outsider/{i}" for i in range(2)]
    for k in keys:
        store.set(k, bytes(4 << 20))
    desc = json.dumps({"keys": keys, "size": 8 << 20, "sha256": "0" * 64}).encode()
    store.queue_push(name, b"B" + secrets.token_bytes(32 + 24) + desc)
    """
)


def test_a_process_outside_the_job_cannot_make_a_reader_act(key, tmp_path):
    """An outsider pushes the old exploit (a pickle that creates a file), a forged message
    and a forged chunked one onto a reader's queue; the reader drops all three, counted,
    runs nothing, fetches none of the forged chunks, and gets the legitimate message that
    follows."""
    from datetime import timedelta

    import torch.distributed as dist

    from rl.runtime.channel import Channel, queue_name, rejected_total
    from rl.runtime.net import free_port
    from tests.helpers.channel_workers import Pong

    port, target = free_port(), tmp_path / "pwned"
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=30),
                          wait_for_workers=False)  # fmt: skip
    reader = Channel(store, "victim/in", (Pong,), timeout=30, key=key)
    before = rejected_total()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(secret.ENV)  # the outsider has no key
    # Without the key it cannot name the queue; given its name (leaked, say), it still
    # cannot make the reader act.
    queue = queue_name(key, "victim/in")
    for name in ("victim/in", queue):
        subprocess.run([sys.executable, "-c", OUTSIDER, str(port), name, str(target)],
                       env=env, check=True, timeout=120)  # fmt: skip
    Channel(store, "victim/in", (Pong,), timeout=30, key=key).put(Pong(1, 2.0, 3))
    assert reader.get() == Pong(1, 2.0, 3)
    assert not target.exists()
    assert reader.rejected == 3 and rejected_total() - before == 3
    assert store.check([f"{queue}/blob/outsider/{i}" for i in range(2)])  # never fetched


class _StoreJob:
    """A job's channel endpoints over a real store (one reward rank), without its
    process groups: the reward protocol's real messages through the real codec."""

    role_rank = 0

    def __init__(self, store, key: bytes):
        self.store, self.key = store, key

    def channel(self, name: str, *types: type):
        from rl.runtime.channel import Channel

        return Channel(self.store, name, types, 30, key=self.key)

    def role_size(self, role: str) -> int:
        return 1


def test_the_reward_protocol_runs_over_authenticated_channels(key):
    import threading
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from rl.reward.service import RewardHandle, serve
    from rl.runtime.channel import rejected_total
    from rl.runtime.net import free_port
    from tests.helpers.reward_scorers import item

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True,
                          timeout=timedelta(seconds=30))  # fmt: skip
    job = _StoreJob(store, key)
    reward = SimpleNamespace(fn="tests.helpers.reward_scorers:flaky", workers=1, timeout_s=5)
    before = rejected_total()
    rank = threading.Thread(target=serve, args=(reward, job), kwargs={"output_dir": ""},
                            daemon=True)  # fmt: skip
    rank.start()
    handle = RewardHandle(job)
    try:
        items = [item("4", "4", "2+2?", level=2, tags=["a"]), item("boom", {"x": [1, None]})]
        results = handle.score(items).result(timeout=60)
        assert [(r.score, r.failed) for r in results] == [(1.0, False), (0.0, True)]
        assert handle.score([]).result(timeout=30) == [] and handle.failures == 1
    finally:
        handle.stop()
        rank.join(timeout=15)
    assert not rank.is_alive() and rejected_total() == before
