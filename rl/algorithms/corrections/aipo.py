"""``aipo`` (LlamaRL): ``w = min(r, rho)`` (``algorithm.correction.rho``)."""

from __future__ import annotations

from dataclasses import dataclass

from rl.algorithms.weights import Correction, Weight, WeightFn
from rl.config.schema import CorrectionConfig


@dataclass
class AipoConfig(CorrectionConfig):
    name: str = "aipo"
    rho: float = 4.0  # the cap on the importance weight pi/mu


def aipo_weight(rho: float = 4.0) -> WeightFn:
    import torch

    if rho <= 0:
        raise ValueError(f"algorithm.correction.rho={rho} must be > 0")
    return lambda r: Weight(torch.clamp(r, max=rho), clipped=r > rho)


CORRECTION = Correction(AipoConfig, lambda c: aipo_weight(c.rho))
