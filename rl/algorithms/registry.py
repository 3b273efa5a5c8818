"""The RL objective and its off-policy correction, by name: ``algorithm/objective=<name>``
is one module of rl/algorithms/objectives/, ``algorithm/correction=<name>`` one of
rl/algorithms/corrections/ (found by listing the packages: rl/plugins.py), each with its
own config dataclass, which :func:`store_schemas` makes Hydra's choices. Adding either is
one module and its tests. Composing any config imports every choice's module (the planner
too, which runs without torch), so a choice imports torch inside its functions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from rl.algorithms.weights import Correction, WeightFn
from rl.config.errors import ConfigError
from rl.config.schema import ObjectiveConfig
from rl.plugins import chosen, discover

if TYPE_CHECKING:
    from rl.algorithms.losses import LossFn
    from rl.config.schema import AlgorithmConfig

Cfg = TypeVar("Cfg", bound=ObjectiveConfig)


@dataclass(frozen=True)
class Objective(Generic[Cfg]):
    """``algorithm/objective=<name>``: its config (an :class:`ObjectiveConfig` subclass
    whose ``name`` default is the choice's name) and the loss, built from that config, the
    algorithm's shared fields and the correction's weight. ``own_correction``: it corrects
    for the lag itself (PPO's clipped ratio), so it takes the ``none`` correction only."""

    config: type[Cfg]
    loss: Callable[[Cfg, AlgorithmConfig, WeightFn], LossFn]
    own_correction: bool = False

    @property
    def name(self) -> str:
        return str(self.config.name)


@cache
def objectives() -> dict[str, Objective[Any]]:
    from rl.algorithms import objectives as package

    return discover(package, "OBJECTIVE", lambda o: o.name)


@cache
def corrections() -> dict[str, Correction[Any]]:
    from rl.algorithms import corrections as package

    return discover(package, "CORRECTION", lambda c: c.name)


def store_schemas() -> None:
    """Every objective and correction as a choice of its Hydra group, typed by its config."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for o in objectives().values():
        cs.store(group="algorithm/objective", name=o.name, node=o.config)
    for c in corrections().values():
        cs.store(group="algorithm/correction", name=c.name, node=c.config)


def _config(choice: Objective[Any] | Correction[Any]) -> type:
    return choice.config


def loss_from_config(a: AlgorithmConfig) -> LossFn:
    """The loss an ``AlgorithmConfig`` names: ``objective`` with ``correction``'s weight.
    Raises ValueError naming the bad field."""
    objective = chosen(a.objective, objectives(), _config, "algorithm/objective", ValueError)
    correction = chosen(a.correction, corrections(), _config, "algorithm/correction", ValueError)
    if objective.own_correction and correction.name != "none":
        raise ValueError(
            f"algorithm.correction={correction.name!r} must be 'none' with "
            f"algorithm.objective={objective.name} (it corrects for the lag itself)"
        )
    return objective.loss(a.objective, a, correction.weight(a.correction))


def check_config(a: AlgorithmConfig) -> None:
    """The objective and correction an ``AlgorithmConfig`` names, built as the trainer
    will build them; raises :class:`ConfigError` in one line."""
    try:
        loss_from_config(a)
    except ValueError as e:
        raise ConfigError(str(e)) from None
