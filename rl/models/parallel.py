"""Megatron's model-parallel state, handed on as explicit process groups.

Megatron-Core keeps its groups in module globals; this module is the one place that
touches them, for the trainer and for the checkpoint converter alike (both build the model
of rl/models/megatron_gpt.py over them). Everything downstream receives a :class:`Layout`
(ranks and groups) and never reads Megatron's global state itself.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from megatron.core.process_groups_config import ProcessGroupCollection


@dataclass(frozen=True)
class Layout:
    """This rank's place in the trainer's TP x CP x PP x DP grid, with its process groups.
    Expert parallelism (MoE) splits the experts over ``ep`` of the ``dp`` replicas; context
    parallelism splits each sequence over ``cp`` ranks that hold the same weights and rows
    (gradients are reduced over DP x CP, Megatron's ``dp_cp`` group)."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    _: KW_ONLY
    pp_rank: int
    dp_rank: int
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pg_collection: ProcessGroupCollection
    ep: int = 1
    ep_rank: int = 0
    cp: int = 1
    cp_rank: int = 0
    cp_group: dist.ProcessGroup | None = None

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def last_stage_global_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's pipeline."""
        return dist.get_global_rank(self.pp_group, self.pp - 1)


def init_model_parallel(
    tp: int, pp: int, seed: int, group: dist.ProcessGroup | None = None, ep: int = 1, cp: int = 1
) -> Layout:
    """Initialise Megatron's TP/CP/PP/DP groups over ``group`` (the whole trainer world).

    ``group`` must be the default (WORLD) group: Megatron-Core 0.16 builds its groups from
    the default group's ranks. Executors that share a world with the trainer get a world
    of their own per role instead (see rl/controller).
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    if group not in (None, dist.group.WORLD):
        raise ValueError("init_model_parallel needs the trainer's own default (WORLD) group")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            expert_model_parallel_size=ep,
            context_parallel_size=cp,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return Layout(
        tp=tp,
        pp=pp,
        dp=ps.get_data_parallel_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        ep=ep,
        ep_rank=ps.get_expert_model_parallel_rank(),
        cp=cp,
        cp_rank=ps.get_context_parallel_rank(),
        cp_group=ps.get_context_parallel_group(),
    )


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
