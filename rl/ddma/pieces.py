"""Where a bucket's pieces lie in its message, and the copies into and out of it.

Why a module of its own: on a device the host's time per piece, not the device's, sets the
rate of a bucket of many small pieces (a MoE layer is hundreds of expert slices, each
copied by the device in about a microsecond). So the places of a bucket's pieces are
worked out once per plan (:func:`places`), a view of the message is one ``as_strided``
(:class:`Typed`), and small copies reach the device in batches (:func:`copy`).

Pure logic: torch tensors only, no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from rl.ddma.plan import ALIGN, Bucket, Piece, Plan, round_up

# On a device, pieces below this are copied in batches: a launch per piece costs the host
# more time than such a copy takes an H100 (8 MiB: about 5 us). Larger ones keep copy_'s
# own kernel, which covers a tensor in one launch.
BATCH_BYTES = 8 << 20

SrcGetter = Callable[[str, int | None], torch.Tensor]  # (Megatron key, layer) -> local shard
DstGetter = Callable[[str], torch.Tensor]  # SGLang name -> this rank's destination tensor


class Place(NamedTuple):
    """Where a piece lies in a message: its data (and an FP8 piece's block scales) as
    contiguous arrays, at offsets in elements of the dtype each is stored in."""

    piece: Piece
    at: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    scale_at: int  # in float32 elements; -1: no scales
    scale_shape: tuple[int, ...] = ()
    scale_stride: tuple[int, ...] = ()


def _strides(shape: list[int]) -> tuple[int, ...]:
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return tuple(stride)


def _place(plan: Plan, p: Piece, offset: int, dtype: torch.dtype) -> Place:
    data, scale = plan.piece_layout(p)
    shape = list(plan.dst_shapes[p.dst_name])
    shape[p.dim] = p.length
    if not scale:
        return Place(p, offset // dtype.itemsize, tuple(shape), _strides(shape), -1)
    b = plan.fp8_block
    sshape = [-(-n // b) for n in shape]  # type: ignore[operator]
    at = (offset + round_up(data, ALIGN)) // 4  # e4m3 data, then float32 scales
    return Place(p, offset, tuple(shape), _strides(shape), at, tuple(sshape), _strides(sshape))


# Plan digest and transfer dtype -> bucket index -> its places. Equal digests mean equal
# buckets (the digest is what both sides of a transfer agree on).
_PLACES: dict[tuple[int, torch.dtype], dict[int, list[Place]]] = {}


def places(plan: Plan, bucket: Bucket, dtype: torch.dtype) -> list[Place]:
    """The places of ``bucket``'s pieces, in order (worked out on first use)."""
    per_plan = _PLACES.get((plan.digest, dtype))
    if per_plan is None:
        if len(_PLACES) >= 8:  # the plans of earlier runs or tests
            _PLACES.clear()
        per_plan = {}
        if plan.digest:  # else not made by make_plan: nothing to know it by
            _PLACES[(plan.digest, dtype)] = per_plan
    out = per_plan.get(bucket.index)
    if out is None:
        pairs = zip(bucket.pieces, bucket.offsets, strict=True)
        out = per_plan[bucket.index] = [_place(plan, p, off, dtype) for p, off in pairs]
    return out


class Typed:
    """Views of one message's bytes, each dtype's whole-buffer view made once."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self._as: dict[torch.dtype, torch.Tensor] = {}

    def view(
        self, dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...], at: int
    ) -> torch.Tensor:
        t = self._as.get(dtype)
        if t is None:  # a trailing partial element left out
            k = dtype.itemsize
            t = self._as[dtype] = self.buf[: self.buf.numel() // k * k].view(dtype)
        return t.as_strided(shape, stride, t.storage_offset() + at)

    def views(self, pl: Place, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A piece's data (of ``dtype``, the transfer dtype) and, for an FP8 piece, its e4m3
        data and its block scales."""
        if pl.scale_at < 0:
            return self.view(dtype, pl.shape, pl.stride, pl.at), None
        q = self.view(torch.float8_e4m3fn, pl.shape, pl.stride, pl.at)
        return q, self.view(torch.float32, pl.scale_shape, pl.scale_stride, pl.scale_at)


def copy(pairs: list[tuple[torch.Tensor, torch.Tensor]], device: bool) -> None:
    """``dst.copy_(src)`` for each ``(dst, src)``; on a device the small ones through
    ``torch._foreach_copy_``, grouped so that most groups take its fast path (one kernel for
    many tensors: one dtype on each side, both sides dense with equal strides)."""
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in pairs:
        if not device or d.device != s.device or d.numel() * d.element_size() >= BATCH_BYTES:
            d.copy_(s)  # (to or from host memory: a staging copy there)
            continue
        dense = d.is_contiguous() and s.is_contiguous()
        ds, ss = groups.setdefault((d.dtype, s.dtype, d.device, dense), ([], []))
        ds.append(d)
        ss.append(s)
    for ds, ss in groups.values():
        torch._foreach_copy_(ds, ss)
