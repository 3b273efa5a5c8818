"""The contract of an off-policy correction (rl/algorithms/corrections/): a per-token
weight of the importance ratio ``r = pi/mu`` (detached), used as a constant in the policy
gradient ``-w * A * log pi``, and which tokens it changed, for the logged stats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from rl.config.schema import AlgorithmConfig


class Weight(NamedTuple):
    """A correction's per-token off-policy weight (used as a constant: no gradient) and
    which tokens it changed, for the stats."""

    w: torch.Tensor
    clipped: torch.Tensor | None = None  # bool: w was truncated (-> truncated_frac)
    masked: torch.Tensor | None = None  # bool: the token is dropped, w = 0 (-> masked_frac)


# ratio pi/mu (detached) -> Weight
WeightFn = Callable[[torch.Tensor], Weight]


@dataclass(frozen=True)
class Correction:
    """``algorithm.correction=<name>``: its weight, built from the algorithm's config
    (raising ValueError, naming the field, for a bad parameter)."""

    name: str
    weight: Callable[[AlgorithmConfig], WeightFn]
