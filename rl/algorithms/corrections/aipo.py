"""``aipo`` (LlamaRL): ``w = min(r, rho)`` (``algorithm.rho``)."""

from __future__ import annotations

import torch

from rl.algorithms.weights import Correction, Weight, WeightFn


def aipo_weight(rho: float = 4.0) -> WeightFn:
    if rho <= 0:
        raise ValueError(f"algorithm.rho={rho} must be > 0")
    return lambda r: Weight(torch.clamp(r, max=rho), clipped=r > rho)


CORRECTION = Correction("aipo", lambda a: aipo_weight(a.rho))
