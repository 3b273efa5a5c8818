"""Rollout routing replay (R3): every MoE router of the trainer routes each token to the
experts the generator routed it to.

Why: a token whose experts differ between the server that sampled it and the trainer that
scores it gets a log-prob from another function; in MoE RL that train/rollout mismatch is
what collapses runs. The batch carries the server's choice (``TrainBatch.routing``,
``[B, S, layers, topk]``, -1 where unknown: padding, the last position), and before each
micro-batch's forward every router of this rank gets the rows of the tokens it holds:

- its own layer only (a pipeline stage holds its own layers; ``layer_number`` is global);
- under sequence parallelism, this TP rank's slice of the sequence;
- in Megatron's token order, sequence-major (``[s, b]`` flattened);
- expert parallelism needs nothing more: the dispatcher sends what the routing map says.

The gating weights still come from the trainer's own scores, gathered at the replayed
experts (as R3 does), so the gradient flows through the router. Each router also computes
its own top-k, which gives ``routing_agreement``: the fraction of known (token, layer)
pairs whose own expert set equals the replayed one, on the same pass.

Installed as each router's ``router_replay`` (the hook Megatron-Core's
``topk_routing_with_score_function`` calls), never through Megatron's global list of
replay instances.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from rl.models.parallel import Layout

TopK = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class LayerReplay:
    """One router's replay: the target rows of the current micro-batch, and what it chose."""

    def __init__(self) -> None:
        self.target: torch.Tensor | None = None  # [tokens, topk], -1 rows: own choice
        self.chosen: torch.Tensor | None = None  # the last forward's experts, [tokens, topk]
        self.agree = torch.zeros(2, dtype=torch.float64)  # agreeing, known (token, layer)s

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: TopK | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Megatron-Core's replay hook: the router's own top-k, with each known row
        replaced by the target's; the weights are its scores at the chosen experts."""
        assert default_compute_topk is not None  # Megatron-Core always passes its own
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        idx = own
        if self.target is not None:
            target = self.target.to(own.device)
            if target.shape != own.shape:
                raise ValueError(
                    f"replayed routing of shape {tuple(target.shape)} for a router of "
                    f"{tuple(own.shape)} tokens x top-k"
                )
            known = (target >= 0).all(dim=1)
            same = (own.sort(dim=1).values == target.sort(dim=1).values).all(dim=1)
            self.agree += torch.stack([(same & known).sum(), known.sum()]).double().cpu()
            idx = torch.where(known.unsqueeze(1), target.long(), own)
        self.chosen = idx.detach()
        return scores.gather(1, idx), idx


class RoutingReplay:
    """:class:`LayerReplay` on every router of ``model`` (this rank's); :meth:`set` before
    each micro-batch's forward."""

    def __init__(self, model: torch.nn.Module, layout: Layout, sequence_parallel: bool) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.layout, self.sp = layout, sequence_parallel and layout.tp > 1
        self.layers: dict[int, LayerReplay] = {}
        for m in model.modules():
            if isinstance(m, TopKRouter):
                m.router_replay = self.layers[m.layer_number - 1] = LayerReplay()

    def set(self, routing: torch.Tensor | None) -> None:
        """The micro-batch's routing, ``[b, s, layers, topk]`` (None: each router its own)."""
        for layer, replay in self.layers.items():
            if routing is None:
                replay.target = None
                continue
            rows = routing[:, :, layer]  # [b, s, topk]
            if self.sp:  # this TP rank holds a contiguous slice of the sequence
                per = rows.shape[1] // self.layout.tp
                rows = rows[:, self.layout.tp_rank * per : (self.layout.tp_rank + 1) * per]
            replay.target = rows.transpose(0, 1).reshape(-1, rows.shape[-1])

    def chosen(self) -> dict[int, torch.Tensor]:
        """Each local layer's experts in the last forward, in Megatron's token order."""
        return {layer: r.chosen for layer, r in self.layers.items() if r.chosen is not None}

    def step(self) -> dict[str, float]:
        """``routing_agreement`` since the last call, summed over every rank (each holds
        other layers, sequence slices or rows); {} when nothing was replayed."""
        vec = sum((r.agree for r in self.layers.values()), torch.zeros(2, dtype=torch.float64))
        for r in self.layers.values():
            r.agree.zero_()
        vec = vec.float()
        lay = self.layout
        tp = lay.tp if self.sp else 1  # without sequence parallelism TP ranks route alike
        for size, group in ((lay.pp, lay.pp_group), (tp, lay.tp_group), (lay.dp, lay.dp_group)):
            if size > 1:
                dist.all_reduce(vec, group=group)
        agree, known = vec.tolist()
        return {"routing_agreement": agree / known} if known else {}
