"""Loss functions over per-token log-probabilities, pluggable into the trainer.

Contract: ``loss_fn(logprobs, mb) -> LossOutput``. ``logprobs[b, t]`` is
``log pi(tokens[b, t+1] | tokens[b, :t+1])`` for one microbatch ``mb`` (a dict of
``[b, s]`` tensors including ``tokens`` and ``loss_mask``, whose last column is 0). The loss
is returned as a *sum* over counted tokens plus the count: the trainer divides by the
global token count across microbatches and data-parallel ranks, so the gradient does not
depend on how the batch was split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class LossOutput:
    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    # Per-token sums, reported as means over num_tokens.
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


LossFn = Callable[[torch.Tensor, dict[str, torch.Tensor]], LossOutput]


def nll_loss(logprobs: torch.Tensor, mb: dict[str, torch.Tensor]) -> LossOutput:
    """Supervised negative log-likelihood on the masked tokens."""
    mask = mb["loss_mask"].to(logprobs.dtype)
    return LossOutput(
        loss_sum=-(logprobs * mask).sum(),
        num_tokens=mask.sum().to(torch.int),
    )
