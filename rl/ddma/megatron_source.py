"""The trainer side of DDMA: this rank's Megatron shards, addressed as the plan names them.

Why Megatron's ``sharded_state_dict``: it is the one place that states, for every local
tensor, its checkpoint key and global layer (with PP stage offsets applied), whatever the
layer spec. Its tensors are the live parameters (views, not copies), so the map is built
once and reflects every optimizer step without copying anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from rl.ddma import wire
from rl.ddma.plan import Plan, SrcLayout
from rl.models import lora
from rl.weights.megatron_io import leaves, split_key

if TYPE_CHECKING:  # Megatron is imported at run time only after its patches
    from megatron.core.transformer.module import MegatronModule


class ParallelRank(Protocol):
    """This rank's place in the trainer's grid (rl.models.parallel.Layout is one). Read
    only, so a frozen dataclass satisfies it."""

    @property
    def tp(self) -> int: ...

    @property
    def pp(self) -> int: ...

    @property
    def dp(self) -> int: ...

    @property
    def ep(self) -> int: ...

    @property
    def tp_rank(self) -> int: ...

    @property
    def pp_rank(self) -> int: ...

    @property
    def dp_rank(self) -> int: ...

    @property
    def ep_rank(self) -> int: ...

    @property
    def cp(self) -> int: ...

    @property
    def cp_rank(self) -> int: ...


def shard_map(model: MegatronModule) -> dict[tuple[str, int | None], torch.Tensor]:
    """(keymap key, global layer or None) -> this rank's live shard.

    A factory (fc1 under SwiGLU: Megatron checkpoints gate and up as two tensors) gives
    its layer through what it builds, but the shard is its own ``data``: the whole local
    ``[gate_r ; up_r]`` parameter, which is what the plan addresses."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for entry in model.sharded_state_dict().values():
        data = entry.data if isinstance(entry, ShardedTensorFactory) else None
        for st in leaves(entry):
            if isinstance(st, ShardedTensor):
                key = split_key(st.key, st.prepend_axis_num, st.global_offset)
                out[key] = st.data if data is None else data
    return out


def source_rank(layout: ParallelRank, src: SrcLayout) -> int:
    """This trainer rank's index in the plan; checks that the plan describes this trainer
    and places this rank where Megatron did (its experts included). Context-parallel ranks
    hold the same weights as data-parallel ones: the plan counts DP x CP replicas, CP
    inside DP as in Megatron's rank order."""
    replicas, replica = layout.dp * layout.cp, layout.cp_rank + layout.cp * layout.dp_rank
    got = (layout.tp, layout.pp, replicas, layout.ep)
    if got != (src.tp, src.pp, src.dp, src.ep):
        want = f"{src.tp},{src.pp},{src.dp},{src.ep}"
        raise ValueError(f"plan is for trainer tp,pp,dp*cp,ep={want}; this is {got}")
    rank = src.rank(layout.tp_rank, layout.pp_rank, replica)
    here = (layout.tp_rank, layout.pp_rank, replica, layout.ep_rank)
    if src.coords(rank) != here:
        raise ValueError(f"trainer rank {rank} is at tp,pp,dp,ep={here}; the plan puts it at "
                         f"{tuple(src.coords(rank))}")  # fmt: skip
    return rank


def shard_getter(model: MegatronModule, plan: Plan, rank: int) -> wire.SrcGetter:
    """A source getter for ``plan`` on ``rank`` that fails early on a missing or
    mis-shaped shard (a trainer whose model is not the one planned)."""
    shards = shard_map(model)
    for b in plan.sends(rank):
        for p in b.pieces:
            assert p.key is not None  # a sent piece names its source (only fills do not)
            t = shards.get((p.key, p.layer))
            want = plan.src_shapes[(p.key, p.layer)]
            if t is None or tuple(t.shape) != want:
                have = None if t is None else list(t.shape)
                raise ValueError(
                    f"trainer rank {rank}: {p.key} layer {p.layer} is {have}, "
                    f"plan expects {list(want)}"
                )
    adapters = lora.adapters_by_weight(model)
    if not adapters:
        return lambda key, layer: shards[(key, layer)]
    last: dict[tuple[str, int | None], torch.Tensor] = {}

    def merged(key: str, layer: int | None) -> torch.Tensor:
        """LoRA: the shard with its adapter merged, made on the shard's device when a piece
        of it is packed; kept until another shard is asked for (a shard split over
        buckets is merged once), so at most one merged shard exists at a time."""
        t = shards[(key, layer)]
        adapter = adapters.get(id(t))
        if adapter is None:
            return t
        if (key, layer) not in last:
            last.clear()
            last[(key, layer)] = adapter.merged(t)
        return last[(key, layer)]

    return merged
