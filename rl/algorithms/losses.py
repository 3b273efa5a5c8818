"""Loss functions over per-token log-probabilities, pluggable into the trainer.

Contract: ``loss_fn(logprobs, mb) -> LossOutput``. ``logprobs[b, t]`` is
``log pi(tokens[b, t+1] | tokens[b, :t+1])`` for one microbatch ``mb`` (a dict of
``[b, s]`` tensors including ``tokens`` and ``loss_mask``, whose last column is 0). The loss
is returned as a *sum* plus its denominator (the counted tokens, or what the loss
aggregation divides by: rl/algorithms/aggregation.py): the trainer divides by the global
sum of denominators across microbatches and data-parallel ranks, so the gradient does not
depend on how the batch was split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from rl.algorithms.aggregation import Aggregate, aggregator
from rl.algorithms.weights import Weight, WeightFn
from rl.batch import TrainBatch

TOKEN_MEAN = aggregator("token_mean")


@dataclass
class LossOutput:
    loss_sum: torch.Tensor
    num_tokens: torch.Tensor
    # Per-token sums, reported as means over num_tokens; a key that starts with "seq_" is
    # a per-sequence sum, reported as a mean over the sequences with a counted token.
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    denominator: torch.Tensor | None = None  # int; None: num_tokens


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


class Surrogate(NamedTuple):
    per_token: torch.Tensor  # [b, s] the loss of each token, before the mask
    weight: Weight | None  # the correction's (or the clip's) weight, for the stats
    seq_stats: dict[str, torch.Tensor] | None = None  # per-sequence sums ("seq_" keys)


# (logprobs, log_ratio, ratio = exp(log_ratio) detached, advantages, mask) -> Surrogate
SurrogateFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], Surrogate
]


def _rl_loss(
    logprobs: torch.Tensor,
    mb: TrainBatch,
    surrogate: SurrogateFn,
    kl_coef: float,
    agg: Aggregate,
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
    per_token, weight, seq_stats = surrogate(logprobs, log_ratio, ratio, adv, mask)
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
    # Masked tokens (icepop) still count: the loss is normalised over all response tokens,
    # so masking only removes their gradient and does not rescale the others' (the step
    # size does not grow when the band drops many tokens), and num_tokens stays the same
    # count for every loss. masked_frac is then a true fraction.
    loss_sum, denominator = agg(per_token, mask)
    return LossOutput(
        loss_sum=loss_sum,
        num_tokens=mask.sum().to(torch.int),
        stats={**stats, **(seq_stats or {})},
        denominator=denominator,
    )


def pg_loss(weight_fn: WeightFn, kl_coef: float = 0.0, agg: Aggregate = TOKEN_MEAN) -> LossFn:
    """Off-policy-corrected policy gradient ``-stopgrad(w) * A * log pi`` per token, with
    ``w = weight_fn(pi/mu)`` (one of rl/algorithms/corrections/).

    Why: the generator runs ahead of the trainer (and samples with other numerics), so
    tokens come from a policy mu != pi. The weight corrects for that; bounding it bounds
    the variance, and because it is a constant (no gradient through the ratio) the update
    is a weighted policy gradient that stays well-behaved far off-policy, where PPO's clip
    would zero the gradient."""

    def surrogate(logprobs, log_ratio, ratio, adv, mask):
        weight = weight_fn(ratio)
        return Surrogate(-(weight.w * adv * logprobs), weight)

    def loss(logprobs: torch.Tensor, mb: TrainBatch) -> LossOutput:
        return _rl_loss(logprobs, mb, surrogate, kl_coef, agg)

    return loss


def ppo_clip_loss(
    clip_eps: float = 0.2, kl_coef: float = 0.0, agg: Aggregate = TOKEN_MEAN
) -> LossFn:
    """GRPO/PPO clipped surrogate ``-min(r A, clip(r, 1-eps, 1+eps) A)``, ``r = pi/mu``:
    the on-policy baseline the paper compares AIPO with."""
    if not 0 < clip_eps < 1:
        raise ValueError(f"algorithm.objective.clip_eps={clip_eps} must be in (0, 1)")

    def surrogate(logprobs, log_ratio, _ratio, adv, mask):
        ratio = torch.exp(log_ratio)  # with its gradient, unlike the detached _ratio
        return _clipped(ratio, adv, 1 - clip_eps, 1 + clip_eps)

    def loss(logprobs: torch.Tensor, mb: TrainBatch) -> LossOutput:
        return _rl_loss(logprobs, mb, surrogate, kl_coef, agg)

    return loss


def _clipped(ratio: torch.Tensor, adv: torch.Tensor, low: float, high: float) -> Surrogate:
    """PPO's ``-min(r A, clip(r, low, high) A)``. Where the clipped term is the smaller one
    and differs, the token has no gradient: reported as truncated_frac (the clip
    fraction)."""
    clipped = torch.clamp(ratio, low, high)
    cut = (clipped * adv < ratio * adv).detach()
    return Surrogate(
        -torch.minimum(ratio * adv, clipped * adv), Weight(torch.ones_like(ratio), cut)
    )


def gspo_loss(
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    kl_coef: float = 0.0,
    agg: Aggregate = TOKEN_MEAN,
) -> LossFn:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071):
    PPO's clipped surrogate on the *sequence* ratio ``s_i = (pi(y_i)/mu(y_i))^(1/|y_i|)``,
    the geometric mean of the response's token ratios, clipped to ``[1 - clip_low, 1 +
    clip_high]`` once per sequence.

    In the token form of its section 4.3 (GSPO-token): every token of response i carries
    ``s_i`` as its value and ``s_i * grad log pi(y_it)`` as its gradient, so a per-token
    advantage also works, and with ``seq_mean_token_mean`` (its aggregation unless
    ``algorithm.loss_agg`` says otherwise) the gradient is the paper's
    ``(1/N) sum_i s_i A_i (1/|y_i|) sum_t grad log pi(y_it)``. Why: one clip decision per
    response, as the reward is one per response; token ratios are noisy (one token's
    numerics, an MoE routing flip), their geometric mean is not."""
    if not (0 < clip_low < 1 and clip_high > 0):
        raise ValueError(
            f"algorithm.objective.clip_low={clip_low} must be in (0, 1) and "
            f"algorithm.objective.clip_high={clip_high} > 0"
        )

    def surrogate(logprobs, log_ratio, _ratio, adv, mask):
        lengths = mask.sum(dim=1)
        seq_log_ratio = ((log_ratio * mask).sum(dim=1) / lengths.clamp(min=1)).detach()
        # value s_i, gradient s_i * grad log pi: exp(x - x.detach()) is 1 with x's gradient
        ratio = torch.exp(seq_log_ratio[:, None] + logprobs - logprobs.detach())
        out = _clipped(ratio, adv, 1 - clip_low, 1 + clip_high)
        assert out.weight is not None and out.weight.clipped is not None
        seqs = (lengths > 0).to(mask.dtype)
        cut = (out.weight.clipped.to(mask.dtype) * mask).amax(dim=1)  # any token: all are
        seq_stats = {
            "seq_is_ratio": (torch.exp(seq_log_ratio) * seqs).sum(),
            "seq_clipped_frac": (cut * seqs).sum(),
        }
        return out._replace(seq_stats=seq_stats)

    def loss(logprobs: torch.Tensor, mb: TrainBatch) -> LossOutput:
        return _rl_loss(logprobs, mb, surrogate, kl_coef, agg)

    return loss
