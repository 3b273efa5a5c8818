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

from rl.algorithms.estimator import Estimate, Estimator, grouped, per_sequence
from rl.config.schema import AdvantageConfig, AlgorithmConfig

if TYPE_CHECKING:
    from rl.batch import TrainBatch


@dataclass
class RlooConfig(AdvantageConfig):
    name: str = "rloo"


def estimate(c: RlooConfig, a: AlgorithmConfig, batch: TrainBatch) -> Estimate:
    assert batch.loss_mask is not None
    r = grouped(batch, a.group_size)
    k = r.shape[1]
    baseline = (r.sum(dim=1, keepdim=True) - r) / (k - 1)
    adv = r - baseline
    return Estimate(per_sequence(adv, batch.loss_mask), {"baseline_mean": baseline.mean().item()})


ESTIMATOR = Estimator(RlooConfig, estimate, frozenset({"groups"}))
