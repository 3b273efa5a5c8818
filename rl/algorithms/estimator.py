"""The contract of an advantage estimator (rl/algorithms/advantages/): from a batch's
rewards (one per sample, after the overlong rule), its loss mask and, for some, the
reference log-probs or a critic's values, the advantage of every sampled token.

An estimator declares what it needs (:data:`NEEDS`); a run that cannot provide it is
refused before launch (rl/algorithms/registry.py). It may also name its own loss
aggregation (Dr. GRPO's constant denominator) and take the KL to the reference into the
reward instead of the loss (REINFORCE++). The helpers below are the pieces the built-ins
share. Pure logic: torch only, imported inside the estimators' functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

from rl.config.schema import AdvantageConfig

if TYPE_CHECKING:
    import torch

    from rl.batch import TrainBatch
    from rl.config.schema import AlgorithmConfig

# groups: several samples per prompt (algorithm.group_size >= 2); values: a critic's value
# for every token; ref_logprobs: log pi_ref of every token (algorithm.kl_coef > 0).
NEEDS = ("groups", "values", "ref_logprobs")


class Estimate(NamedTuple):
    advantages: torch.Tensor  # [B, S], 0 off the loss mask
    # The estimator's own figures for the step's metrics (each logged as adv_<key>).
    stats: dict[str, float]
    returns: torch.Tensor | None = None  # [B, S] a critic's regression targets (GAE)


C = TypeVar("C", bound=AdvantageConfig)


@dataclass(frozen=True)
class Estimator(Generic[C]):
    """``algorithm/advantage=<name>``: its config (an :class:`AdvantageConfig` subclass
    whose ``name`` default is the choice's name) and ``estimate(config, algorithm,
    batch)``. ``loss_agg``: the aggregation it implies when ``algorithm.loss_agg`` is
    null. ``kl_in_reward``: ``algorithm.kl_coef`` weighs a per-token KL reward here, and
    the loss carries no KL term."""

    config: type[C]
    estimate: Callable[[C, AlgorithmConfig, TrainBatch], Estimate]
    needs: frozenset[str] = frozenset()
    loss_agg: str | None = None
    _: KW_ONLY
    kl_in_reward: bool = False

    def __post_init__(self) -> None:
        unknown = sorted(self.needs - set(NEEDS))
        if unknown:
            raise ValueError(f"estimator {self.name!r} needs {unknown}: not among {NEEDS}")

    @property
    def name(self) -> str:
        return str(self.config.name)


def grouped(batch: TrainBatch, group_size: int) -> torch.Tensor:
    """The batch's rewards as ``[groups, group_size]`` (rows are grouped in order: sample
    k of prompt g is row ``g * group_size + k``), in float64."""
    batch.require("rewards")
    assert batch.rewards is not None
    if group_size < 2 or batch.rows % group_size:
        raise ValueError(
            f"a group baseline needs groups of algorithm.group_size={group_size} >= 2 "
            f"samples, and a batch of {batch.rows} rows does not make them"
        )
    return batch.rewards.double().reshape(-1, group_size)


def minus_baseline(
    batch: TrainBatch, group_size: int, baseline: Callable[[torch.Tensor], torch.Tensor]
) -> Estimate:
    """Each sample's reward minus ``baseline(r)``, ``r`` the batch's rewards as ``[groups,
    group_size]`` in float64 (the baseline of the same shape, or one per group), one
    advantage per sequence; figure: the baselines' mean."""
    batch.require("loss_mask")
    assert batch.loss_mask is not None
    r = grouped(batch, group_size)
    b = baseline(r)
    return Estimate(per_sequence(r - b, batch.loss_mask), {"baseline_mean": b.mean().item()})


def per_sequence(seq_adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One advantage per sequence, broadcast over its loss-mask tokens ``[B, S]``."""
    return seq_adv.reshape(-1).to(mask.dtype)[:, None] * mask


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """``(x - mean) / (std + eps)`` over the masked tokens of the whole batch (unbiased
    std), 0 off the mask; float64 in, float64 out."""
    m = mask.double()
    n = m.sum()
    if n < 2:
        raise ValueError(f"whitening over the batch needs >= 2 tokens, it has {int(n)}")
    mean = (x * m).sum() / n
    var = (((x - mean) * m) ** 2).sum() / (n - 1)
    return (x - mean) / (var.sqrt() + eps) * m


def token_rewards(batch: TrainBatch, kl_coef: float) -> torch.Tensor:
    """Per-token rewards ``[B, S]`` in float64: each sample's reward on its last loss-mask
    token and, when ``kl_coef > 0``, ``-kl_coef * (log mu - log pi_ref)`` on every one (the
    sampled tokens' KL to the reference, estimated at the behaviour policy)."""
    import torch

    batch.require("rewards", "loss_mask")
    assert batch.rewards is not None and batch.loss_mask is not None
    m = batch.loss_mask.double()
    cols = torch.arange(m.shape[1], dtype=torch.float64)
    last = (m * (cols + 1)).argmax(dim=1)  # the last masked column of each row
    rows = (m.sum(dim=1) > 0).nonzero().squeeze(1)
    r = torch.zeros_like(m)
    r[rows, last[rows]] = batch.rewards.double()[rows]
    if kl_coef > 0:
        batch.require("behaviour_logprobs", "ref_logprobs")
        assert batch.behaviour_logprobs is not None and batch.ref_logprobs is not None
        kl = batch.behaviour_logprobs.double() - batch.ref_logprobs.double()
        r = r - kl_coef * kl * m
    return r


def summary(adv: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Every estimator's figures over the loss-mask tokens: the advantages' mean, std and
    fraction of exact zeros (tokens that teach nothing)."""
    m = mask.double() > 0
    a = adv.double()[m]
    if a.numel() == 0:
        return {"mean": 0.0, "std": 0.0, "zero_frac": 1.0}
    std = a.std().item() if a.numel() > 1 else 0.0
    return {"mean": a.mean().item(), "std": std, "zero_frac": (a == 0).double().mean().item()}
