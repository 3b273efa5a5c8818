"""A bucket's copies, and its FP8 quantization, as one kernel launch each on a device.

Why: on an H200 (tools/bench/results/gpu_check.json, ``real_shapes_alone``) packing and
receiving were bound by the host, not the device: 64 MB buckets of Llama-3-8B shards took
330 us of host time each against about 45 us of copying, and an FP8 bucket's quantizer
launches (one per piece) held the kernel to 327 GB/s. So each bucket's pieces are
described once as the rows of a table kept on the device (the copies of
rl/ddma/copy_triton.py, the blocks of rl/ddma/fp8_triton.py), reused for as long as every
tensor is where it was; a later call costs a getter call per piece, to see that, and one
launch per kernel.

What a kernel cannot take (a source of another dtype, cast on the way; another device; a
non-contiguous tensor) is returned to the caller's torch path (rl/ddma/wire.py).

Pure logic: torch tensors only, no torch.distributed.
"""

from __future__ import annotations

from math import gcd, prod
from typing import NamedTuple

import torch

from rl.ddma import kernels, pieces
from rl.ddma.pieces import Place
from rl.ddma.plan import Bucket, Plan, scale_name

# False: every piece takes the torch path (the benchmark's baseline, in the same run).
ENABLED = True
_MAX_JOBS = 4096  # tables kept (a few KiB each on the device); past it, all are dropped


class _Copy(NamedTuple):
    """Rows of contiguous bytes from ``src`` to ``dst``: byte addresses and lengths."""

    src: int
    dst: int
    rows: int
    cols: int
    src_stride: int
    dst_stride: int


class _Job(NamedTuple):
    """A bucket's launches: (table, rows, programs, unit) copies, (table, rows, programs,
    (input dtype, dense)) quantizations, and the places left to the torch path."""

    copies: list[tuple[torch.Tensor, int, int, int]]
    quants: list[tuple[torch.Tensor, int, int, tuple[torch.dtype, bool]]]
    rest: list[int]


_JOBS: dict[tuple, _Job] = {}


def pack(
    buf: torch.Tensor, plan: Plan, bucket: Bucket, src: pieces.SrcGetter, dtype: torch.dtype
) -> list[Place]:
    """Queue the kernels that pack ``bucket``'s pieces from ``src`` into ``buf``; returns
    the places left to the torch path (all of them where there is no kernel)."""
    places = pieces.places(plan, bucket, dtype)
    if not ENABLED or kernels.for_tensor("copy_triton", buf) is None:
        return places
    tensors = [src(pl.piece.key, pl.piece.layer) for pl in places]  # type: ignore[arg-type]
    return _run(("pack", buf, plan, bucket, dtype), tensors, places, _pack_job)


def unpack(
    buf: torch.Tensor, plan: Plan, bucket: Bucket, dst: pieces.DstGetter, dtype: torch.dtype
) -> list[Place]:
    """Queue the kernels that scatter the message ``buf`` into ``dst``; returns the places
    left to the torch path."""
    places = pieces.places(plan, bucket, dtype)
    if not ENABLED or kernels.for_tensor("copy_triton", buf) is None:
        return places
    tensors = []
    for pl in places:
        tensors.append(dst(pl.piece.dst_name))
        if pl.scale_at >= 0:
            tensors.append(dst(scale_name(pl.piece.dst_name)))
    return _run(("unpack", buf, plan, bucket, dtype), tensors, places, _unpack_job)


def _run(what: tuple, tensors: list[torch.Tensor], places: list[Place], build) -> list[Place]:
    """The bucket's job, from the cache while the buffer and every tensor are where they
    were (same address, dtype, device, shape and strides), launched."""
    side, buf, plan, bucket, dtype = what
    key = (side, plan.digest, dtype, bucket.index, buf.data_ptr(), buf.device,
           *((t.data_ptr(), t.dtype, t.device, t.shape, t.stride()) for t in tensors))  # fmt: skip
    job = _JOBS.get(key) if plan.digest else None
    if job is None:
        job = build(buf, plan, places, tensors, dtype)
        if plan.digest:  # else not made by make_plan: nothing to know it by
            if len(_JOBS) >= _MAX_JOBS:
                _JOBS.clear()
            _JOBS[key] = job
    for table, rows, programs, unit in job.copies:
        kernels.load("copy_triton").copy(table, rows, programs, unit)  # type: ignore[union-attr]
    for table, rows, programs, (x, dense) in job.quants:
        fp8 = kernels.load("fp8_triton")
        fp8.quantize_table(table, rows, programs, x, plan.fp8_block, dense)  # type: ignore[union-attr]
    return [places[i] for i in job.rest]


def _span(t: torch.Tensor, dim: int, start: int, length: int) -> tuple[int, int, int, int]:
    """``t.narrow(dim, start, length)`` of a contiguous ``t`` as rows of contiguous bytes:
    (address, rows, bytes a row, bytes between rows)."""
    inner = prod(t.shape[dim + 1 :]) * t.element_size()
    return t.data_ptr() + start * inner, prod(t.shape[:dim]), length * inner, t.shape[dim] * inner


def _fits(t: torch.Tensor, dim: int, length: int, shape: tuple[int, ...], buf: torch.Tensor):
    """Whether ``t`` narrowed to ``length`` along ``dim`` has ``shape``, on the buffer's
    device (else the torch path copies it, or says what is wrong)."""
    want = list(t.shape)
    want[dim] = length
    return t.device == buf.device and tuple(want) == shape


def _pack_job(buf: torch.Tensor, plan: Plan, places, tensors, dtype: torch.dtype) -> _Job:
    fp8 = kernels.load("fp8_triton") if plan.fp8_block else None
    base, copies, rest = buf.data_ptr(), [], []
    quants: dict[tuple[torch.dtype, bool], list[list[int]]] = {}
    for i, (pl, t) in enumerate(zip(places, tensors, strict=True)):
        p = pl.piece
        if not _fits(t, p.dim, p.length, pl.shape, buf):
            rest.append(i)
        elif pl.scale_at < 0:  # a plain piece: bit copies of the transfer dtype only
            if t.dtype != dtype or not t.is_contiguous():
                rest.append(i)
            else:
                addr, rows, cols, stride = _span(t, p.dim, p.src_start, p.length)
                copies.append(_Copy(addr, base + pl.at * dtype.itemsize, rows, cols, stride, cols))
        elif fp8 is None or not fp8.supports(t, plan.fp8_block):
            rest.append(i)
        else:  # an FP8 piece, any strides; its e4m3 data and scales are dense in the bucket
            x = t.data_ptr() + p.src_start * t.stride(p.dim) * t.element_size()
            rows, cols = pl.shape
            srows, scols = pl.scale_shape
            row = [x, base + pl.at, base + 4 * pl.scale_at, rows, cols, *t.stride(), scols]
            key = (t.dtype, fp8.dense(x, base + pl.at, *t.stride(), cols))
            quants.setdefault(key, []).append([*row, srows * scols])
    return _Job(_copy_tables(copies, buf.device), _quant_tables(quants, buf.device), rest)


def _unpack_job(buf: torch.Tensor, plan: Plan, places, tensors, dtype: torch.dtype) -> _Job:
    base, copies, rest = buf.data_ptr(), [], []
    got = iter(tensors)
    for i, pl in enumerate(places):
        p, d = pl.piece, next(got)
        # (destination, dim, start, length, shape, dtype, bytes into the bucket)
        if pl.scale_at < 0:
            parts = [(d, p.dim, p.dst_start, p.length, pl.shape, dtype, pl.at * dtype.itemsize)]
        else:  # e4m3 data, then the block scales
            b, n = plan.fp8_block, pl.scale_shape[p.dim]
            assert b is not None  # only an FP8 plan sends scales
            parts = [(d, p.dim, p.dst_start, p.length, pl.shape, torch.float8_e4m3fn, pl.at),
                     (next(got), p.dim, p.dst_start // b, n, pl.scale_shape, torch.float32,
                      4 * pl.scale_at)]  # fmt: skip
        if not all(_fits(t, dim, n, shape, buf) and t.dtype == dt and t.is_contiguous()
                   for t, dim, _, n, shape, dt, _ in parts):  # fmt: skip
            rest.append(i)
            continue
        for t, dim, start, n, _, _, at in parts:
            addr, rows, cols, stride = _span(t, dim, start, n)
            copies.append(_Copy(base + at, addr, rows, cols, cols, stride))
    return _Job(_copy_tables(copies, buf.device), [], rest)


def _unit(c: _Copy) -> int:
    """The widest of 16, 8, 4, 2 and 1 bytes dividing every address, length and stride."""
    u = 16
    for v in (c.src, c.dst, c.cols, *((c.src_stride, c.dst_stride) if c.rows > 1 else ())):
        u = gcd(u, v)
    return u


def _copy_tables(copies: list[_Copy], device: torch.device) -> list:
    from rl.ddma.copy_triton import COLS, ROWS, words

    groups: dict[int, list[_Copy]] = {}
    for c in copies:
        if c.rows and c.cols:
            if c.rows == 1 or c.src_stride == c.cols == c.dst_stride:  # one contiguous run
                c = _Copy(c.src, c.dst, 1, c.rows * c.cols, 0, 0)
            groups.setdefault(_unit(c), []).append(c)
    out = []
    for unit, group in sorted(groups.items()):
        rows: list[list[int]] = []
        w = words(unit)
        for c in group:
            cols = c.cols // w
            if c.rows == 1 and cols > COLS:  # a run as rows of COLS words, and the rest
                whole = cols // COLS
                rows.append([c.src, c.dst, whole, COLS, COLS, COLS])
                if cols % COLS:
                    tail = whole * COLS * w
                    rows.append([c.src + tail, c.dst + tail, 1, cols % COLS, 0, 0])
            else:
                rows.append([c.src, c.dst, c.rows, cols, c.src_stride // w, c.dst_stride // w])
        for r in rows:
            r.append(-(-r[3] // COLS))  # tiles along a row
        programs = [-(-r[2] // ROWS) * r[6] for r in rows]
        out.append((*_table(rows, programs, device), unit))
    return [launch for launch in out if launch[2]]


def _quant_tables(quants: dict[tuple[torch.dtype, bool], list[list[int]]], device) -> list:
    out = []
    for group, rows in quants.items():
        programs = [r.pop() for r in rows]  # its blocks
        out.append((*_table(rows, programs, device), group))
    return [launch for launch in out if launch[2]]  # (empty pieces have no blocks)


def _table(rows: list[list[int]], programs: list[int], device: torch.device):
    """One int64 table on ``device``: each row and its first program, then each program's
    row. (table, rows, programs)."""
    values: list[int] = []
    owner: list[int] = []
    first = 0
    for i, (r, n) in enumerate(zip(rows, programs, strict=True)):
        values += [*r, first]
        owner += [i] * n
        first += n
    t = torch.tensor(values + owner, dtype=torch.int64)
    if device.type == "cuda":  # from pinned memory: no wait for the device
        t = t.pin_memory().to(device, non_blocking=True)
    return t, len(rows), first
