"""``icepop``: ``w = r`` inside the band ``[1/beta, beta]``, else 0 (the token is masked
out of the gradient, still counted in the normalisation)."""

from __future__ import annotations

from dataclasses import dataclass

from rl.algorithms.weights import Correction, Weight, WeightFn
from rl.config.schema import CorrectionConfig


@dataclass
class IcepopConfig(CorrectionConfig):
    name: str = "icepop"
    beta: float = 5.0  # the band's upper edge (> 1); its lower edge is 1/beta


def icepop_weight(beta: float = 5.0) -> WeightFn:
    import torch

    if beta <= 1:
        raise ValueError(f"algorithm.correction.beta={beta} must be > 1")

    def weight(r: torch.Tensor) -> Weight:
        masked = (r < 1 / beta) | (r > beta)
        return Weight(torch.where(masked, torch.zeros_like(r), r), masked=masked)

    return weight


CORRECTION = Correction(IcepopConfig, lambda c: icepop_weight(c.beta))
