"""``tis``: token-level truncated importance sampling, ``w = clamp(r, clip_low, clip)``."""

from __future__ import annotations

from dataclasses import dataclass

from rl.algorithms.weights import Correction, Weight, WeightFn
from rl.config.schema import CorrectionConfig


@dataclass
class TisConfig(CorrectionConfig):
    name: str = "tis"
    clip: float = 2.0
    clip_low: float = 0.0


def tis_weight(clip: float = 2.0, clip_low: float = 0.0) -> WeightFn:
    import torch

    if clip <= 0:
        raise ValueError(f"algorithm.correction.clip={clip} must be > 0")
    if not 0 <= clip_low < clip:
        raise ValueError(f"algorithm.correction.clip_low={clip_low} must be in [0, clip={clip})")
    return lambda r: Weight(
        torch.clamp(r, min=clip_low, max=clip), clipped=(r > clip) | (r < clip_low)
    )


CORRECTION = Correction(TisConfig, lambda c: tis_weight(c.clip, c.clip_low))
