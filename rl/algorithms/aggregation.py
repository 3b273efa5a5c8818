"""How a batch's per-token losses become one loss (``algorithm.loss_agg``).

The trainer divides the sum of every micro-batch's ``loss_sum`` (over data-parallel ranks
too) by the sum of their ``denominator``, so each mode is a pair of sums over rows, and
splitting a batch into micro-batches or DP shards never changes its gradient:

* ``token_mean``: ``sum_i sum_t l_it / sum_i |y_i|``. Every token weighs the same, so a
  long response weighs more than a short one (the default, verl's token-mean).
* ``seq_mean_token_mean``: ``(1/N) sum_i (1/|y_i|) sum_t l_it``. Every response weighs the
  same; its tokens share its weight (GRPO's paper, GSPO).
* ``seq_mean_token_sum_norm``: ``sum_i sum_t l_it / (N * L)``, ``L`` a constant, the
  maximum response length (``rollout.sampling.max_new_tokens``). Every token weighs the
  same whatever its response's length and the batch's (Dr. GRPO).

``N`` counts the responses with at least one loss-mask token. Pure logic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

LOSS_AGGS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")

# (per-token loss [b, s], loss mask [b, s]) -> (loss_sum, denominator: an int tensor)
Aggregate = Callable[["torch.Tensor", "torch.Tensor"], tuple["torch.Tensor", "torch.Tensor"]]


def aggregator(mode: str, max_tokens: int = 0) -> Aggregate:
    """The aggregation ``mode`` names (``max_tokens``: ``L`` of seq_mean_token_sum_norm);
    ValueError naming the field for a bad one."""
    import torch

    if mode not in LOSS_AGGS:
        raise ValueError(f"algorithm.loss_agg={mode!r} must be one of {', '.join(LOSS_AGGS)}")
    if mode == "seq_mean_token_sum_norm" and max_tokens < 1:
        raise ValueError(
            f"algorithm.loss_agg={mode} divides by the maximum response length, "
            f"rollout.sampling.max_new_tokens={max_tokens}: it must be >= 1"
        )

    def agg(per_token: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counted = per_token * mask
        if mode == "token_mean":
            return counted.sum(), mask.sum().to(torch.int)
        lengths = mask.sum(dim=1)
        seqs = (lengths > 0).sum().to(torch.int)
        if mode == "seq_mean_token_mean":
            return (counted.sum(dim=1) / lengths.clamp(min=1)).sum(), seqs
        return counted.sum(), seqs * max_tokens

    return agg
