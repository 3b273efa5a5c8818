"""``none``: ``w = 1``, the plain policy gradient as if the rollout were on-policy (the
baseline that shows what a correction buys; and the only choice for an objective that
corrects itself, as PPO's clipped ratio does)."""

from __future__ import annotations

import torch

from rl.algorithms.weights import Correction, Weight, WeightFn


def no_weight() -> WeightFn:
    return lambda r: Weight(torch.ones_like(r))


CORRECTION = Correction("none", lambda a: no_weight())
