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

from rl.algorithms.weights import Weight, WeightFn
from rl.batch import TrainBatch


@dataclass
class LossOutput:
    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    # Per-token sums, reported as means over num_tokens.
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


LossFn = Callable[[torch.Tensor, TrainBatch], LossOutput]


def nll_loss(logprobs: torch.Tensor, mb: TrainBatch) -> LossOutput:
    """Supervised negative log-likelihood on the masked tokens."""
    mb.require("loss_mask")
    assert mb.loss_mask is not None
    mask = mb.loss_mask.to(logprobs.dtype)
    return LossOutput(
        loss_sum=-(logprobs * mask).sum(),
        num_tokens=mask.sum().to(torch.int),
    )


# ------------------------------------------------------------------ RL losses
# The microbatch fields they read beside loss_mask (rl/batch.py), aligned with ``logprobs``:
# behaviour_logprobs and advantages, and ref_logprobs when a KL penalty is asked for.


def _kl_k3(logprobs: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate ``exp(r) - r - 1`` with ``r = log pi_ref - log
    pi``: unbiased, non-negative and low-variance for samples from pi (Schulman's k3)."""
    r = ref - logprobs
    return torch.exp(r) - r - 1


# (logprobs, log_ratio, ratio = exp(log_ratio) detached, advantages) -> per-token loss and
# the correction's weight when there is one.
Surrogate = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, Weight | None],
]


def _rl_loss(
    logprobs: torch.Tensor,
    mb: TrainBatch,
    surrogate: Surrogate,
    kl_coef: float,
) -> LossOutput:
    mb.require(
        "loss_mask", "behaviour_logprobs", "advantages", *(("ref_logprobs",) * bool(kl_coef))
    )
    assert mb.loss_mask is not None and mb.behaviour_logprobs is not None
    assert mb.advantages is not None
    mask = mb.loss_mask.to(logprobs.dtype)
    mu = mb.behaviour_logprobs.to(logprobs.dtype)
    adv = mb.advantages.to(logprobs.dtype)
    log_ratio = logprobs - mu
    ratio = torch.exp(log_ratio.detach())
    per_token, weight = surrogate(logprobs, log_ratio, ratio, adv)
    # Train-vs-rollout mismatch: how far the trainer's log-probs are from the ones the
    # generator sampled with (policy lag, numerics, sampling temperature), measured at
    # pi_old, before this batch's updates moved the policy (rl/algorithms/reuse.py).
    stats = {"is_ratio": (ratio * mask).sum()}
    if mb.old_logprobs is None:  # one update per batch: pi_old is pi
        stats["mismatch_abs_logp"] = (log_ratio.detach().abs() * mask).sum()
    else:  # and the policy's own move within the batch
        old = mb.old_logprobs.to(logprobs.dtype)
        stats["mismatch_abs_logp"] = ((old - mu).abs() * mask).sum()
        stats["policy_change_abs_logp"] = ((logprobs.detach() - old).abs() * mask).sum()
    masked = None if weight is None else weight.masked
    if weight is not None and weight.clipped is not None:
        stats["truncated_frac"] = (weight.clipped.to(mask.dtype) * mask).sum()
    if masked is not None:
        stats["masked_frac"] = (masked.to(mask.dtype) * mask).sum()
    if kl_coef:
        assert mb.ref_logprobs is not None
        kl = _kl_k3(logprobs, mb.ref_logprobs.to(logprobs.dtype))
        # A masked token contributes nothing to the gradient, the KL penalty included;
        # kl_ref still measures every counted token.
        kl_term = kl if masked is None else torch.where(masked, torch.zeros_like(kl), kl)
        per_token = per_token + kl_coef * kl_term
        stats["kl_ref"] = (kl.detach() * mask).sum()
    return LossOutput(
        loss_sum=(per_token * mask).sum(),
        # Masked tokens (icepop) still count: the loss is normalised over all response
        # tokens, so masking only removes their gradient and does not rescale the others'
        # (the step size does not grow when the band drops many tokens), and num_tokens
        # stays the same count for every loss. masked_frac is then a true fraction.
        num_tokens=mask.sum().to(torch.int),
        stats=stats,
    )


def pg_loss(weight_fn: WeightFn, kl_coef: float = 0.0) -> LossFn:
    """Off-policy-corrected policy gradient ``-stopgrad(w) * A * log pi`` per token, with
    ``w = weight_fn(pi/mu)`` (one of rl/algorithms/corrections/).

    Why: the generator runs ahead of the trainer (and samples with other numerics), so
    tokens come from a policy mu != pi. The weight corrects for that; bounding it bounds
    the variance, and because it is a constant (no gradient through the ratio) the update
    is a weighted policy gradient that stays well-behaved far off-policy, where PPO's clip
    would zero the gradient."""

    def surrogate(logprobs, log_ratio, ratio, adv):
        weight = weight_fn(ratio)
        return -(weight.w * adv * logprobs), weight

    def loss(logprobs: torch.Tensor, mb: TrainBatch) -> LossOutput:
        return _rl_loss(logprobs, mb, surrogate, kl_coef)

    return loss


def ppo_clip_loss(clip_eps: float = 0.2, kl_coef: float = 0.0) -> LossFn:
    """GRPO/PPO clipped surrogate ``-min(r A, clip(r, 1-eps, 1+eps) A)``, ``r = pi/mu``:
    the on-policy baseline the paper compares AIPO with."""
    if not 0 < clip_eps < 1:
        raise ValueError(f"algorithm.objective.clip_eps={clip_eps} must be in (0, 1)")

    def surrogate(logprobs, log_ratio, _ratio, adv):
        ratio = torch.exp(log_ratio)  # with its gradient, unlike the detached _ratio
        clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
        # Where the clipped term is the smaller one and differs, the token has no gradient:
        # reported as truncated_frac (PPO's clip fraction).
        cut = (clipped * adv < ratio * adv).detach()
        return -torch.minimum(ratio * adv, clipped * adv), Weight(torch.ones_like(ratio), cut)

    def loss(logprobs: torch.Tensor, mb: TrainBatch) -> LossOutput:
        return _rl_loss(logprobs, mb, surrogate, kl_coef)

    return loss
