"""The RL objective and its off-policy correction, by name: ``algorithm.objective`` is one
module of rl/algorithms/objectives/, ``algorithm.correction`` one of
rl/algorithms/corrections/ (found by listing the packages: rl/plugins.py). Adding either
is one module and its tests."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from rl.algorithms.losses import LossFn
from rl.algorithms.weights import Correction, WeightFn
from rl.config.errors import ConfigError
from rl.plugins import discover

if TYPE_CHECKING:
    from rl.config.schema import AlgorithmConfig


@dataclass(frozen=True)
class Objective:
    """``algorithm.objective=<name>``: the loss, built from the algorithm's config and the
    correction's weight. ``own_correction``: it corrects for the lag itself (PPO's clipped
    ratio), so it takes the ``none`` correction only."""

    name: str
    loss: Callable[[AlgorithmConfig, WeightFn], LossFn]
    own_correction: bool = False


@cache
def objectives() -> dict[str, Objective]:
    from rl.algorithms import objectives as package

    return discover(package, "OBJECTIVE", lambda o: o.name)


@cache
def corrections() -> dict[str, Correction]:
    from rl.algorithms import corrections as package

    return discover(package, "CORRECTION", lambda c: c.name)


def loss_from_config(a: AlgorithmConfig) -> LossFn:
    """The loss an ``AlgorithmConfig`` names: ``objective`` with ``correction``'s weight.
    Raises ValueError naming the bad field."""
    objective, correction = objectives().get(a.objective), corrections().get(a.correction)
    if objective is None:
        raise ValueError(f"algorithm.objective={a.objective!r} must be one of "
                         f"{', '.join(objectives())}")  # fmt: skip
    if correction is None:
        raise ValueError(f"algorithm.correction={a.correction!r} must be one of "
                         f"{', '.join(corrections())}")  # fmt: skip
    if objective.own_correction and correction.name != "none":
        raise ValueError(
            f"algorithm.correction={a.correction!r} must be 'none' with algorithm.objective="
            f"{objective.name} (it corrects for the lag itself)"
        )
    return objective.loss(a, correction.weight(a))


def check_config(a: AlgorithmConfig) -> None:
    """The objective and correction an ``AlgorithmConfig`` names, built as the trainer
    will build them; raises :class:`ConfigError` in one line."""
    try:
        loss_from_config(a)
    except ValueError as e:
        raise ConfigError(str(e)) from None
