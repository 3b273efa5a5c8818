"""``gae``: generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438)
from a critic's value ``V_t`` of every token: ``delta_t = r_t + gamma * V_t' - V_t`` and
``A_t = delta_t + gamma * lambda * A_t'`` (``t'`` the next response token; 0 after the
last), the returns ``A_t + V_t`` (the critic's targets); ``r_t`` is the sample's reward
on its last token. The advantages are then whitened over the batch (``whiten``).

Why: a learned per-token baseline gives each token its own credit and needs one sample
per prompt; ``lambda`` trades the critic's bias (0) against the return's variance (1).
It needs the values of a critic (``needs=values``), which a run provides with a critic
executor; without one it is refused before launch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl.algorithms.estimator import Estimate, Estimator, masked_whiten, token_rewards
from rl.config.schema import AdvantageConfig, AlgorithmConfig

if TYPE_CHECKING:
    import torch

    from rl.batch import TrainBatch


@dataclass
class GaeConfig(AdvantageConfig):
    name: str = "gae"
    gamma: float = 1.0  # the discount
    lam: float = 0.95  # GAE's lambda (a Python keyword, hence lam)
    whiten: bool = True  # normalise the advantages over the batch's tokens
    eps: float = 1e-6


def gae(
    r: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) ``[B, S]`` from per-token rewards and values, both 0 off the
    mask; the recursion runs over each row's loss-mask tokens, skipping the rest."""
    import torch

    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    next_adv = torch.zeros_like(r[:, 0])
    m = mask.double()
    for t in reversed(range(r.shape[1])):
        on = m[:, t] > 0
        delta = r[:, t] + gamma * next_value - values[:, t]
        a_t = delta + gamma * lam * next_adv
        adv[:, t] = torch.where(on, a_t, torch.zeros_like(a_t))
        next_value = torch.where(on, values[:, t], next_value)
        next_adv = torch.where(on, a_t, next_adv)
    return adv, (adv + values) * m


def estimate(c: GaeConfig, a: AlgorithmConfig, batch: TrainBatch) -> Estimate:
    for name, v in (("gamma", c.gamma), ("lam", c.lam)):
        if not 0 <= v <= 1:
            raise ValueError(f"algorithm.advantage.{name}={v} must be in [0, 1]")
    batch.require("values", "loss_mask")
    assert batch.values is not None and batch.loss_mask is not None
    mask = batch.loss_mask
    values = batch.values.double() * mask.double()
    adv, returns = gae(token_rewards(batch, 0.0), values, mask, c.gamma, c.lam)
    m = mask.double()
    stats = {"baseline_mean": ((values * m).sum() / m.sum().clamp(min=1)).item()}
    if c.whiten:
        adv = masked_whiten(adv, mask, c.eps)
    return Estimate(adv.to(mask.dtype), stats, returns.to(mask.dtype))


ESTIMATOR = Estimator(GaeConfig, estimate, frozenset({"values"}))
