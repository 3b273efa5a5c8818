"""``pg``: the off-policy-corrected policy gradient ``-stopgrad(w) * A * log pi``, ``w``
the correction's weight (``algorithm=aipo``: with the aipo correction, LlamaRL's AIPO)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl.algorithms.registry import LossParts, Objective
from rl.config.schema import ObjectiveConfig

if TYPE_CHECKING:
    from rl.algorithms.losses import LossFn


@dataclass
class PgConfig(ObjectiveConfig):
    name: str = "pg"


def loss(o: PgConfig, p: LossParts) -> LossFn:
    from rl.algorithms.losses import pg_loss

    return pg_loss(p.weight, p.kl_coef, p.agg)


OBJECTIVE = Objective(PgConfig, loss)
