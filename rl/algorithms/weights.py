"""The contract of an off-policy correction (rl/algorithms/corrections/): a per-token
weight of the importance ratio ``r = pi/mu`` (detached), used as a constant in the policy
gradient ``-w * A * log pi``, and which tokens it changed, for the logged stats."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

from rl.config.schema import CorrectionConfig

if TYPE_CHECKING:
    import torch


class Weight(NamedTuple):
    """A correction's per-token off-policy weight (used as a constant: no gradient) and
    which tokens it changed, for the stats."""

    w: torch.Tensor
    clipped: torch.Tensor | None = None  # bool: w was truncated (-> truncated_frac)
    masked: torch.Tensor | None = None  # bool: the token is dropped, w = 0 (-> masked_frac)


# ratio pi/mu (detached) -> Weight
WeightFn = Callable[["torch.Tensor"], Weight]


C = TypeVar("C", bound=CorrectionConfig)


@dataclass(frozen=True)
class Correction(Generic[C]):
    """``algorithm/correction=<name>``: its config (a :class:`CorrectionConfig` subclass
    whose ``name`` default is the choice's name, with the correction's own fields) and its
    weight, built from that config (raising ValueError, naming the field, for a bad one)."""

    config: type[C]
    weight: Callable[[C], WeightFn]

    @property
    def name(self) -> str:
        return str(self.config.name)
