"""A scalar head in place of the LM head: HF's ``score`` linear of a
``*ForSequenceClassification`` model with one label, for reward models and critics.

Why its own module rather than a ``ColumnParallelLinear`` of one output: one output row
cannot be split over TP ranks. The head is replicated instead, whole on every TP rank, as a
norm's weight is: every rank sees the whole final hidden state (gathered from the sequence
slices first under sequence parallelism), so every rank computes the same values and the
same gradient, and no TP reduction is needed. It keeps the output layer's call signature,
so ``GPTModel``'s forward runs unchanged and returns ``[b, s, 1]`` values instead of logits.

Its initial weight is drawn from its own generator seeded by ``trainer.seed``: the same at
every TP and PP size (a critic's fresh head must not depend on the layout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel


class ScoreHead(torch.nn.Module):
    """``[s, b, h] -> [s, b, 1]``: the final hidden state's dot product with ``weight``."""

    def __init__(self, hidden: int, dtype: torch.dtype, std: float, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        init = torch.randn(1, hidden, generator=g, dtype=torch.float32) * std
        self.weight = torch.nn.Parameter(init.to(dtype))
        self.sequence_parallel = False  # GPTModel reads (and may toggle) this attribute
        self.tp_group: torch.distributed.ProcessGroup | None = None

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            # Each rank then computes on the whole sequence; the backward hands each its
            # own slice of the gradient (no reduction: the ranks' gradients are equal).
            hidden = gather_from_sequence_parallel_region(
                hidden, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return torch.nn.functional.linear(hidden, self.weight), None


def attach(model: GPTModel, std: float, seed: int) -> None:
    """Replace the last stage's LM head of ``model`` by a :class:`ScoreHead` (the model
    must not tie its output layer to the embeddings)."""
    if not model.post_process:
        return
    cfg = model.config
    head = ScoreHead(cfg.hidden_size, cfg.params_dtype, std, seed)
    head.sequence_parallel = cfg.sequence_parallel
    head.tp_group = model.pg_collection.tp
    model.output_layer = head
