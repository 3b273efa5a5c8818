"""The one lifecycle every DDMA transport implements (rl/ddma/transport.py), without
servers: each registered transport is whole; a staged version goes from a trainer rank's
sending half through the receiver SGLang runs (here in-process) and commits whole; and a
transport defined in this module plugs into the sender, the receiver and the controller
without a line of theirs changing. Milliseconds."""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import pytest
import torch

from rl.controller.weight_sync import WeightSync
from rl.ddma import sender as sender_module
from rl.ddma import sglang_receiver as rx
from rl.ddma import shm, transport, wire
from rl.ddma.engine import TransferStats
from rl.ddma.plan import DstLayout, SrcLayout, make_plan
from rl.ddma.relay import NO_RELAY
from rl.ddma.sender import Sender
from rl.trainer.service import Pushed
from rl.weights import keymap as km

D = km.Dims(
    layers=2, hidden=64, ffn=256, heads=4, groups=2, head_dim=16, vocab=512,
    padded_vocab=512, tied=False, qkv_bias=False,
)  # fmt: skip
PLAN = make_plan(D, SrcLayout(1), DstLayout(1), 4, 1 << 14)
F32 = torch.float32


def _shards(version: int) -> wire.SrcGetter:
    g = torch.Generator().manual_seed(version)
    shards = {k: torch.randn(s, generator=g) for k, s in PLAN.src_shapes.items()}
    return lambda k, layer: shards[(k, layer)]


def _expected(shards: wire.SrcGetter, version: int) -> dict[str, torch.Tensor]:
    """What server rank 0 must hold after ``version``: every bucket packed and scattered."""
    out = {
        n: torch.zeros(s, dtype=wire.dst_dtype(PLAN, n, F32)) for n, s in PLAN.dst_shapes.items()
    }
    buf = torch.empty(PLAN.bucket_bytes, dtype=torch.uint8)
    for b in PLAN.receives(0):
        wire.unpack(wire.pack(buf, PLAN, b, shards, F32, version), PLAN, b, out.__getitem__, F32)
    wire.zero_fill(PLAN, 0, out.__getitem__)
    return out


def _model() -> torch.nn.Module:
    """A server's model: parameters of the plan's names and shapes, all 0.5."""
    root = torch.nn.Module()
    for name, shape in PLAN.dst_shapes.items():
        mod = root
        *path, leaf = name.split(".")
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, torch.nn.Module())
            mod = mod._modules[part]  # type: ignore[assignment]
        t = torch.full(shape, 0.5, dtype=wire.dst_dtype(PLAN, name, F32))
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


class InProcessServer:
    """A one-rank server whose weight-update API is the receiver itself, called in this
    process as SGLang calls it (no HTTP, no pickling): a :class:`transport.Target` to the
    sender, and begin / commit / abort to the controller."""

    def __init__(self, transport_name: str = "ipc") -> None:
        self.receiver, self.model = rx.Receiver(), _model()
        self.spec = rx.plan_spec(PLAN, F32)
        self.transport = transport.get(transport_name)
        self.plan = PLAN
        self.log: list[str] = []

    def post(self, entries: list[transport.Entry]) -> list[dict]:
        out = []
        for rank, (ctl, tensor) in enumerate(entries):
            try:
                out.append(self.receiver.handle(self.model, ctl, tensor, rank))
            except Exception as e:  # as rl.ddma.sglang_receiver.load reports it
                out.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return out

    def check(self, statuses: list[dict]) -> None:
        bad = [s for s in statuses if not s.get("ok")]
        if bad:
            raise RuntimeError(bad[0]["error"])

    def _op(self, op: str, version: int) -> None:
        self.log.append(f"{op}({version})")
        ctl = {"op": op, "plan": self.spec, "version": version, "staging": "device"}
        self.check(self.post([(ctl, torch.zeros(1, dtype=torch.uint8))]))

    def begin(self, version: int) -> None:
        self._op("discard", version)

    def commit(self, version: int) -> None:
        self._op("prepare", version)
        self._op("commit", version)

    def abort(self, version: int) -> None:
        self._op("discard", version)

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())


def _link(targets: Sequence[transport.Target]) -> transport.Link:
    return transport.Link(plan=PLAN, rank=0, dtype=F32, targets=targets,
                          device=torch.device("cpu"), relaying=NO_RELAY, timeout=10)  # fmt: skip


def _assert_holds(server: InProcessServer, want: dict[str, torch.Tensor]) -> None:
    got = server.params()
    assert set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("name", sorted(transport.registry()))
def test_every_registered_transport_implements_the_lifecycle(name):
    """Nothing abstract is left, on either side: a caller needs nothing but the lifecycle
    (a group transport's sending half sends only once it joined its groups)."""
    t = transport.get(name)
    assert isinstance(t, transport.Transport) and not inspect.isabstract(type(t))
    sending = t.prepare(_link([InProcessServer(name)]))
    assert isinstance(sending, transport.Sending) and not inspect.isabstract(type(sending))
    servers = [0, 1, 2]
    groups = t.groups(servers, NO_RELAY)
    assert groups in ([], [[0], [1], [2]])  # none, or one per server without relays
    assert (groups == []) == (t.routes(PLAN, [("g", 0)] * 3, servers, NO_RELAY) == [])
    assert t.overlaps == bool(groups)  # only servers that receive in requests of their own
    sending.close()


@pytest.mark.parametrize("name", ["ipc", "cuda_ipc"])
def test_a_staged_version_lands_whole_through_the_receiver(name):
    """A trainer rank's sending half stages each version into the receiver, which swaps it
    in at commit: the bytes every bucket carries, nothing else (``cuda_ipc`` on CPU
    tensors: its code path but the handle). The slots are kept across versions."""
    server = InProcessServer(name)
    sending = transport.get(name).prepare(_link([server]))
    for version in (1, 2):
        shards = _shards(version)
        server.begin(version)
        stats, lost = sending.send(shards, version)
        server.commit(version)
        assert lost == [] and stats.buckets == len(PLAN.sends(0))
        assert stats.payload_bytes == PLAN.dst_bytes()
        _assert_holds(server, _expected(shards, version))
    sending.close()


def test_a_server_that_lost_the_ring_is_sent_new_slots():
    """``ipc``: a server that restarted since it mapped the trainer rank's ring (unlinked
    once mapped) reports it gone; the sending half makes another ring and the version
    still lands."""
    server = InProcessServer("ipc")
    sending = transport.get("ipc").prepare(_link([server]))
    server.begin(1)
    sending.send(_shards(1), 1)
    server.commit(1)
    first = sending.slots[0]  # type: ignore[attr-defined]
    restarted = InProcessServer("ipc")
    shm._by_path.clear()  # a new process: nothing mapped
    sending.link = _link([restarted])  # type: ignore[attr-defined]
    restarted.begin(2)
    _, lost = sending.send(_shards(2), 2)
    restarted.commit(2)
    assert lost == [] and sending.slots[0] is not first  # type: ignore[attr-defined]
    _assert_holds(restarted, _expected(_shards(2), 2))
    sending.close()


class Loopback(transport.Transport):
    """A transport of this test's own: each bucket packed into a fresh tensor that the
    request itself carries (what cuda_ipc does with slots, without them)."""

    name = "loopback"
    summary = "buckets carried in the requests themselves (a test's)"
    one_host = True

    def prepare(self, link: transport.Link) -> transport.Sending:
        return LoopbackSending(link)

    def receive(self, inbound: transport.Inbound) -> list[int]:
        plan, msg = inbound.plan, inbound.tensor
        (b,) = [b for b in plan.receives(inbound.rank) if b.index == wire.read_header(msg)["index"]]
        wire.verify(msg, plan, b, inbound.version)
        inbound.writing()
        wire.unpack(msg, plan, b, inbound.into, inbound.dtype)
        return [b.index]


class LoopbackSending(transport.Sending):
    def __init__(self, link: transport.Link) -> None:
        self.link, self.spec = link, rx.plan_spec(link.plan, link.dtype)

    def send(
        self, shards: wire.SrcGetter, version: int, servers: Sequence[int] | None = None
    ) -> tuple[TransferStats, list[int]]:
        plan, stats = self.link.plan, TransferStats()
        head = {"op": "receive", "plan": self.spec, "version": version, "transport": "loopback"}
        for i in range(len(self.link.targets)) if servers is None else servers:
            target = self.link.targets[i]
            for b in plan.sends(self.link.rank):
                msg = torch.empty(plan.bucket_bytes, dtype=torch.uint8)
                msg = wire.pack(msg, plan, b, shards, self.link.dtype, version)[: b.nbytes]
                target.check(target.post([(head, msg)]))
                stats.count(plan, b)
        return stats, []

    def close(self) -> None:
        pass


class SenderHandle:
    """The controller's handle on one trainer rank, whose Sender runs in this process."""

    def __init__(self, sender: Sender) -> None:
        self.sender = sender

    def push(self, version: int, servers: list[int]) -> Pushed:
        s, lost = self.sender.push(version, servers)
        return Pushed(s.payload_bytes, s.wire_bytes, lost)


def test_a_transport_defined_here_plugs_in_without_touching_the_callers(monkeypatch):
    """Registered under its name (as a module of rl/ddma/transports/ would be), the
    loopback transport carries versions from the trainer rank's Sender through the
    receiver, bracketed by the controller's WeightSync, which forms no group for it and
    asks no server to receive on its own."""
    monkeypatch.setitem(transport.registry(), "loopback", Loopback())
    shards = _shards(3)
    monkeypatch.setattr(sender_module, "source_rank", lambda layout, src: 0)
    monkeypatch.setattr(sender_module, "shard_getter", lambda model, plan, rank: shards)
    servers: list[InProcessServer] = []

    def make_target(url, plan, dtype, *, timeout, transport, device):
        servers.append(InProcessServer(transport))
        return servers[-1]

    sender = Sender(torch.nn.Module(), None, plan=PLAN, dtype=F32, urls=["a", "b"],  # type: ignore[arg-type]
                    make_target=make_target, timeout=10, transport="loopback")  # fmt: skip
    sync = WeightSync(SenderHandle(sender), servers, weight_version=2)  # type: ignore[arg-type]
    sync._join("127.0.0.1", [7000, 7001], [0, 1])  # the transport forms none: nothing joins
    out = sync.push()
    assert (out.version, out.committed, out.lost) == (3, [0, 1], [])
    assert out.payload_bytes == 2 * PLAN.dst_bytes() and out.relayed_servers == 0
    for server in servers:
        assert server.log == ["discard(3)", "prepare(3)", "commit(3)"]
        _assert_holds(server, _expected(shards, 3))
