"""``pg``: the off-policy-corrected policy gradient ``-stopgrad(w) * A * log pi``, ``w``
the correction's weight (``algorithm=aipo``: with the aipo correction, LlamaRL's AIPO)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl.algorithms.registry import Objective
from rl.config.schema import AlgorithmConfig, ObjectiveConfig

if TYPE_CHECKING:
    from rl.algorithms.losses import LossFn
    from rl.algorithms.weights import WeightFn


@dataclass
class PgConfig(ObjectiveConfig):
    name: str = "pg"


def loss(o: PgConfig, a: AlgorithmConfig, weight: WeightFn) -> LossFn:
    from rl.algorithms.losses import pg_loss

    return pg_loss(weight, a.kl_coef)


OBJECTIVE = Objective(PgConfig, loss)
