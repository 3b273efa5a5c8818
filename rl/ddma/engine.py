"""Execute a DDMA plan with point-to-point transfers on a process group.

Every rank walks the plan's global bucket order (rounds in which no rank sends or
receives twice), keeping at most two buckets in flight: a sender packs bucket k+1 into
its second buffer while bucket k is on the wire, a receiver verifies and scatters bucket
k while bucket k+1 arrives. Two buffers of ``plan.bucket_bytes`` are therefore the whole
extra memory of a rank, whatever the model size. Ops are posted with
``batch_isend_irecv`` (gloo on CPU, NCCL on GPU, where the pack/unpack copies run on the
device).

Ranks are passed explicitly: ``src_ranks[i]`` / ``dst_ranks[j]`` are the group ranks of
plan source i and destination j, so trainer and generator ranks can sit anywhere in the
group. A relay plan (rl/ddma/relay.py) has ``replicas`` destinations of ``dst.tp`` ranks
each (``dst_ranks[replica * dst.tp + j]``): a trainer rank packs each bucket once and
sends it to every root replica; a relay rank posts the forward of bucket k, unchanged,
from the buffer it arrived in, scatters it meanwhile, and reuses that buffer for bucket
k+2 once the forward is done (bucket k+1 arrives in the other).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rl.ddma import relay, wire
from rl.ddma.plan import Bucket, Plan


class TransferError(RuntimeError):
    """A peer failed or disconnected during a transfer; names the bucket and the peer."""


class UpstreamLost(TransferError):
    """A relaying server above this one was lost mid-version: this server misses the
    version (it keeps the previous one) through no fault of its own."""


@dataclass(kw_only=True)
class TransferStats:
    buckets: int = 0
    payload_bytes: int = 0  # piece bytes (what the destination keeps)
    wire_bytes: int = 0  # message bytes (headers and alignment included)
    seconds: float = 0.0
    buffer_bytes: int = 0  # extra memory this rank allocated for the transfer
    forwarded_bytes: int = 0  # relay: message bytes this rank forwarded to other replicas
    # Group ranks this rank was sending to that failed mid-transfer (left out from then on,
    # so the others still get every bucket), and the first such failure.
    lost: list[int] = field(default_factory=list)
    error: str = ""

    def count(self, plan: Plan, b: Bucket, copies: int = 1) -> None:
        """``copies`` messages of bucket ``b`` sent or applied."""
        self.payload_bytes += copies * plan.payload(b)
        self.wire_bytes += copies * b.nbytes

    def add(self, other: TransferStats) -> None:
        """Fold in another transfer of the same rank (another server, another group): the
        bytes and seconds add up, the buffers are the largest, the first error stays."""
        self.buckets += other.buckets
        self.payload_bytes += other.payload_bytes
        self.wire_bytes += other.wire_bytes
        self.seconds += other.seconds
        self.buffer_bytes = max(self.buffer_bytes, other.buffer_bytes)
        self.error = self.error or other.error


class Staged:
    """Destination tensors that are a staging copy, swapped in only once the whole version
    has been verified (rl/ddma/sglang_receiver.py, staging device or host): a bucket may
    be written before its checks, so on a device :func:`receive` checks them all at the
    end with one host sync (:class:`wire.Deferred`) instead of one sync per bucket."""

    def __init__(self, get: wire.DstGetter) -> None:
        self.get = get

    def __call__(self, name: str) -> torch.Tensor:
        return self.get(name)


def _deferrable(tensors: wire.DstGetter, device: str | torch.device) -> bool:
    """Checks may wait for the end of the sync: the bytes go to a staging copy, from
    buckets on a device (in host memory checking a bucket costs no sync)."""
    return isinstance(tensors, Staged) and torch.device(device).type != "cpu"


def apply(
    msg: torch.Tensor, plan: Plan, b: Bucket, version: int, tensors: wire.DstGetter,
    dtype: torch.dtype, stats: TransferStats, checksum: bool = True,
    deferred: wire.Deferred | None = None,
) -> None:  # fmt: skip
    """Verify ``msg`` as bucket ``b`` of ``version`` and scatter it into ``tensors``;
    raises :class:`wire.BucketError` having written nothing. With ``deferred`` the checks
    are queued there and the bytes written at once."""
    if deferred is None:
        wire.verify(msg, plan, b, version, payload=checksum)
    else:
        deferred.add(msg, plan, b, version, payload=checksum)
    wire.unpack(msg, plan, b, tensors, dtype)
    stats.count(plan, b)


def where(b: Bucket) -> str:
    return f"bucket {b.index} (trainer rank {b.src} -> generator rank {b.dst})"


def lost(what: str, peer: int, role: str, e: Exception) -> TransferError:
    return TransferError(f"{what}: {role} {peer} failed or disconnected mid-transfer: {e}")


def post(
    op: Callable[..., dist.Work | None],
    tensor: torch.Tensor,
    peer: int,
    group: dist.ProcessGroup | None,
    what: str,
    role: str,
) -> dist.Work:
    """Post one point-to-point op. A peer already gone can fail here as well as in the
    wait (gloo notices a closed connection at either, depending on timing)."""
    try:
        (work,) = dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group)])
    except Exception as e:  # gloo: connection closed by peer
        raise lost(what, peer, role, e) from e
    return work


def wait(work: dist.Work, what: str, peer: int, role: str) -> None:
    try:
        work.wait()
    except Exception as e:  # gloo: connection reset / timeout; NCCL: watchdog errors
        raise lost(what, peer, role, e) from e


def _buffers(plan: Plan, device: str | torch.device) -> list[torch.Tensor]:
    return [torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=device) for _ in range(2)]


def send(
    plan: Plan,
    src_rank: int,
    shards: wire.SrcGetter,
    version: int,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    dst_ranks: Sequence[int],
    device: str | torch.device = "cpu",
) -> TransferStats:
    """Send this trainer rank's buckets (packing the next one while one is on the wire),
    each to every replica the trainer feeds. A generator rank that fails is left out from
    then on and reported in ``lost``; the others still get all of theirs."""
    mine = relay.trainer_walk(plan, src_rank)
    stats = TransferStats(buckets=sum(len(to) for _, to in mine))
    if not mine:
        return stats
    t0 = time.perf_counter()
    bufs = _buffers(plan, device)
    stats.buffer_bytes = sum(b.numel() for b in bufs)
    peers = _Peers(stats, "generator rank")
    inflight: list[list[tuple[dist.Work, Bucket, int]]] = [[], []]
    for i, (b, to) in enumerate(mine):
        slot = i % 2
        peers.settle(inflight[slot])
        live = [dst_ranks[d] for d in to if dst_ranks[d] not in peers.gone]
        if not live:
            continue
        msg = wire.pack(bufs[slot], plan, b, shards, dtype, version)
        inflight[slot] = peers.post(dist.isend, msg, live, group, b)
        stats.count(plan, b, len(inflight[slot]))
    for item in inflight:
        peers.settle(item)
    stats.seconds = time.perf_counter() - t0
    return stats


class _Peers:
    """Sends to peers any of which may fail: a failed one is recorded in ``stats`` and
    skipped from then on."""

    def __init__(self, stats: TransferStats, role: str) -> None:
        self.stats, self.role, self.gone = stats, role, set[int]()

    def _lose(self, peer: int, e: TransferError) -> None:
        self.gone.add(peer)
        self.stats.lost = sorted(self.gone)
        self.stats.error = self.stats.error or str(e)

    def post(
        self, op: Callable[..., dist.Work | None], msg: torch.Tensor, to: Sequence[int],
        group: dist.ProcessGroup | None, b: Bucket,
    ) -> list[tuple[dist.Work, Bucket, int]]:  # fmt: skip
        out = []
        for peer in to:
            if peer in self.gone:
                continue
            try:
                out.append((post(op, msg, peer, group, where(b), self.role), b, peer))
            except TransferError as e:
                self._lose(peer, e)
        return out

    def settle(self, works: list[tuple[dist.Work, Bucket, int]]) -> None:
        for work, b, peer in works:
            try:
                wait(work, where(b), peer, self.role)
            except TransferError as e:
                self._lose(peer, e)


def receive(
    plan: Plan,
    dst_rank: int,
    tensors: wire.DstGetter,
    version: int,
    dtype: torch.dtype,
    group: dist.ProcessGroup | None,
    src_ranks: Sequence[int],
    device: str | torch.device = "cpu",
    replica: int = 0,
    dst_ranks: Sequence[int] = (),
) -> TransferStats:
    """Receive, verify and scatter this generator rank's buckets, then zero its padding;
    in a relay plan, also forward each bucket to this rank of the child replicas
    (``dst_ranks`` as for :func:`send`).

    Raises :class:`wire.BucketError` for the first message that fails verification (none
    of its bytes, nor any later bucket's, is written, unless ``tensors`` is :class:`Staged`
    and the buckets on a device, whose checks all run at the end; the rest is still
    drained and forwarded so the senders and the replicas below finish, and those replicas
    refuse the same message themselves), :class:`TransferError` if a sender disappears, and
    :class:`UpstreamLost` if that sender was a relaying server or one above it was lost.
    The replicas below a lost sender get stand-ins (:func:`wire.write_lost`) for what it
    did not send, so they fail the version at once; a child that disappears is left out
    (``lost``). The caller decides what the written tensors are: the live ones, or a
    staging copy that is swapped in only once every bucket has arrived.
    """
    mine = relay.replica_walk(plan, replica, dst_rank)
    stats = TransferStats(buckets=len(mine))
    t0 = time.perf_counter()
    bufs = _buffers(plan, device) if mine else []
    stats.buffer_bytes = sum(b.numel() for b in bufs)
    children = _Peers(stats, "generator rank")
    dead: dict[int, TransferError] = {}  # senders lost, by group rank
    spare: torch.Tensor | None = None  # stand-ins are stamped here, not in a posted buffer
    deferred = wire.Deferred() if _deferrable(tensors, device) else None

    def peer_of(i: int) -> tuple[int, str]:
        b, sender, _ = mine[i]
        if sender == relay.TRAINER:
            return src_ranks[b.src], "trainer rank"
        return dst_ranks[sender], "relaying generator rank"

    def arrive(i: int) -> dist.Work | None:
        peer, role = peer_of(i)
        if peer in dead:
            return None
        b = mine[i][0]
        try:
            return post(dist.irecv, bufs[i % 2][: b.nbytes], peer, group, where(b), role)
        except TransferError as e:
            dead[peer] = e if role == "trainer rank" else UpstreamLost(str(e))
            return None

    works = [arrive(i) for i in range(min(2, len(mine)))]
    failed: wire.BucketError | None = None
    upstream: TransferError | None = None
    for i, (b, _, forward) in enumerate(mine):
        peer, role = peer_of(i)
        work = works[i]
        if work is not None:
            try:
                wait(work, where(b), peer, role)
            except TransferError as e:
                dead[peer] = e if role == "trainer rank" else UpstreamLost(str(e))
        msg = bufs[i % 2][: b.nbytes]
        if peer in dead:  # nothing came: the replicas below get a stand-in
            upstream = upstream or dead[peer]
            if spare is None:
                spare = torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=device)
            msg = wire.write_lost(spare, b)
        sends = children.post(dist.isend, msg, [dst_ranks[f] for f in forward], group, b)
        stats.forwarded_bytes += b.nbytes * len(sends)
        if failed is None and upstream is None:  # after a bad bucket keep draining
            try:
                apply(msg, plan, b, version, tensors, dtype, stats, deferred=deferred)
            except wire.LostUpstream as e:
                upstream = UpstreamLost(str(e))
            except wire.BucketError as e:
                failed = e
        children.settle(sends)  # the buffer takes bucket i+2 next
        if i + 2 < len(mine):
            works.append(arrive(i + 2))
    if upstream is not None:
        raise upstream
    if failed is not None:
        raise failed
    if deferred is not None:
        try:
            deferred.finish()
        except wire.LostUpstream as e:
            raise UpstreamLost(str(e)) from e
    wire.zero_fill(plan, dst_rank, tensors)
    stats.seconds = time.perf_counter() - t0
    return stats
