"""Bucket messages: pack source slices into one buffer, verify it, scatter it into shards.

A message is ``HEADER_BYTES`` of int64 header followed by the pieces' bytes at the offsets
the plan fixed. The header carries the plan digest (both sides planned the same
transfer), the policy version, the bucket index and a checksum of the payload, so a
receiver never writes bytes it cannot vouch for. The checksum is computed where the
buffer lies (:mod:`rl.ddma.checksum`: xxh3 in host memory, a weighted sum on the device
of a CUDA buffer), and the magic says which kind, so a receiver on either device verifies
a sender on either.

The gather-copy (pack) and scatter-copy (unpack) are torch ``narrow().copy_()`` per
piece: one memcpy-speed pass over the bytes, no intermediate tensors. Casting to the
destination dtype happens inside the same copy.

Pure logic: torch tensors only, no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rl.ddma import checksum as cks
from rl.ddma import fp8
from rl.ddma.plan import ALIGN, HEADER_BYTES, Bucket, Piece, Plan, is_scale, round_up, scale_name

MAGIC = 0x44444D41  # "DDMA": payload checksum xxh3
MAGIC_WSUM = 0x44444D57  # "DDMW": payload checksum wsum
MAGICS = {cks.XXH3.name: MAGIC, cks.WSUM.name: MAGIC_WSUM}
_KIND_OF = {m: cks.KINDS[k] for k, m in MAGICS.items()}
# A relay rank whose parent died sends this in place of each bucket it can no longer
# forward, so the servers below it finish the version at once (and fail it) instead of
# waiting for bytes that will never come.
LOST = 0x4C4F5354  # "LOST"
_FIELDS = ("magic", "digest", "version", "index", "nbytes", "checksum", "src", "dst")


class BucketError(RuntimeError):
    """A message that must not be applied: wrong plan, version, bucket or checksum."""


class LostUpstream(BucketError):
    """The bucket stands for one a relaying server upstream could not forward."""


def write_lost(buf: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """Stamp ``buf`` as the stand-in of ``bucket`` (see :data:`LOST`); the message to send."""
    head = buf[:HEADER_BYTES].view(torch.int64)
    head.zero_()
    head[0], head[3], head[4] = LOST, bucket.index, bucket.nbytes
    return buf[: bucket.nbytes]


def write_header(
    buf: torch.Tensor, plan: Plan, bucket: Bucket, version: int, payload: bool = True
) -> None:
    """Stamp the header; ``payload=False`` leaves the checksum out (0), for a transport
    whose bytes never leave this host's memory (rl/ddma/shm.py, when asked)."""
    kind = cks.for_device(buf.device)
    values = (MAGICS[kind.name], plan.digest, version, bucket.index, bucket.nbytes, 0,
              bucket.src, bucket.dst)  # fmt: skip
    head = buf[:HEADER_BYTES].view(torch.int64)
    head.copy_(torch.tensor(values, dtype=torch.int64))
    if payload:  # on a device the sum stays there: no host sync to stamp it
        head[5] = kind.tensor(buf[HEADER_BYTES : bucket.nbytes])


def read_header(buf: torch.Tensor) -> dict[str, int]:
    return dict(zip(_FIELDS, buf[:HEADER_BYTES].view(torch.int64).tolist(), strict=True))


def verify(
    buf: torch.Tensor, plan: Plan, bucket: Bucket, version: int, payload: bool = True
) -> None:
    """Raise :class:`BucketError` unless ``buf`` is exactly ``bucket`` of ``plan`` at
    ``version`` with an intact payload (``payload=False``: the header only). Checks are
    ordered so the message names the most likely cause (a different plan means different
    architectures or layouts)."""
    h = read_header(buf)
    where = f"bucket {bucket.index} (trainer rank {bucket.src} -> generator rank {bucket.dst})"
    if h["magic"] == LOST:
        raise LostUpstream(f"{where}: a relaying server upstream was lost before it")
    if h["magic"] not in _KIND_OF:
        raise BucketError(f"{where}: not a DDMA message (magic {h['magic']:#x})")
    if h["digest"] != plan.digest:
        raise BucketError(
            f"{where}: sender planned a different transfer (digest {h['digest']:#x}, "
            f"receiver {plan.digest:#x}): model architecture, layouts, dtype or bucket size "
            "differ between trainer and generator"
        )
    if h["version"] != version:
        raise BucketError(f"{where}: carries version {h['version']}, expected {version}")
    if (h["index"], h["nbytes"]) != (bucket.index, bucket.nbytes):
        raise BucketError(f"{where}: got bucket {h['index']} of {h['nbytes']} bytes")
    if not payload:
        return
    kind = _KIND_OF[h["magic"]]
    got = kind(buf[HEADER_BYTES : bucket.nbytes])
    if got != h["checksum"]:
        raise BucketError(
            f"{where}: {kind.name} checksum mismatch ({got:#x} != {h['checksum']:#x})"
        )


def _views(buf: torch.Tensor, offset: int, p: Piece, plan: Plan, dtype: torch.dtype):
    """The piece's data (and, for FP8 pieces, its block scales) inside a message."""
    data, scale = plan.piece_layout(p)
    shape = list(plan.dst_shapes[p.dst_name])
    shape[p.dim] = p.length
    if not scale:
        return buf[offset : offset + data].view(dtype).view(shape), None
    b = plan.fp8_block
    q = buf[offset : offset + data].view(torch.float8_e4m3fn).view(shape)
    at = offset + round_up(data, ALIGN)
    sshape = [-(-n // b) for n in shape]  # type: ignore[operator]
    return q, buf[at : at + scale].view(torch.float32).view(sshape)


def dst_dtype(plan: Plan, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype the destination holds ``name`` in (FP8 weights and their scales aside,
    the transfer dtype)."""
    if is_scale(name):
        return torch.float32
    return torch.float8_e4m3fn if plan.quantized(name) else dtype


SrcGetter = Callable[[str, int | None], torch.Tensor]  # (Megatron key, layer) -> local shard
DstGetter = Callable[[str], torch.Tensor]  # SGLang name -> this rank's destination tensor


def pack(
    buf: torch.Tensor,
    plan: Plan,
    bucket: Bucket,
    src: SrcGetter,
    dtype: torch.dtype,
    version: int,
) -> torch.Tensor:
    """Gather-copy ``bucket``'s source slices into ``buf`` and stamp the header."""
    copy_pieces(buf, plan, bucket, src, dtype)
    write_header(buf, plan, bucket, version)
    return buf[: bucket.nbytes]


def copy_pieces(
    buf: torch.Tensor, plan: Plan, bucket: Bucket, src: SrcGetter, dtype: torch.dtype
) -> None:
    """The payload half of :func:`pack` (no header)."""
    for p, off in zip(bucket.pieces, bucket.offsets, strict=True):
        part = src(p.key, p.layer).narrow(p.dim, p.src_start, p.length)  # type: ignore[arg-type]
        data, scale = _views(buf, off, p, plan, dtype)
        if scale is None:
            data.copy_(part)
        else:  # block-aligned (checked by the planner): these are the destination's blocks
            q, s = fp8.quantize_blockwise(part, plan.fp8_block)  # type: ignore[arg-type]
            data.copy_(q)
            scale.copy_(s)


def unpack(
    buf: torch.Tensor, plan: Plan, bucket: Bucket, dst: DstGetter, dtype: torch.dtype
) -> None:
    """Scatter-copy a verified message (of ``dtype`` elements) into the destination."""
    for p, off in zip(bucket.pieces, bucket.offsets, strict=True):
        data, scale = _views(buf, off, p, plan, dtype)
        dst(p.dst_name).narrow(p.dim, p.dst_start, p.length).copy_(data)
        if scale is not None:
            b = plan.fp8_block
            assert b is not None  # only an FP8 plan sends scales
            rows = dst(scale_name(p.dst_name)).narrow(p.dim, p.dst_start // b, scale.shape[p.dim])
            rows.copy_(scale)


def zero_fill(plan: Plan, rank: int, dst: DstGetter) -> None:
    """Write the destination's padding rows (the vocab tail), which are never sent."""
    for p in plan.fills:
        if p.dst == rank:
            dst(p.dst_name).narrow(p.dim, p.dst_start, p.length).zero_()
