"""Same-host DDMA: buckets move through shared memory, the process group only signals.

Over gloo a bucket is copied four times on one host (pack, into the kernel's socket
buffer, out of it, scatter) and TCP loopback caps the middle two (1.9-3.7 GB/s for one
64 MB message here, against 9 GB/s for memcpy). Here a sender packs each bucket straight
into a slot of its *ring*, ``depth`` (default two) bucket-sized slots in a ``/dev/shm``
file that its receivers map, and a receiver verifies and scatters it from there: two
copies, at memory speed.
Only small messages cross the group: the ring's name (``hello``, once per transfer), a
bucket's slot (``notify``) and the receiver's ``ack`` that the slot is free again. A peer
that dies still fails the other side's wait, as in :mod:`rl.ddma.engine`.

Every bucket's header (plan digest, version, index, size) is checked before a byte of it
is written; its payload checksum too unless both sides pass ``checksum=False``: bytes
that stay in this host's memory cannot be damaged in transit, and hashing them twice
(sender and receiver) is a third of a transfer's CPU time.

The signatures and most of the contract of :func:`rl.ddma.engine.send` /
:func:`~rl.ddma.engine.receive` (the plan's global order, two buckets in flight per
sender, verification before any byte is written, drain after a bad bucket), so a caller
whose peers share its host swaps one for the other. Two differences: a one-replica plan
only (every server maps the trainer's rings itself, so nothing is relayed), and a lost
receiver fails :func:`send` with :class:`TransferError` rather than being left out.

Memory: a sender allocates two buckets (its ring, kept and reused across versions, so
its pages are faulted in once); a receiver allocates nothing and maps each sender's
ring (its resident size counts those pages, which are the sender's). The ring's file is
unlinked as soon as every receiver has mapped it, within the first transfer's
handshake: a crash after that leaves nothing in ``/dev/shm``. A handshake that fails (a
receiver gone, or unable to map it) unlinks it too, and the next transfer makes another.
"""

from __future__ import annotations

import mmap
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field

import torch
import torch.distributed as dist

from rl.ddma import wire
from rl.ddma.engine import TransferError, TransferStats, apply, post, wait, where
from rl.ddma.plan import Bucket, Plan

SHM_DIR = "/dev/shm"
NAME_BYTES = 128  # the hello message: the ring's path, NUL-padded
PREFIX = "ddma-"  # every ring's file name starts so


@dataclass
class Ring:
    """A sender's ``depth`` slots of ``slot_bytes`` in a shared file on ``group`` (held, so
    a later group cannot take its id; ``path`` stays the ring's name once unlinked)."""

    group: object
    path: str
    slot_bytes: int
    depth: int
    _: KW_ONLY
    data: torch.Tensor
    mapped_by: set[int] = field(default_factory=set)  # group ranks that mapped it
    linked: bool = True

    def slot(self, i: int) -> torch.Tensor:
        return self.data[i * self.slot_bytes : (i + 1) * self.slot_bytes]

    def unlink(self) -> None:
        if self.linked:
            self.linked = False
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


# This process's rings (as a sender) and mappings (as a receiver), kept across versions:
# a fresh mapping page-faults every byte again (40-150 ms per 32 MB bucket here).
_rings: dict[tuple[int, int, int], Ring] = {}
_mapped: dict[tuple[int, int, int, int], tuple[object, str, torch.Tensor]] = {}


def _map(path: str, nbytes: int) -> torch.Tensor:
    """Map an existing file (``torch.from_file`` would create a missing one)."""
    fd = os.open(path, os.O_RDWR)
    try:
        if os.fstat(fd).st_size != nbytes:
            raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, expected {nbytes}")
        buf = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return torch.frombuffer(buf, dtype=torch.uint8)


def create_ring(slot_bytes: int, depth: int, group: object = None) -> Ring:
    """A new ring: ``depth`` slots of ``slot_bytes`` in a fresh ``/dev/shm`` file."""
    if depth < 2:
        raise ValueError(f"depth={depth}: a ring needs at least 2 slots to overlap")
    path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
    if len(path.encode()) >= NAME_BYTES:
        raise ValueError(f"shared-memory path {path!r} is longer than {NAME_BYTES - 1} bytes")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            os.ftruncate(fd, depth * slot_bytes)
        finally:
            os.close(fd)
        data = _map(path, depth * slot_bytes)
    except BaseException:  # (/dev/shm full) no Ring holds the name to unlink it later
        os.unlink(path)
        raise
    return Ring(group, path, slot_bytes, depth, data=data)


def _ring(group: dist.ProcessGroup | None, slot_bytes: int, depth: int, peers: set[int]) -> Ring:
    """This sender's ring on ``group``; a new one if a peer that never mapped the current
    one needs it after its file was unlinked."""
    key = (id(group), slot_bytes, depth)
    ring = _rings.get(key)
    if ring is not None and ring.group is group and (ring.linked or peers <= ring.mapped_by):
        return ring
    if ring is not None:
        ring.unlink()
    ring = _rings[key] = create_ring(slot_bytes, depth, group)
    return ring


def _drop(ring: Ring) -> None:
    """Forget a ring whose handshake failed. Unlinked now, not by the next send: a receiver
    that died or could not map it never will, and a sender that fails next (or exits)
    would leave the file in ``/dev/shm`` for good. The next send makes a fresh one."""
    ring.unlink()
    for key, kept in list(_rings.items()):
        if kept is ring:
            del _rings[key]


def _hello(
    ring: Ring, depth: int, peers: set[int], group: dist.ProcessGroup | None, role: str
) -> None:
    """Name ``ring`` (and its depth) to every receiver in ``peers`` and wait until each has
    mapped it; TransferError if one is gone or could not."""
    name = torch.zeros(NAME_BYTES + 8, dtype=torch.uint8)
    name[: len(ring.path)] = torch.tensor(list(ring.path.encode()), dtype=torch.uint8)
    name[NAME_BYTES:].view(torch.int64)[0] = depth
    replies = {p: torch.zeros(1, dtype=torch.int64) for p in sorted(peers)}
    hello = [(p, post(dist.isend, name, p, group, "hello", role)) for p in replies]
    got = [(p, post(dist.irecv, replies[p], p, group, "hello", role)) for p in replies]
    for p, work in hello + got:
        wait(work, f"mapping {ring.path}", p, role)
    refused = [p for p, r in replies.items() if int(r) != 1]
    if refused:
        raise TransferError(f"generator rank {refused[0]} could not map {ring.path}")


def _ring_path(path: str) -> str:
    """``path`` resolved, if it names a ring file of this module's, else ValueError."""
    real = os.path.realpath(path)
    if os.path.dirname(real) != SHM_DIR or not os.path.basename(real).startswith(PREFIX):
        raise ValueError(f"{path!r} is not a DDMA ring (a {SHM_DIR}/{PREFIX}* file)")
    return real


_by_path: OrderedDict[str, torch.Tensor] = OrderedDict()  # map_ring's, most recent last
MAX_MAPPED = 64  # rings of the trainer ranks on this host (unlinked: not re-openable)


def map_ring(path: str, nbytes: int) -> torch.Tensor:
    """A ring another process named (e.g. in a request), mapped once and kept (the last
    :data:`MAX_MAPPED`). Only a ring file of this module's naming directly in
    ``/dev/shm`` is accepted: a request cannot make its receiver map any other file."""
    real = _ring_path(path)
    data = _by_path.get(real)
    if data is None or data.numel() != nbytes:
        data = _by_path[real] = _map(real, nbytes)
        while len(_by_path) > MAX_MAPPED:
            _by_path.popitem(last=False)  # unmapped once its last view is gone
    _by_path.move_to_end(real)
    return data


def send(
    plan: Plan,
    src_rank: int,
    shards: wire.SrcGetter,
    version: int,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    dst_ranks: Sequence[int],
    device: str | torch.device = "cpu",
    depth: int = 2,
    checksum: bool = True,
) -> TransferStats:
    """Pack this trainer rank's buckets into its ring, one slot each in turn, and tell
    each receiver where its bucket is; a slot is reused once its receiver acked it.
    ``depth``: the ring's slots (buckets in flight; the receivers learn it).
    ``checksum=False``: no payload checksum (the receivers must be told the same)."""
    if torch.device(device).type != "cpu":
        raise ValueError(f"shared-memory DDMA runs on CPU tensors, not device={device}")
    mine = plan.sends(src_rank)
    stats = TransferStats(buckets=len(mine))
    if not mine:
        return stats
    t0 = time.perf_counter()
    role = "generator rank"
    peers = {dst_ranks[b.dst] for b in mine}
    ring = _ring(group, plan.bucket_bytes, depth, peers)
    stats.buffer_bytes = depth * ring.slot_bytes
    try:
        _hello(ring, depth, peers, group, role)
    except BaseException:
        _drop(ring)
        raise
    ring.mapped_by |= peers
    ring.unlink()  # every receiver holds a mapping now: nothing to leak if we crash
    notes = [torch.zeros(2, dtype=torch.int64) for _ in range(depth)]
    acks = [torch.zeros(1, dtype=torch.int64) for _ in range(depth)]
    inflight: list[tuple[list[dist.Work], Bucket] | None] = [None] * depth
    for i, b in enumerate(mine):
        slot = i % depth
        if (prev := inflight[slot]) is not None:
            for work in prev[0]:
                wait(work, where(prev[1]), dst_ranks[prev[1].dst], role)
        if checksum:
            wire.pack(ring.slot(slot), plan, b, shards, dtype, version)
        else:
            wire.copy_pieces(ring.slot(slot), plan, b, shards, dtype)
            wire.write_header(ring.slot(slot), plan, b, version, payload=False)
        peer = dst_ranks[b.dst]
        notes[slot][0], notes[slot][1] = b.index, slot
        posted = [
            post(dist.isend, notes[slot], peer, group, where(b), role),
            post(dist.irecv, acks[slot], peer, group, where(b), role),
        ]
        inflight[slot] = (posted, b)
        stats.count(plan, b)
    for item in inflight:
        if item is not None:
            for work in item[0]:
                wait(work, where(item[1]), dst_ranks[item[1].dst], role)
    stats.seconds = time.perf_counter() - t0
    return stats


def _mapping(group: dist.ProcessGroup | None, peer: int, path: str, slot: int, depth: int):
    """The ring ``path`` of ``peer``, mapped once (keyed as the sender keys its rings)."""
    key = (id(group), peer, slot, depth)
    cached = _mapped.get(key)
    if cached is not None and cached[0] is group and cached[1] == path:
        return cached[2]
    data = _map(_ring_path(path), slot * depth)
    _mapped[key] = (group, path, data)
    return data


def receive(
    plan: Plan,
    dst_rank: int,
    tensors: wire.DstGetter,
    version: int,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    src_ranks: Sequence[int],
    device: str | torch.device = "cpu",
    checksum: bool = True,
) -> TransferStats:
    """Verify and scatter this generator rank's buckets straight from the senders' rings,
    then zero its padding (``checksum=False``: the headers only, as the senders were
    told). Errors as :func:`rl.ddma.engine.receive`: the first bad bucket
    raises :class:`wire.BucketError` after the rest is drained (unwritten); a sender that
    disappears raises :class:`TransferError`."""
    if torch.device(device).type != "cpu":
        raise ValueError(f"shared-memory DDMA runs on CPU tensors, not device={device}")
    mine = plan.receives(dst_rank)
    stats = TransferStats(buckets=len(mine))
    t0 = time.perf_counter()
    role = "trainer rank"
    peers = sorted({src_ranks[b.src] for b in mine})
    names = {p: torch.zeros(NAME_BYTES + 8, dtype=torch.uint8) for p in peers}
    got = [(p, post(dist.irecv, names[p], p, group, "hello", role)) for p in peers]
    rings: dict[int, torch.Tensor] = {}
    replies = []
    for p, work in got:
        wait(work, "hello", p, role)
        path = bytes(names[p][:NAME_BYTES].tolist()).rstrip(b"\0").decode()
        depth = int(names[p][NAME_BYTES:].view(torch.int64)[0])
        ok = 1
        try:
            rings[p] = _mapping(group, p, path, plan.bucket_bytes, depth)
        except (OSError, ValueError):  # the sender answers with a clear error
            ok = 0
        reply = torch.tensor([ok], dtype=torch.int64)
        replies.append((p, reply, post(dist.isend, reply, p, group, "hello", role)))
    for p, _, work in replies:
        wait(work, "hello", p, role)
    if len(rings) < len(peers):
        missing = sorted(set(peers) - set(rings))
        raise TransferError(f"could not map the ring of trainer rank {missing[0]}")
    note = torch.zeros(2, dtype=torch.int64)
    acks: list[tuple[torch.Tensor, dist.Work, Bucket]] = []
    failed: wire.BucketError | None = None
    for b in mine:
        peer = src_ranks[b.src]
        wait(post(dist.irecv, note, peer, group, where(b), role), where(b), peer, role)
        index, slot = note.tolist()
        if failed is None:  # after a bad bucket keep draining, so no sender hangs
            try:
                if index != b.index or not 0 <= slot < rings[peer].numel() // plan.bucket_bytes:
                    raise wire.BucketError(f"{where(b)}: notified bucket {index} slot {slot}")
                msg = rings[peer][slot * plan.bucket_bytes :][: b.nbytes]
                apply(msg, plan, b, version, tensors, dtype, stats, checksum)
            except wire.BucketError as e:
                failed = e
        ack = torch.tensor([index], dtype=torch.int64)
        acks.append((ack, post(dist.isend, ack, peer, group, where(b), role), b))
        while len(acks) > 2:  # keep a bounded number of small sends outstanding
            _, work, done = acks.pop(0)
            wait(work, where(done), src_ranks[done.src], role)
    for _, work, done in acks:
        wait(work, where(done), src_ranks[done.src], role)
    if failed is not None:
        raise failed
    wire.zero_fill(plan, dst_rank, tensors)
    stats.seconds = time.perf_counter() - t0
    return stats
