"""The controller's weight sync without servers: each version is committed on every server
or on none, and ``weight_version`` moves only when it is. Stand-ins for the trainer's
handle and the SGLang targets record what the sync asked of them. Milliseconds."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from rl.controller.weight_sync import WeightSync
from rl.ddma import transport
from rl.ddma.engine import TransferError
from rl.ddma.plan import DstLayout, SrcLayout, make_plan
from rl.ddma.relay import Fanout, Relaying
from rl.generator.ddma_target import UpstreamLost
from rl.trainer.service import Pushed, Rendezvous
from rl.weights import keymap as km

D = km.Dims(
    layers=2, hidden=64, ffn=256, heads=4, groups=2, head_dim=16, vocab=512,
    padded_vocab=512, tied=False, qkv_bias=False,
)  # fmt: skip
PLAN = make_plan(D, SrcLayout(1), DstLayout(1), 4, 1 << 16)


class FakeTarget:
    def __init__(
        self, log: list[str], name: str, fail: str | None = None, lost: str | None = None,
        grouped: bool = False,
    ) -> None:  # fmt: skip
        self.log, self.name, self.fail, self.lost = log, name, fail, lost
        self.plan = PLAN
        self.transport = transport.get("p2p" if grouped else "ipc")

    def _do(self, op: str, version: int) -> None:
        self.log.append(f"{self.name}.{op}({version})")
        if op == self.fail:
            raise RuntimeError(f"{self.name} {op} failed")
        if op == self.lost:
            raise TransferError(f"{self.name} disconnected during {op}")

    def begin(self, version: int) -> None:
        self._do("begin", version)

    def commit(self, version: int) -> None:
        self._do("commit", version)

    def abort(self, version: int) -> None:
        self._do("abort", version)

    def open_group(
        self, name: str, address: str, port: int, position: int = 0, servers: int = 1
    ) -> Future:
        self.log.append(f"{self.name}.open({name} {position}/{servers})")
        f: Future = Future()
        f.set_result({})
        return f

    def receive(
        self, version: int, name: str, route: Fanout | None = None, replica: int = 0
    ) -> Future:
        assert route is not None
        self.log.append(f"{self.name}.receive({version} {name} {route.parents}#{replica})")
        f: Future = Future()
        if self.fail == "starved":  # a relay above it was lost
            f.set_exception(UpstreamLost(f"{self.name} missed version {version}"))
        else:
            f.set_result([])
        return f


class FakeTrainer:
    def __init__(self, log: list[str], lost: list[int] | None = None) -> None:
        self.log, self.lost = log, lost or []

    def connect(self, urls: list[str]) -> Rendezvous:
        self.log.append(f"connect({len(urls)})")
        return Rendezvous("127.0.0.1", [7000 + i for i in range(len(urls))])

    def join(self, address: str, ports: list[int], groups: list[list[int]]) -> None:
        self.log.append(f"join({ports}, {groups})")

    def reserve(self, n: int) -> Rendezvous:
        self.log.append(f"reserve({n})")
        return Rendezvous("127.0.0.1", [8000 + i for i in range(n)])

    def push(self, version: int, servers: list[int] | None = None) -> Pushed:
        self.log.append(f"push({version}, {servers})")
        return Pushed(10.0, 12.0, [i for i in self.lost if i in (servers or [])])


def test_each_push_is_the_next_version_on_every_server():
    log: list[str] = []
    targets = [FakeTarget(log, "s0"), FakeTarget(log, "s1")]
    sync = WeightSync(FakeTrainer(log), targets, weight_version=4)  # type: ignore[arg-type]
    stats = sync.push()
    assert sync.weight_version == 5 and stats.payload_bytes == 10.0 and stats.seconds >= 0
    assert stats.metrics()["sync_bytes"] == 10.0 and stats.metrics()["sync_lost_servers"] == 0
    assert log == ["s0.begin(5)", "s1.begin(5)", "push(5, [0, 1])", "s0.commit(5)", "s1.commit(5)"]
    sync.push()
    assert sync.weight_version == 6


def test_a_failed_commit_leaves_the_version_and_aborts_the_servers_not_committed():
    log: list[str] = []
    targets = [FakeTarget(log, "s0"), FakeTarget(log, "s1", fail="commit"), FakeTarget(log, "s2")]
    sync = WeightSync(FakeTrainer(log), targets, weight_version=1)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="s1 commit failed"):
        sync.push()
    assert sync.weight_version == 1
    # s1 aborts its own version when its commit fails; s2 never committed.
    assert log[-3:] == ["s0.commit(2)", "s1.commit(2)", "s2.abort(2)"]


def test_p2p_opens_every_group_while_the_trainer_joins_then_servers_receive():
    log: list[str] = []
    targets = [FakeTarget(log, "s0", grouped=True), FakeTarget(log, "s1", grouped=True)]
    trainer = FakeTrainer(log)
    sync = WeightSync(trainer, targets, weight_version=0)  # type: ignore[arg-type]
    where = trainer.connect(["a", "b"])
    sync._join(where.address, where.ports, [0, 1])
    assert sync.where == [("ddma-7000-0", 0), ("ddma-7000-1", 0)]  # a group per server
    sync.push()
    assert log[1:] == ["s0.open(ddma-7000-0 0/1)", "s1.open(ddma-7000-1 0/1)",
                       "join([7000, 7001], [[0], [1]])", "s0.begin(1)", "s1.begin(1)",
                       "s0.receive(1 ddma-7000-0 (-1,)#0)", "s1.receive(1 ddma-7000-1 (-1,)#0)",
                       "push(1, [0, 1])", "s0.commit(1)", "s1.commit(1)"]  # fmt: skip


def test_relayed_servers_share_a_group_and_each_push_forms_the_chain_over_those_begun():
    """Relaying, every server is in one group; a push tells each its place in the chain
    over the servers that began the version. A server starved by a lost relay above it
    misses the version (aborted: it keeps the previous one), reported lost."""
    log: list[str] = []
    targets = [FakeTarget(log, f"s{i}", grouped=True) for i in range(3)]
    trainer = FakeTrainer(log)
    sync = WeightSync(trainer, targets, weight_version=0, relaying=Relaying("chain", 1))  # type: ignore[arg-type]
    sync._join("127.0.0.1", [7000, 7001, 7002], [0, 1, 2])
    assert sync.where == [("ddma-7000-0", i) for i in range(3)]
    assert log == ["s0.open(ddma-7000-0 0/3)", "s1.open(ddma-7000-0 1/3)",
                   "s2.open(ddma-7000-0 2/3)", "join([7000], [[0, 1, 2]])"]  # fmt: skip
    log.clear()
    sync.push()
    assert log[3:6] == ["s0.receive(1 ddma-7000-0 (-1, 0, 1)#0)",
                        "s1.receive(1 ddma-7000-0 (-1, 0, 1)#1)",
                        "s2.receive(1 ddma-7000-0 (-1, 0, 1)#2)"]  # fmt: skip
    # s0 is lost at begin: the chain is s1 -> s2, re-formed without it.
    targets[0].lost, targets[2].fail = "begin", "starved"
    log.clear()
    stats = sync.push()
    assert stats.lost == [0, 2] and sync.weight_version == 2
    assert log == ["s0.begin(2)", "s1.begin(2)", "s2.begin(2)",
                   "s1.receive(2 ddma-7000-0 (-1, 0)#0)", "s2.receive(2 ddma-7000-0 (-1, 0)#1)",
                   "push(2, [1, 2])", "s1.commit(2)", "s2.abort(2)"]  # fmt: skip
    # Restarted, s0 and s2 get the current version in a new group of their own.
    log.clear()
    targets[0].lost, targets[2].fail = None, None
    sync.repush([0, 2])
    assert sync.where == [("ddma-8000-0", 0), ("ddma-7000-0", 1), ("ddma-8000-0", 1)]
    assert log == ["reserve(1)", "s0.open(ddma-8000-0 0/2)", "s2.open(ddma-8000-0 1/2)",
                   "join([8000], [[0, 2]])", "s0.begin(2)", "s2.begin(2)",
                   "s0.receive(2 ddma-8000-0 (-1, 0)#0)", "s2.receive(2 ddma-8000-0 (-1, 0)#1)",
                   "push(2, [0, 2])", "s0.commit(2)", "s2.commit(2)"]  # fmt: skip


def test_a_server_lost_during_a_push_is_left_out_and_the_others_get_the_version():
    """A server that stops answering (it died) at begin, or on a trainer rank while the
    bytes go, is reported lost; the version lands on every other server."""
    log: list[str] = []
    targets = [FakeTarget(log, "s0", lost="begin"), FakeTarget(log, "s1"), FakeTarget(log, "s2")]
    sync = WeightSync(FakeTrainer(log, lost=[2]), targets, weight_version=3)  # type: ignore[arg-type]
    stats = sync.push()
    assert sync.weight_version == 4 and stats.lost == [0, 2]
    assert log == ["s0.begin(4)", "s1.begin(4)", "s2.begin(4)", "push(4, [1, 2])",
                   "s1.commit(4)", "s2.abort(4)"]  # fmt: skip


def test_a_restarted_server_gets_the_current_version_again():
    log: list[str] = []
    targets = [FakeTarget(log, "s0"), FakeTarget(log, "s1")]
    sync = WeightSync(FakeTrainer(log), targets, weight_version=7)  # type: ignore[arg-type]
    stats = sync.repush([1])
    assert sync.weight_version == 7 and stats.lost == []
    assert log == ["s1.begin(7)", "push(7, [1])", "s1.commit(7)"]
    # p2p: the restarted server's group died with it; it and the trainer ranks join a new
    # one (a fresh port) before the bytes go.
    log.clear()
    grouped = [FakeTarget(log, "s0", grouped=True), FakeTarget(log, "s1", grouped=True)]
    p2p = WeightSync(FakeTrainer(log), grouped, weight_version=7)  # type: ignore[arg-type]
    p2p.where = [("ddma-7000-0", 0), ("ddma-7000-1", 0)]
    p2p.repush([1])
    assert p2p.where == [("ddma-7000-0", 0), ("ddma-8000-0", 0)]
    assert log == ["reserve(1)", "s1.open(ddma-8000-0 0/1)", "join([8000], [[1]])",
                   "s1.begin(7)", "s1.receive(7 ddma-8000-0 (-1,)#0)", "push(7, [1])",
                   "s1.commit(7)"]  # fmt: skip
