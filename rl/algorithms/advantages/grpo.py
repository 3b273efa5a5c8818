"""``grpo``: each sample's reward against its group's, ``A_i = (r_i - mean(r)) / (std(r) +
eps)`` over the ``group_size`` samples of one prompt (Shao et al. 2024, DeepSeekMath,
arXiv 2402.03300), the same for every token of the sample.

Why groups: the group mean is a baseline that needs no value network, and dividing by
the group's std makes the step size independent of the reward scale. A group whose
samples all scored the same carries no signal and gets advantage 0. The default of both
presets (``algorithm=aipo`` and ``algorithm=grpo``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl.algorithms.estimator import Estimate, Estimator, grouped, per_sequence
from rl.config.schema import AdvantageConfig, AlgorithmConfig

if TYPE_CHECKING:
    import torch

    from rl.batch import TrainBatch


@dataclass
class GrpoConfig(AdvantageConfig):
    name: str = "grpo"
    normalize_std: bool = True  # divide by the group's std (false: Dr. GRPO's advantage)
    eps: float = 1e-6  # added to the std


def group_advantages(
    rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """``rewards[g, k]`` (group g, sample k) -> advantages of the same shape."""
    import torch

    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(
            f"rewards must be [groups, samples>=2] for a group baseline, got {list(rewards.shape)}"
        )
    r = rewards.double()
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def estimate(c: GrpoConfig, a: AlgorithmConfig, batch: TrainBatch) -> Estimate:
    assert batch.rewards is not None and batch.loss_mask is not None
    r = grouped(batch, a.group_size).to(batch.rewards.dtype)
    adv = group_advantages(r, c.normalize_std, c.eps)
    return Estimate(per_sequence(adv, batch.loss_mask), {"baseline_mean": r.mean().item()})


ESTIMATOR = Estimator(GrpoConfig, estimate, frozenset({"groups"}))
