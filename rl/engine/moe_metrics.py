"""Mixture-of-Experts health per optimizer step: the load-balancing loss and expert load.

Why these two: the router's auxiliary loss is what keeps the experts used evenly, and the
load of the busiest expert (relative to an even split) shows collapse directly. Both are
read from this step's forward passes: Megatron's aux-loss tracker (per layer, summed over
the micro-batches) and a forward hook on every router counting the tokens it sends to each
expert. The reductions use the trainer's own process groups (pipeline stages hold
different layers, data-parallel ranks different rows), never Megatron's global state, and
no AVG reduction (gloo has none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from rl.models.parallel import Layout

if TYPE_CHECKING:
    from megatron.core.transformer.moe.router import TopKRouter

TRACKED = "load_balancing_loss"


class MoEMetrics:
    """Hooks on ``model``'s routers; :meth:`step` returns the step's metrics (every rank)."""

    def __init__(
        self, model: torch.nn.Module, layout: Layout, num_layers: int, num_experts: int
    ) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.layout, self.num_layers = layout, num_layers
        self.load = torch.zeros(num_layers, num_experts)
        self._handles = [
            m.register_forward_hook(self._count)
            for m in model.modules()
            if isinstance(m, TopKRouter)
        ]

    def _count(
        self,
        router: TopKRouter,
        args: tuple[object, ...],  # the router's inputs: unused
        out: tuple[torch.Tensor, torch.Tensor],  # probs, routing map
    ) -> None:
        _, routing_map = out  # [tokens, experts] booleans
        self.load[router.layer_number - 1] += routing_map.sum(0).float()

    def step(self, microbatches: int) -> dict[str, float]:
        """This step's metrics; resets the counters. ``microbatches``: on this rank."""
        from megatron.core.transformer.moe import moe_utils

        lay = self.layout
        entry = moe_utils.get_moe_layer_wise_logging_tracker().get(TRACKED)
        aux = entry["values"].detach().float().cpu() if entry else torch.zeros(self.num_layers)
        # Pipeline stages hold different layers: sum them. Under sequence parallelism (MoE
        # with TP > 1) each TP rank routes its part of the sequence: sum them. Data-parallel
        # ranks hold different rows: sum, then divide by the micro-batches of all of them.
        vec = torch.cat([aux, self.load.flatten(), torch.tensor([float(microbatches)])])
        if lay.pp > 1:
            dist.all_reduce(vec, group=lay.pp_group)
        if lay.tp > 1:
            vec[:-1] = _summed(vec[:-1], lay.tp_group)
        dist.all_reduce(vec, group=lay.dp_group)
        n = self.num_layers
        aux, load, mbs = vec[:n], vec[n:-1].view(n, -1), vec[-1]
        moe_utils.clear_aux_losses_tracker()
        self.load.zero_()
        per_layer = load / load.sum(-1, keepdim=True).clamp(min=1)
        busiest = per_layer.max(-1).values * per_layer.shape[-1]  # 1.0: perfectly even
        return {
            "moe_aux_loss": float(aux.sum() / (n * mbs.clamp(min=1))),
            "moe_max_expert_load": float(busiest.mean()),
        }


def _summed(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t
