"""``rloo``: REINFORCE leave-one-out (Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a
Baseline for Free!"; Ahmadian et al. 2024, "Back to Basics", arXiv 2402.14740):
each sample's baseline is the mean reward of the *other* samples of its prompt,
``A_i = r_i - mean(r_j, j != i) = K / (K - 1) * (r_i - mean(r))``.

Why: a baseline that does not include the sample itself keeps the policy gradient
unbiased (GRPO's own-group mean is biased by 1/K), at no extra cost.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl.algorithms.estimator import Estimate, Estimator, minus_baseline
from rl.config.schema import AdvantageConfig, AlgorithmConfig

if TYPE_CHECKING:
    import torch

    from rl.batch import TrainBatch


@dataclass
class RlooConfig(AdvantageConfig):
    name: str = "rloo"


def leave_one_out(r: torch.Tensor) -> torch.Tensor:
    """``[groups, k]`` rewards -> each sample's mean of the other ``k - 1``."""
    return (r.sum(dim=1, keepdim=True) - r) / (r.shape[1] - 1)


def estimate(c: RlooConfig, a: AlgorithmConfig, batch: TrainBatch) -> Estimate:
    return minus_baseline(batch, a.group_size, leave_one_out)


ESTIMATOR = Estimator(RlooConfig, estimate, frozenset({"groups"}))
