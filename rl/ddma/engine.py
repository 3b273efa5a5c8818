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
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rl.ddma import relay, wire
from rl.ddma.plan import Bucket, Plan


class TransferError(RuntimeError):
    """A peer failed or disconnected during a transfer; names the bucket and the peer."""


@dataclass
class TransferStats:
    buckets: int = 0
    payload_bytes: int = 0  # piece bytes (what the destination keeps)
    wire_bytes: int = 0  # message bytes (headers and alignment included)
    seconds: float = 0.0
    buffer_bytes: int = 0  # extra memory this rank allocated for the transfer
    forwarded_bytes: int = 0  # relay: message bytes this rank forwarded to other replicas


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
    each to every replica the trainer feeds."""
    mine = relay.trainer_walk(plan, src_rank)
    stats = TransferStats(buckets=sum(len(to) for _, to in mine))
    if not mine:
        return stats
    t0 = time.perf_counter()
    bufs = _buffers(plan, device)
    stats.buffer_bytes = sum(b.numel() for b in bufs)
    inflight: list[list[tuple[dist.Work, Bucket, int]]] = [[], []]
    for i, (b, to) in enumerate(mine):
        slot = i % 2
        for work, prev, peer in inflight[slot]:
            wait(work, where(prev), peer, "generator rank")
        msg = wire.pack(bufs[slot], plan, b, shards, dtype, version)
        inflight[slot] = []
        for dst in to:
            peer = dst_ranks[dst]
            inflight[slot].append(
                (post(dist.isend, msg, peer, group, where(b), "generator rank"), b, peer)
            )
            stats.payload_bytes += sum(plan.piece_bytes(p) for p in b.pieces)
            stats.wire_bytes += b.nbytes
    for item in inflight:
        for work, prev, peer in item:
            wait(work, where(prev), peer, "generator rank")
    stats.seconds = time.perf_counter() - t0
    return stats


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
    of its bytes, nor any later bucket's, is written; the rest is still drained and
    forwarded so the senders and the replicas below finish, and those replicas refuse the
    same message themselves) and :class:`TransferError` if a peer disappears. The
    caller decides what the written tensors are: the live ones, or a staging copy that
    is swapped in only once every bucket has arrived.
    """
    mine = relay.replica_walk(plan, replica, dst_rank)
    stats = TransferStats(buckets=len(mine))
    t0 = time.perf_counter()
    bufs = _buffers(plan, device) if mine else []
    stats.buffer_bytes = sum(b.numel() for b in bufs)

    def peer_of(i: int) -> tuple[int, str]:
        b, sender, _ = mine[i]
        if sender == relay.TRAINER:
            return src_ranks[b.src], "trainer rank"
        return dst_ranks[sender], "relaying generator rank"

    def arrive(i: int) -> dist.Work:
        peer, role = peer_of(i)
        b = mine[i][0]
        return post(dist.irecv, bufs[i % 2][: b.nbytes], peer, group, where(b), role)

    works = [arrive(i) for i in range(min(2, len(mine)))]
    failed: wire.BucketError | None = None
    for i, (b, _, forward) in enumerate(mine):
        wait(works[i], where(b), *peer_of(i))
        msg = bufs[i % 2][: b.nbytes]
        sends = [
            (post(dist.isend, msg, dst_ranks[f], group, where(b), "generator rank"), dst_ranks[f])
            for f in forward
        ]
        stats.forwarded_bytes += b.nbytes * len(sends)
        if failed is None:  # after a bad bucket keep draining, so no sender hangs
            try:
                wire.verify(msg, plan, b, version)
            except wire.BucketError as e:
                failed = e
            else:
                wire.unpack(msg, plan, b, tensors, dtype)
                stats.payload_bytes += sum(plan.piece_bytes(p) for p in b.pieces)
                stats.wire_bytes += b.nbytes
        for work, peer in sends:  # the buffer takes bucket i+2 next
            wait(work, where(b), peer, "generator rank")
        if i + 2 < len(mine):
            works.append(arrive(i + 2))
    if failed is not None:
        raise failed
    wire.zero_fill(plan, dst_rank, tensors)
    stats.seconds = time.perf_counter() - t0
    return stats
