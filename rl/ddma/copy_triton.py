"""Many strided copies as one Triton kernel: a bucket's pieces packed or scattered in one
launch, for CUDA buckets.

Why: on a device the host's time per piece, not the device's, set the rate of a bucket
(each ``copy_`` is a launch and a view: tens of microseconds of host time, against a few
of device time for a piece of a few MB). Here every copy of a bucket is a row of one table
(rl/ddma/fused.py builds it once and keeps it on the device): source and destination
addresses, rows, bytes per row and the two row strides. Each program copies one tile of
``ROWS`` x ``COLS`` units of one copy; a second table maps programs to copies.

A copy moves bits, in units of 1, 2, 4, 8 or 16 bytes (the largest that divides every
address, stride and row length of a copy; one launch per unit): no cast, so NaN payloads and
e4m3 bytes pass unchanged, and the result is exactly ``copy_``'s.

GPU-only in production: imported lazily (rl/ddma/kernels.py) for CUDA buffers where Triton
imports; CPU tests run it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FIELDS = 8  # per copy: src, dst (byte addresses), rows, cols, src and dst row strides,
# tiles along a row, first program (all but the addresses in units)
ROWS, COLS = 16, 256  # a program's tile, in units: 32 KiB at 8-byte units
# Bytes of a unit -> the type moved; 16: 8-byte words in aligned pairs (every address a
# multiple of 16 bytes, every stride and row an even number of words), which Triton then
# moves as 16-byte vectors. It cannot see that from addresses read out of a table.
UNITS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64, 16: tl.int64}


@triton.jit(do_not_specialize=["map_at"])
def _copy(tab_ptr, map_at, UNIT: tl.constexpr, PAIRS: tl.constexpr, R: tl.constexpr,
          C: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    row = tab_ptr + tl.load(tab_ptr + map_at + pid) * 8
    src = tl.load(row).to(tl.pointer_type(UNIT))
    dst = tl.load(row + 1).to(tl.pointer_type(UNIT))
    rows, cols = tl.load(row + 2), tl.load(row + 3)
    src_stride, dst_stride = tl.load(row + 4), tl.load(row + 5)
    tiles, first = tl.load(row + 6), tl.load(row + 7)
    if PAIRS:
        src, dst = tl.multiple_of(src, 16), tl.multiple_of(dst, 16)
        cols = tl.multiple_of(cols, 2)
        src_stride, dst_stride = tl.multiple_of(src_stride, 2), tl.multiple_of(dst_stride, 2)
    t = pid - first
    r = (t // tiles) * R + tl.arange(0, R)[:, None]
    c = (t % tiles) * C + tl.arange(0, C)[None, :]
    keep = (r < rows) & (c < cols)
    x = tl.load(src + r * src_stride + c, mask=keep)
    tl.store(dst + r * dst_stride + c, x, mask=keep)


def words(unit: int) -> int:
    """Bytes of the type a table of ``unit``-byte units counts in."""
    return min(unit, 8)


def copy(table: torch.Tensor, copies: int, programs: int, unit: int) -> None:
    """Run the copies of ``table`` (int64 on the device: ``copies`` rows of
    :data:`FIELDS`, then each of ``programs`` programs' copy), counted in words of
    :func:`words` bytes."""
    _copy[(programs,)](table, copies * FIELDS, UNIT=UNITS[unit], PAIRS=unit == 16, R=ROWS,
                       C=COLS, num_warps=4)  # fmt: skip
