"""``icepop``: ``w = r`` inside the band ``[1/icepop_beta, icepop_beta]``, else 0 (the
token is masked out of the gradient, still counted in the normalisation)."""

from __future__ import annotations

import torch

from rl.algorithms.weights import Correction, Weight, WeightFn


def icepop_weight(beta: float = 5.0) -> WeightFn:
    if beta <= 1:
        raise ValueError(f"algorithm.icepop_beta={beta} must be > 1")

    def weight(r: torch.Tensor) -> Weight:
        masked = (r < 1 / beta) | (r > beta)
        return Weight(torch.where(masked, torch.zeros_like(r), r), masked=masked)

    return weight


CORRECTION = Correction("icepop", lambda a: icepop_weight(a.icepop_beta))
