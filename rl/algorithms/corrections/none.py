"""``none``: ``w = 1``, the plain policy gradient as if the rollout were on-policy (the
baseline that shows what a correction buys; and the only choice for an objective that
corrects itself, as PPO's clipped ratio does)."""

from __future__ import annotations

from dataclasses import dataclass

from rl.algorithms.weights import Correction, Weight, WeightFn
from rl.config.schema import CorrectionConfig


@dataclass
class NoCorrectionConfig(CorrectionConfig):
    name: str = "none"


def no_weight() -> WeightFn:
    import torch

    return lambda r: Weight(torch.ones_like(r))


CORRECTION = Correction(NoCorrectionConfig, lambda c: no_weight())
