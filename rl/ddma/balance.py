"""Which trainer rank sends which part of each destination run: balanced by bytes.

Why: every data-parallel replica of a pipeline stage holds the same shards, and every TP
rank of the stage holds the replicated tensors (norms), so many trainer ranks could send
any given run. Picking one sender per tensor leaves a few ranks with the large tensors
(the vocabulary rows are 1 GB at 8B) and the rest idle; the sync then lasts as long as
the busiest sender. Here a large run is cut into chunks for several ranks holding it, along
its split dimension (whole FP8 blocks for quantized weights, so each chunk stays on block
boundaries), and small runs go to the least-loaded rank that holds them, largest first
(LPT). Both sides of the transfer compute this independently, so it is integer
arithmetic in a fixed order: the same inputs give the same assignment everywhere.

Pure logic: integers only.
"""

from __future__ import annotations

from typing import NamedTuple

# Runs are cut into chunks of about this fraction of the mean per-rank load: small enough
# for greedy assignment to end within a few percent of the mean, large enough to keep the
# pieces (one pack/unpack call each) few; tensors like norms stay whole.
SHARE_FRACTION = 64


class Run(NamedTuple):
    """A destination run that ``holders`` (trainer ranks, ascending) can each send:
    ``length`` slices, cut only at multiples of ``unit`` slices from its start, each
    ``unit`` costing ``unit_bytes`` on the wire."""

    holders: tuple[int, ...]
    length: int
    unit: int
    unit_bytes: int

    @property
    def units(self) -> int:
        return -(-self.length // self.unit)

    @property
    def nbytes(self) -> int:
        return self.units * self.unit_bytes


Chunk = tuple[int, int, int]  # (offset in slices, length in slices, sending trainer rank)


def assign(runs: list[Run], world: int) -> list[list[Chunk]]:
    """Each run's chunks, in offset order, with the trainer rank that sends each; the
    chunks of a run cover it exactly once.

    A run above ``quantum`` (1/``SHARE_FRACTION`` of the mean per-rank load) is cut into
    equal chunks of about a quantum (to a unit), at most one per holder, that go to its
    least-loaded holders (the larger chunks to the less loaded); smaller runs go whole,
    largest first, to the least-loaded holder."""
    sizes = [r.nbytes for r in runs]
    quantum = max(1, sum(sizes) // max(1, world * SHARE_FRACTION))
    load: dict[int, int] = {}
    out: list[list[Chunk]] = [[] for _ in runs]
    small: list[int] = []
    for i, r in enumerate(runs):
        if not r.holders:
            raise ValueError(f"run {i} has no trainer rank holding it")
        units = r.units
        parts = min(len(r.holders), units, -(-sizes[i] // quantum))
        if sizes[i] <= quantum or parts == 1:
            small.append(i)
            continue
        base, extra = divmod(units, parts)
        by_load = sorted(r.holders, key=lambda h: (load.get(h, 0), h))[:parts]
        share = {h: base + (k < extra) for k, h in enumerate(by_load)}
        at = 0
        for h in sorted(share):  # offsets in rank order, sizes by load
            n = min(share[h] * r.unit, r.length - at)
            out[i].append((at, n, h))
            load[h] = load.get(h, 0) + share[h] * r.unit_bytes
            at += n
    small.sort(key=lambda i: (-sizes[i], i))
    for i in small:
        who = runs[i].holders
        h = who[0] if len(who) == 1 else min(who, key=lambda x: (load.get(x, 0), x))
        load[h] = load.get(h, 0) + sizes[i]
        out[i].append((0, runs[i].length, h))
    return out
