"""The baseline DDMA is measured against: gather to trainer rank 0, convert, send it all.

This is what DeepSpeed-Chat-like systems do (and SGLang's own
``update_weights_from_distributed`` path): every trainer rank sends its shards to rank 0,
which rebuilds each full tensor, renames it to Hugging Face names and broadcasts it to
every generator rank; each generator rank then cuts its own shard out of the full tensor,
as SGLang's loaders do. Rank 0 holds the whole model and every generator rank receives
all of it. Kept in the code base so the benchmark compares both in the same run; it
supports pipeline parallelism of 1 only.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist

from rl.ddma import wire
from rl.ddma.plan import DstLayout, SrcLayout, make_plan
from rl.weights import keymap as km


def _model_keys(d: km.Dims) -> list[tuple[str, int | None]]:
    per_layer = [(k, i) for i in range(d.layers) for k in km.layer_keys(d)]
    return per_layer + [(k, None) for k in km.global_keys(d)]


def gather_hf(
    shards: wire.SrcGetter, d: km.Dims, tp: int, group: dist.ProcessGroup, root: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every trainer rank calls this; on ``root`` (a global rank) it yields the full model
    in HF names, tensor by tensor; elsewhere it yields nothing."""
    me = dist.get_rank()
    for key, layer in _model_keys(d):
        t = shards(key, layer).contiguous()
        full: torch.Tensor | None
        if km.tp_dim(key) is None:
            full = t
        else:
            parts = [torch.empty_like(t) for _ in range(tp)] if me == root else None
            dist.gather(t, parts, dst=root, group=group)
            full = km.tp_unshard(key, parts) if parts is not None else None
        if me == root:
            assert full is not None
            yield from zip(km.hf_names(key, d, layer), km.to_hf(key, full, d), strict=True)


def broadcast_hf(
    named: Iterator[tuple[str, torch.Tensor]] | None,
    d: km.Dims,
    dtype: torch.dtype,
    group: dist.ProcessGroup,
    root: int,
) -> dict[str, torch.Tensor]:
    """Broadcast every HF tensor from ``root`` to the group; returns what was received
    (on the root: nothing is kept)."""
    out = {}
    it = iter(named) if named is not None else None
    shapes = km.hf_shapes(d)
    order = [n for key, layer in _model_keys(d) for n in km.hf_names(key, d, layer)]
    for name in order:
        shape = shapes[name]
        if it is not None:
            got, t = next(it)
            if got != name:
                raise RuntimeError(f"baseline order mismatch: {got} != {name}")
            dist.broadcast(t.contiguous(), src=root, group=group)
        else:
            t = torch.empty(shape, dtype=dtype)
            dist.broadcast(t, src=root, group=group)
            out[name] = t
    return out


def load_rank(
    hf: dict[str, torch.Tensor], d: km.Dims, dst: DstLayout, rank: int, tensors: wire.DstGetter
) -> None:
    """Cut generator ``rank``'s shards out of the full HF tensors (the loader's job)."""
    plan = make_plan(d, SrcLayout(1), dst, hf["model.norm.weight"].element_size(), 64 << 20)
    glob = {}
    for key, layer in _model_keys(d):
        t = km.to_megatron(key, [hf[n] for n in km.hf_names(key, d, layer)], d)
        glob[(key, layer)] = t
    for b in plan.receives(rank):  # one copy per piece, as SGLang's weight loaders do
        for p in b.pieces:
            assert p.key is not None  # received pieces have a source; fills are not sent
            part = glob[(p.key, p.layer)].narrow(p.dim, p.src_start, p.length)
            tensors(p.dst_name).narrow(p.dim, p.dst_start, p.length).copy_(part)
    wire.zero_fill(plan, rank, tensors)
