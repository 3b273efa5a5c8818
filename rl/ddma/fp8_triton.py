"""Blockwise FP8 quantization (rl/ddma/fp8.py) as one Triton kernel, for CUDA buckets.

Why: :func:`rl.ddma.fp8.quantize_blockwise` is a dozen torch ops, each a pass over a float32
copy of the piece, plus two copies into the bucket; packing an FP8 bucket ran at a quarter
of the link. Here one program quantizes one block: it reads the block from memory once
(any strides: a TP shard's column slice too; a second pass over it hits the cache), takes
its amax, and writes the e4m3 bytes and the float32 ``scale_inv`` straight into their
places in the bucket. No host synchronisation; one launch for a whole bucket's pieces
(:func:`quantize_table`, from the table rl/ddma/fused.py keeps on the device), or one
for a single piece (:func:`quantize_into`).

Bit-identical to the torch path (tests/unit/test_ddma_triton.py runs this kernel under
Triton's interpreter against it, tests/gpu on CUDA), hence the care taken:

* the amax is a maximum of the float32 bit patterns with the sign cleared (for such bit
  patterns integer order is float order; no float compare whose NaN rule could differ);
* both divisions are ``div_rn``: on CUDA Triton's ``/`` is an approximate division, while
  torch's division by a tensor is IEEE, correctly rounded;
* the clamp to +-448 and the cast to e4m3 are c10's ``fp8e4m3fn_from_fp32_value`` in integer
  arithmetic (round to nearest even; below 2**-6 through the same float addition), so no
  hardware conversion is needed: any GPU Triton runs on, and the interpreter, give the same
  bytes. The kernel writes them through a uint8 view of the e4m3 data.

GPU-only in production: imported lazily by rl/ddma/pieces.py for CUDA buckets where Triton
imports; CPU tests run it under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import struct

import torch
import triton
import triton.language as tl

from rl.ddma.fp8 import AMAX_FLOOR, FP8_MAX, scale_shape

# Bit patterns of float32 values the kernel compares as integers.
_FLOOR_BITS = struct.unpack("<i", struct.pack("<f", AMAX_FLOOR))[0]
_MAX_BITS = struct.unpack("<i", struct.pack("<f", FP8_MAX))[0]
INPUTS = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# Block sizes a program takes (tl.arange needs a power of two), and the rows of a block it
# holds in registers at a time.
MAX_BLOCK = 128
ROWS = 32


@triton.jit
def _e4m3_bits(y, MAX_BITS: tl.constexpr):
    """c10's float32 -> float8_e4m3fn after torch's clamp to +-448, as int32 bit fiddling."""
    b = y.to(tl.int32, bitcast=True)
    negative = b < 0
    a = b & 0x7FFFFFFF
    nan = a > 0x7F800000
    a = tl.where(a > MAX_BITS, MAX_BITS, a)  # clamp; NaN is handled below
    # Below 2**-6 (subnormal e4m3): adding 2**14 rounds to the 2**-9 grid, to nearest even.
    tiny = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    # Normal: re-bias the exponent (127 -> 7) and round the mantissa to 3 bits, ties to even.
    odd = (a >> 20) & 1
    normal = (a - (120 << 23) + 0x7FFFF + odd) >> 20
    r = tl.where(a < (121 << 23), tiny, normal)
    r = tl.where(nan, 0x7F, r)
    return tl.where(negative, r | 0x80, r)


@triton.jit
def _block(x_ptr, q_ptr, s_ptr, pid, rows, cols, stride_r, stride_c, col_blocks,
           BLOCK: tl.constexpr, ROWS: tl.constexpr, FLOOR_BITS: tl.constexpr,
           MAX_BITS: tl.constexpr, DENSE: tl.constexpr):  # fmt: skip
    """Block ``pid`` (row-major over the blocks) of one piece; ``DENSE``: ``stride_c`` is 1
    (see :func:`dense`)."""
    br, bc = pid // col_blocks, pid % col_blocks
    c = bc * BLOCK + tl.arange(0, BLOCK)[None, :]
    along = c.to(tl.int64) if DENSE else c.to(tl.int64) * stride_c
    # Two passes over the block, ROWS rows at a time: its amax, then its values (the second
    # read hits the cache). Holding a whole 128x128 block in registers would leave room
    # for one program per SM, too few to keep the memory busy.
    amax = tl.zeros([ROWS, BLOCK], dtype=tl.int32)
    for r0 in range(0, BLOCK, ROWS):
        r = br * BLOCK + r0 + tl.arange(0, ROWS)[:, None]
        keep = (r < rows) & (c < cols)  # a partial edge block: padding zeros raise no amax
        at = r.to(tl.int64) * stride_r + along
        x = tl.load(x_ptr + at, mask=keep, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)
    top = tl.max(tl.max(amax, axis=1), axis=0)
    scale = tl.math.div_rn(tl.maximum(top, FLOOR_BITS).to(tl.float32, bitcast=True), 448.0)
    for r0 in range(0, BLOCK, ROWS):
        r = br * BLOCK + r0 + tl.arange(0, ROWS)[:, None]
        keep = (r < rows) & (c < cols)
        at = r.to(tl.int64) * stride_r + along
        x = tl.load(x_ptr + at, mask=keep, other=0.0).to(tl.float32)
        q = _e4m3_bits(tl.math.div_rn(x, scale), MAX_BITS)
        tl.store(q_ptr + r.to(tl.int64) * cols + c, q.to(tl.uint8), mask=keep)
    tl.store(s_ptr + pid, scale)


@triton.jit(do_not_specialize=["map_at"])
def _quantize_table(tab_ptr, map_at, X: tl.constexpr, DENSE: tl.constexpr,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr, FLOOR_BITS: tl.constexpr,
                    MAX_BITS: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    row = tab_ptr + tl.load(tab_ptr + map_at + pid) * 9
    x = tl.load(row).to(tl.pointer_type(X))
    q = tl.load(row + 1).to(tl.pointer_type(tl.uint8))
    s = tl.load(row + 2).to(tl.pointer_type(tl.float32))
    cols, stride_r = tl.load(row + 4), tl.load(row + 5)
    if DENSE:  # the hints take where the values are made, not on a callee's arguments
        x, q = tl.multiple_of(x, 16), tl.multiple_of(q, 16)
        cols, stride_r = tl.multiple_of(cols, 16), tl.multiple_of(stride_r, 16)
    _block(x, q, s, pid - tl.load(row + 8), tl.load(row + 3), cols, stride_r, tl.load(row + 6),
           tl.load(row + 7), BLOCK, ROWS, FLOOR_BITS, MAX_BITS, DENSE)  # fmt: skip


def supports(w: torch.Tensor, block: int) -> bool:
    """Whether :func:`quantize_into` takes this piece (else the torch path does)."""
    return (
        w.dim() == 2 and w.dtype in INPUTS and 0 < block <= MAX_BLOCK and block & (block - 1) == 0
    )


def quantize_into(w: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: int) -> None:
    """Write :func:`rl.ddma.fp8.quantize_blockwise` of the 2-D ``w`` (bf16/fp16/fp32, any
    strides) into ``q`` (contiguous e4m3 of ``w``'s shape) and ``scale`` (contiguous
    float32 of :func:`rl.ddma.fp8.scale_shape`): views into a bucket, on ``w``'s device."""
    if not supports(w, block):
        raise ValueError(f"cannot quantize {w.dtype} {tuple(w.shape)} in blocks of {block}")
    rows, cols = w.shape
    srows, scols = scale_shape((rows, cols), block)
    if q.dtype != torch.float8_e4m3fn or q.shape != w.shape or not q.is_contiguous():
        raise ValueError(f"q must be contiguous e4m3 of shape {tuple(w.shape)}")
    if scale.dtype != torch.float32 or scale.shape != (srows, scols) or not scale.is_contiguous():
        raise ValueError(f"scale must be contiguous float32 of shape {(srows, scols)}")
    blocks = srows * scols
    if not blocks:
        return
    # A table of one piece: the kernel a bucket's pieces take (rl/ddma/fused.py).
    x, at = w.data_ptr(), q.data_ptr()
    row = [x, at, scale.data_ptr(), rows, cols, *w.stride(), scols, 0]
    table = torch.tensor(row + [0] * blocks, dtype=torch.int64).to(w.device)
    quantize_table(table, 1, blocks, w.dtype, block, dense(x, at, w.stride(0), w.stride(1), cols))


def _meta(block: int) -> dict:
    sub = min(block, ROWS)
    warps = max(1, min(8, sub * block // 512))  # 16 values a thread: about 64 registers
    return {"BLOCK": block, "ROWS": sub, "FLOOR_BITS": _FLOOR_BITS, "MAX_BITS": _MAX_BITS,
            "num_warps": warps}  # fmt: skip


# A table row (rl/ddma/fused.py): the piece's address, its e4m3 data's and its scales'
# (bytes), rows, columns, the two strides (elements), blocks along a row, first program.
FIELDS = 9


def dense(x: int, q: int, stride_r: int, stride_c: int, cols: int) -> bool:
    """Whether a piece at address ``x`` (its e4m3 data at ``q``) of these strides and
    columns (in elements) is ``DENSE``: rows of contiguous values, every address, row
    stride and row 16-byte aligned, which Triton then reads and writes as 16-byte vectors
    (it cannot see that in values read from a table)."""
    return stride_c == 1 and not (x % 16 or q % 16 or stride_r % 16 or cols % 16)


def quantize_table(
    table: torch.Tensor, pieces: int, programs: int, dtype: torch.dtype, block: int,
    dense: bool = False,
) -> None:  # fmt: skip
    """:func:`quantize_into` of every piece in ``table`` (int64 on the device: ``pieces``
    rows of :data:`FIELDS`, then each of ``programs`` programs' piece; one program a
    block), all of input ``dtype`` and all :func:`dense` if ``dense``, in one launch."""
    _quantize_table[(programs,)](table, pieces * FIELDS, X=INPUTS[dtype], DENSE=dense,
                                 **_meta(block))  # fmt: skip
