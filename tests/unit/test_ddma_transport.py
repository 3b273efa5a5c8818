"""The DDMA transport registry (rl/ddma/transport.py): one module per transport, found by
listing the package; the config's choice judged in one place; and the staged transports'
slots carried through a request's pickling to the server's side, on CPU tensors. The
lifecycle every transport implements: tests/unit/test_ddma_lifecycle.py."""

from __future__ import annotations

import base64
import pickle
import pkgutil

import pytest
import torch

from rl.config import ConfigError
from rl.ddma import transport, transports, wire
from rl.ddma.grouped import GroupHop, GroupTransport
from rl.ddma.plan import DstLayout, SrcLayout, make_plan
from rl.ddma.staged import Slots, StagedTransport
from rl.generator.weight_payload import serialize, use_file_system_sharing
from rl.weights import keymap as km
from tests.helpers.configs import composed

D = km.Dims(
    layers=2, hidden=64, ffn=256, heads=4, groups=2, head_dim=16, vocab=512,
    padded_vocab=512, tied=False, qkv_bias=False,
)  # fmt: skip
PLAN = make_plan(D, SrcLayout(1), DstLayout(1), 4, 1 << 14)


def test_every_module_of_the_package_is_a_transport_under_its_own_name():
    modules = {m.name for m in pkgutil.iter_modules(transports.__path__)}
    assert set(transport.registry()) == modules == {"ipc", "cuda_ipc", "p2p", "p2p_shm"}
    kinds = {n: type(t).__mro__[1].__name__ for n, t in transport.registry().items()}
    assert kinds == {"ipc": "StagedTransport", "cuda_ipc": "StagedTransport",
                     "p2p": "GroupTransport", "p2p_shm": "GroupTransport"}  # fmt: skip
    # Servers that take a version in a request of their own can overlap it with generation.
    assert [n for n, t in transport.registry().items() if t.overlaps] == ["p2p", "p2p_shm"]
    # What config checks and the planner read: only p2p crosses hosts and relays.
    assert [n for n, t in transport.registry().items() if not t.one_host] == ["p2p"]
    assert [n for n, t in transport.registry().items() if t.relays] == ["p2p"]


def test_a_name_no_module_declares_fails_in_one_line():
    with pytest.raises(transport.UnknownTransport) as info:
        transport.get("nccl")
    assert str(info.value) == (
        "rollout.weight_sync.transport='nccl' is not one of cuda_ipc, ipc, p2p, p2p_shm"
    )


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("p2p", ["cuda", "cpu", "cpu"]),
        ("p2p_shm", ["cpu"] * 3),
        ("ipc", ["cpu"] * 3),
        ("cuda_ipc", ["cuda", "cpu", "cpu"]),
    ],
)
def test_where_buckets_lie_follows_the_transport_and_both_ends(name, want):
    """GPU buckets (NCCL for p2p) only when both ends are on the GPU (cuda_ipc is refused
    otherwise, and its slots lie in host memory on CPU tests); rings are host memory."""
    t = transport.get(name)
    ends = [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")]
    assert [t.bucket_device(a, b) for a, b in ends] == want


def test_a_config_whose_transport_fits_passes():
    for overrides in (
        [],
        ["rollout.weight_sync.transport=p2p", "rollout.weight_sync.relay=chain"],
        ["rollout.weight_sync.transport=p2p_shm"],
        ["rollout.weight_sync.transport=cuda_ipc", "trainer.device=cuda", "rollout.device=cuda"],
    ):
        transport.check(composed(overrides))
    with pytest.raises(ConfigError, match="across hosts: p2p"):
        transport.check(composed(["experiment=tiny_arithmetic_slurm",
                                  "rollout.weight_sync.transport=ipc"]))  # fmt: skip


def _packed(slots: Slots, i: int, version: int) -> tuple[dict, torch.Tensor]:
    b = PLAN.buckets[0]
    g = torch.Generator().manual_seed(version)
    shards = {k: torch.randn(s, generator=g) for k, s in PLAN.src_shapes.items()}
    wire.pack(slots.slot(i), PLAN, b, lambda k, layer: shards[(k, layer)], torch.float32, version)
    return slots.entry(i, b.nbytes)


@pytest.mark.parametrize("name", ["ipc", "cuda_ipc"])
def test_a_staged_bucket_reaches_the_server_side_by_reference(name):
    """What a request carries (its control fields and tensor, pickled as SGLang receives
    them) names the slot, and the server's side reads the trainer's bytes there, not a
    copy: a bucket packed into the same slot later is what it then sees. ``cuda_ipc`` runs
    here on CPU tensors (torch's file_system sharing), its code path but the handle."""
    use_file_system_sharing()
    t = _staged(name)
    slots = t.slots(PLAN.bucket_bytes, 2, "cpu")
    assert slots.nbytes == 2 * PLAN.bucket_bytes
    ctl, tensor = _packed(slots, 1, version=3)
    got_ctl, got_tensor = pickle.loads(base64.b64decode(serialize((ctl, tensor))))
    msg = t.locate(got_ctl, got_tensor, PLAN.bucket_bytes)[: PLAN.buckets[0].nbytes]
    wire.verify(msg, PLAN, PLAN.buckets[0], 3)
    _packed(slots, 1, version=4)  # refilled after the server's reply
    wire.verify(msg, PLAN, PLAN.buckets[0], 4)
    t.release(msg)
    slots.posted()
    assert slots.may_be_gone == (name == "ipc")  # a ring's file is unlinked once mapped


def _staged(name: str) -> StagedTransport:
    t = transport.get(name)
    assert isinstance(t, StagedTransport)
    return t


def test_an_ipc_ring_that_is_gone_is_reported_so_the_sender_makes_another():
    t = _staged("ipc")
    slots = t.slots(PLAN.bucket_bytes, 2, "cpu")
    ctl, _ = _packed(slots, 0, version=1)
    slots.posted()  # unlinked, and this process never mapped it by path
    ctl["ring"] = ctl["ring"] + "x"
    with pytest.raises(FileNotFoundError):
        t.locate(ctl, torch.zeros(1, dtype=torch.uint8), PLAN.bucket_bytes)


def test_a_cuda_ipc_entry_must_carry_its_bucket():
    with pytest.raises(ValueError, match="carries its bucket as the entry's tensor"):
        _staged("cuda_ipc").locate({}, torch.zeros(1), PLAN.bucket_bytes)


def test_p2p_shm_refuses_a_relay_plan():
    t = transport.get("p2p_shm")
    assert isinstance(t, GroupTransport)
    with pytest.raises(ValueError, match="relay sync runs over a relaying transport, not p2p_shm"):
        hop = GroupHop(plan=PLAN, rank=0, version=1, dtype=torch.float32, pg=None, peers=[0],
                  device="cpu", replica=1, forward_to=[1, 2])  # fmt: skip
        t.receive_over(hop, lambda n: torch.empty(0))
