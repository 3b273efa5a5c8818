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
group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rl.ddma import wire
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


def _lost(b: Bucket, peer: int, role: str, e: Exception) -> TransferError:
    return TransferError(
        f"bucket {b.index} (trainer rank {b.src} -> generator rank {b.dst}): {role} "
        f"{peer} failed or disconnected mid-transfer: {e}"
    )


def _post(
    op: Callable[..., dist.Work | None],
    tensor: torch.Tensor,
    peer: int,
    group: dist.ProcessGroup | None,
    b: Bucket,
    role: str,
) -> dist.Work:
    """Post one point-to-point op. A peer already gone can fail here as well as in the
    wait (gloo notices a closed connection at either, depending on timing)."""
    try:
        (work,) = dist.batch_isend_irecv([dist.P2POp(op, tensor, peer, group)])
    except Exception as e:  # gloo: connection closed by peer
        raise _lost(b, peer, role, e) from e
    return work


def _wait(work: dist.Work, b: Bucket, peer: int, role: str) -> None:
    try:
        work.wait()
    except Exception as e:  # gloo: connection reset / timeout; NCCL: watchdog errors
        raise _lost(b, peer, role, e) from e


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
    """Send this trainer rank's buckets (packing the next one while one is on the wire)."""
    mine = plan.sends(src_rank)
    stats = TransferStats(buckets=len(mine))
    if not mine:
        return stats
    t0 = time.perf_counter()
    bufs = _buffers(plan, device)
    stats.buffer_bytes = sum(b.numel() for b in bufs)
    inflight: list[tuple[dist.Work, Bucket] | None] = [None, None]
    for i, b in enumerate(mine):
        slot = i % 2
        if inflight[slot] is not None:
            work, prev = inflight[slot]  # type: ignore[misc]
            _wait(work, prev, dst_ranks[prev.dst], "generator rank")
        msg = wire.pack(bufs[slot], plan, b, shards, dtype, version)
        peer = dst_ranks[b.dst]
        inflight[slot] = (_post(dist.isend, msg, peer, group, b, "generator rank"), b)
        stats.payload_bytes += sum(plan.piece_bytes(p) for p in b.pieces)
        stats.wire_bytes += b.nbytes
    for item in inflight:
        if item is not None:
            _wait(item[0], item[1], dst_ranks[item[1].dst], "generator rank")
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
) -> TransferStats:
    """Receive, verify and scatter this generator rank's buckets, then zero its padding.

    Raises :class:`wire.BucketError` for the first message that fails verification (none
    of its bytes, nor any later bucket's, is written; the rest is still drained so the
    senders finish) and :class:`TransferError` if a sender disappears. The
    caller decides what the written tensors are: the live ones, or a staging copy that
    is swapped in only once every bucket has arrived.
    """
    mine = plan.receives(dst_rank)
    stats = TransferStats(buckets=len(mine))
    t0 = time.perf_counter()
    bufs = _buffers(plan, device) if mine else []
    stats.buffer_bytes = sum(b.numel() for b in bufs)

    def post(i: int) -> dist.Work:
        b = mine[i]
        return _post(dist.irecv, bufs[i % 2][: b.nbytes], src_ranks[b.src], group, b,
                     "trainer rank")  # fmt: skip

    works = [post(i) for i in range(min(2, len(mine)))]
    failed: wire.BucketError | None = None
    for i, b in enumerate(mine):
        _wait(works[i], b, src_ranks[b.src], "trainer rank")
        msg = bufs[i % 2][: b.nbytes]
        if failed is None:  # after a bad bucket keep draining, so no sender hangs
            try:
                wire.verify(msg, plan, b, version)
            except wire.BucketError as e:
                failed = e
            else:
                wire.unpack(msg, plan, b, tensors, dtype)
                stats.payload_bytes += sum(plan.piece_bytes(p) for p in b.pieces)
                stats.wire_bytes += b.nbytes
        if i + 2 < len(mine):
            works.append(post(i + 2))
    if failed is not None:
        raise failed
    wire.zero_fill(plan, dst_rank, tensors)
    stats.seconds = time.perf_counter() - t0
    return stats
