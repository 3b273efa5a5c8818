"""``tis``: token-level truncated importance sampling, ``w = clamp(r, tis_clip_low,
tis_clip)``."""

from __future__ import annotations

import torch

from rl.algorithms.weights import Correction, Weight, WeightFn


def tis_weight(clip: float = 2.0, clip_low: float = 0.0) -> WeightFn:
    if clip <= 0:
        raise ValueError(f"algorithm.tis_clip={clip} must be > 0")
    if not 0 <= clip_low < clip:
        raise ValueError(f"algorithm.tis_clip_low={clip_low} must be in [0, tis_clip={clip})")
    return lambda r: Weight(
        torch.clamp(r, min=clip_low, max=clip), clipped=(r > clip) | (r < clip_low)
    )


CORRECTION = Correction("tis", lambda a: tis_weight(a.tis_clip, a.tis_clip_low))
