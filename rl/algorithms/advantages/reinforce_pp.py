"""``reinforce_pp``: REINFORCE++ (Hu 2025, arXiv 2501.03262): per-token rewards, the
sample's reward on its last token and, with ``algorithm.kl_coef > 0``, ``-kl_coef *
KL_t`` on every token (``KL_t = log mu - log pi_ref``, the sampled token's KL to the
reference); the return ``G_t = sum_{s >= t} gamma^(s-t) r_s``; the advantage ``(G_t -
mean(G)) / (std(G) + eps)`` with the mean and std over every response token of the whole
batch.

Why: the batch-wide baseline needs neither a critic nor several samples per prompt
(``group_size=1`` works), and normalising over the batch rather than the group keeps
easy and hard prompts on one scale. The KL is part of the reward here, so the loss has
no KL term.
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
class ReinforcePpConfig(AdvantageConfig):
    name: str = "reinforce_pp"
    gamma: float = 1.0  # the discount of later tokens' rewards
    eps: float = 1e-6  # added to the batch's std


def discounted_returns(r: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """``G_t = r_t + gamma * G_t'`` with ``t'`` the row's next loss-mask token (tokens off
    the mask, an environment's observations, are skipped), 0 off the mask."""
    import torch

    out = torch.zeros_like(r)
    ahead = torch.zeros_like(r[:, 0])
    m = mask.double()
    for t in reversed(range(r.shape[1])):
        g = r[:, t] + gamma * ahead
        on = m[:, t] > 0
        out[:, t] = torch.where(on, g, torch.zeros_like(g))
        ahead = torch.where(on, g, ahead)
    return out


def estimate(c: ReinforcePpConfig, a: AlgorithmConfig, batch: TrainBatch) -> Estimate:
    assert batch.loss_mask is not None
    if not 0 < c.gamma <= 1:
        raise ValueError(f"algorithm.advantage.gamma={c.gamma} must be in (0, 1]")
    mask = batch.loss_mask
    returns = discounted_returns(token_rewards(batch, a.kl_coef), mask, c.gamma)
    m = mask.double()
    stats = {"baseline_mean": ((returns * m).sum() / m.sum()).item()}
    if a.kl_coef > 0:  # the loss has no KL term to log it: the reward's, per token
        assert batch.behaviour_logprobs is not None and batch.ref_logprobs is not None
        kl = batch.behaviour_logprobs.double() - batch.ref_logprobs.double()
        stats["kl_ref"] = ((kl * m).sum() / m.sum()).item()
    adv = masked_whiten(returns, mask, c.eps).to(mask.dtype)
    return Estimate(adv, stats, returns.to(mask.dtype))


ESTIMATOR = Estimator(ReinforcePpConfig, estimate, kl_in_reward=True)
