"""``dr_grpo``: Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A
Critical Perspective", arXiv 2503.20783): ``A_i = r_i - mean(r)`` over the prompt's
group, with no division by the group's std, and the loss summed over tokens and divided
by a constant, the number of samples times the maximum response length
(``loss_agg=seq_mean_token_sum_norm``), instead of each response's own length.

Why: GRPO's two normalisations bias it. Dividing by a response's length makes a long
wrong answer cost less per token than a short one (responses grow), and dividing by the
group's std weighs questions that are too easy or too hard more than the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl.algorithms.estimator import Estimate, Estimator, minus_baseline
from rl.config.schema import AdvantageConfig, AlgorithmConfig

if TYPE_CHECKING:
    from rl.batch import TrainBatch


@dataclass
class DrGrpoConfig(AdvantageConfig):
    name: str = "dr_grpo"


def estimate(c: DrGrpoConfig, a: AlgorithmConfig, batch: TrainBatch) -> Estimate:
    return minus_baseline(batch, a.group_size, lambda r: r.mean(dim=1, keepdim=True))


ESTIMATOR = Estimator(
    DrGrpoConfig, estimate, frozenset({"groups"}), loss_agg="seq_mean_token_sum_norm"
)
