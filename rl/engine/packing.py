"""Packed micro-batches (the "thd" layout): rows concatenated into one stream, no padding.

A padded micro-batch runs ``rows x width`` positions, most of them padding when lengths
are uneven (RL responses stop anywhere from 20 to 2,000 tokens). A packed one runs each
row's own extent (rl/engine/trainer.py ``row_extents``) back to back, with the boundaries
in ``cu_seqlens``: attention is causal within each segment and never across
(rl/models/packed_attention.py), and RoPE restarts at each one (Megatron's thd RoPE).

What the model needs divisible is padded, and only that: with context parallelism each
segment to a multiple of ``2 * cp`` (every CP rank holds two chunks of it), and the whole
stream to what sequence parallelism and a fixed pipeline shape need, by one padding
segment at the end that attends only to itself. The model's per-token outputs come back
in the rows' padded ``[rows, width]`` layout (:meth:`Pack.unpack`), so every loss and its
denominator see exactly what the padded path gives them.

Context parallelism splits every segment into ``2 * cp`` chunks; CP rank ``r`` holds
chunks ``r`` and ``2 * cp - 1 - r`` (:func:`zigzag`), which gives each rank the same share
of causal attention's work, as Megatron-Core does.

Pure logic: torch only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass
from itertools import pairwise

import torch


def plan_packs(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Row indices grouped into packs of at most ``budget`` tokens each (first-fit
    decreasing on each row's own length: no row pays for a longer neighbour).

    A row longer than the budget still runs, alone: dropping or cutting it would change
    the loss. Each pack lists its indices in ascending order. Rows of length 0 count as 1.
    """
    if budget < 1:
        raise ValueError(f"trainer.max_tokens_per_microbatch={budget} must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    room: list[int] = []
    for i in order:
        n = max(int(lengths[i]), 1)
        for p, left in enumerate(room):
            if n <= left:
                packs[p].append(i)
                room[p] -= n
                break
        else:
            packs.append([i])
            room.append(budget - n)
    return [sorted(p) for p in packs]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Pack:
    """One packed micro-batch of ``rows`` rows cut to ``width`` columns.

    ``index``: for each packed position, its place in the flattened ``[rows, width]``
    micro-batch (``-1``: padding). ``cu_seqlens``: segment boundaries in the packed stream
    (int32, the padding segment last when there is one), each segment a multiple of
    ``2 * cp`` when ``cp > 1``. ``length``: the stream's length. ``ends``: where each
    row's last packed token sits in the flattened micro-batch: its next-token log-prob
    would score the next row's first token, so the trainer reports 0 there (the position
    is never scored: a row's extent ends one past its last scored token).
    """

    rows: int
    width: int
    index: torch.Tensor
    _: KW_ONLY
    cu_seqlens: torch.Tensor
    ends: torch.Tensor  # each row's last packed position, in the [rows * width] flattening
    cp: int = 1

    @property
    def length(self) -> int:
        return int(self.index.numel())

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())

    @property
    def real(self) -> torch.Tensor:
        """The packed positions that hold a row's token."""
        return (self.index >= 0).nonzero().squeeze(1)

    def pack(self, per_token: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
        """A ``[rows, width, ...]`` tensor as the packed ``[1, length, ...]`` stream,
        ``fill`` at padding positions."""
        flat = per_token.reshape(self.rows * self.width, *per_token.shape[2:])
        out = flat.new_full((self.length, *flat.shape[1:]), fill)
        real = self.real.to(flat.device)
        out[real] = flat[self.index.to(flat.device)[real]]
        return out.unsqueeze(0)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """The packed ``[1, length, ...]`` stream back as ``[rows, width, ...]``: zeros where
        a row has no packed token (past its extent). Differentiable."""
        real = self.real.to(packed.device)
        src = packed[0, real]
        out = src.new_zeros((self.rows * self.width, *src.shape[1:]))
        out = out.index_copy(0, self.index.to(packed.device)[real], src)
        return out.reshape(self.rows, self.width, *src.shape[1:])

    def positions(self) -> torch.Tensor:
        """Each packed position's place within its segment ``[1, length]``."""
        starts = self.cu_seqlens[:-1].long()
        lens = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        first = torch.repeat_interleave(starts, lens)
        return (torch.arange(self.length) - first).unsqueeze(0)

    def local(self, rank: int) -> torch.Tensor:
        """The packed positions CP rank ``rank`` holds, in its local order."""
        return zigzag(self.cu_seqlens, self.cp, rank)

    def gathered_order(self) -> torch.Tensor:
        """Where each position of the CP ranks' local streams, concatenated rank by rank,
        sits in the packed stream."""
        return torch.cat([self.local(r) for r in range(self.cp)])


def zigzag(cu_seqlens: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """The positions of a packed stream that CP rank ``rank`` of ``cp`` holds: of every
    segment (a multiple of ``2 * cp`` long), chunks ``rank`` and ``2 * cp - 1 - rank`` of
    its ``2 * cp`` equal chunks, segment after segment."""
    if cp == 1:
        return torch.arange(int(cu_seqlens[-1]))
    parts = []
    for lo, hi in pairwise(cu_seqlens.tolist()):
        chunk = (hi - lo) // (2 * cp)
        if chunk * 2 * cp != hi - lo:
            raise ValueError(f"a segment of {hi - lo} tokens does not split into 2*cp={2 * cp}")
        for c in (rank, 2 * cp - 1 - rank):
            parts.append(torch.arange(lo + c * chunk, lo + (c + 1) * chunk))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def build_pack(
    extents: Sequence[int], width: int, *, cp: int = 1, multiple: int = 1, length: int = 0
) -> Pack:
    """The pack of rows whose extents are ``extents`` (each ``<= width``), every segment
    padded to a multiple of ``2 * cp`` (when ``cp > 1``), the stream to a multiple of
    ``multiple * cp`` (and of ``2 * cp``) and to at least ``length`` (a pipeline's fixed shape)."""
    seg = 2 * cp if cp > 1 else 1
    index: list[torch.Tensor] = []
    bounds = [0]
    for row, n in enumerate(extents):
        n = max(int(n), 1)
        if n > width:
            raise ValueError(f"row {row}'s extent {n} is past the micro-batch's width {width}")
        padded = round_up(n, seg)
        index.append(torch.arange(row * width, row * width + n))
        if padded > n:
            index.append(torch.full((padded - n,), -1))
        bounds.append(bounds[-1] + padded)
    step = math.lcm(multiple * cp, seg)
    total = max(round_up(bounds[-1], step), round_up(length, step))
    if total > bounds[-1]:
        # One padding segment, itself a multiple of 2 * cp since both ends are.
        index.append(torch.full((total - bounds[-1],), -1))
        bounds.append(total)
    ends = [row * width + max(int(n), 1) - 1 for row, n in enumerate(extents)]
    return Pack(
        rows=len(extents),
        width=width,
        index=torch.cat(index),
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        ends=torch.tensor(ends, dtype=torch.long),
        cp=cp,
    )


def stream_length(extents: Sequence[int], *, cp: int = 1, multiple: int = 1) -> int:
    """The packed length :func:`build_pack` gives ``extents`` (no fixed length)."""
    seg = 2 * cp if cp > 1 else 1
    total = sum(round_up(max(int(n), 1), seg) for n in extents)
    return round_up(total, math.lcm(multiple * cp, seg))


__all__ = ["Pack", "build_pack", "plan_packs", "stream_length", "zigzag"]
