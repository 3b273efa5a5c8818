"""The RL algorithm's choices, by name: ``algorithm/objective=<name>`` is one module of
rl/algorithms/objectives/, ``algorithm/correction=<name>`` one of
rl/algorithms/corrections/ and ``algorithm/advantage=<name>`` one of
rl/algorithms/advantages/ (found by listing the packages: rl/plugins.py), each with its
own config dataclass, which :func:`store_schemas` makes Hydra's choices. Adding any is one
module and its tests. Composing any config imports every choice's module (the planner
too, which runs without torch), so a choice imports torch inside its functions."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from rl.algorithms.estimator import Estimator
from rl.algorithms.weights import Correction, WeightFn
from rl.config.errors import ConfigError
from rl.config.schema import ObjectiveConfig
from rl.plugins import chosen, discover

if TYPE_CHECKING:
    from rl.algorithms.aggregation import Aggregate
    from rl.algorithms.losses import LossFn
    from rl.batch import TrainBatch
    from rl.config.schema import AlgorithmConfig

Cfg = TypeVar("Cfg", bound=ObjectiveConfig)


class LossParts(NamedTuple):
    """What an objective's loss is built from besides its own config."""

    weight: WeightFn  # the correction's per-token weight
    agg: Aggregate  # the loss aggregation (rl/algorithms/aggregation.py)
    kl_coef: float  # the KL penalty's weight in the loss (0: none, or it is in the reward)


@dataclass(frozen=True)
class Objective(Generic[Cfg]):
    """``algorithm/objective=<name>``: its config (an :class:`ObjectiveConfig` subclass
    whose ``name`` default is the choice's name) and the loss, built from that config and
    the :class:`LossParts`. ``own_correction``: it corrects for the lag itself (PPO's
    clipped ratio), so it takes the ``none`` correction only. ``loss_agg``: its
    aggregation when neither ``algorithm.loss_agg`` nor the estimator names one."""

    config: type[Cfg]
    loss: Callable[[Cfg, LossParts], LossFn]
    own_correction: bool = False
    loss_agg: str | None = None

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


@cache
def estimators() -> dict[str, Estimator[Any]]:
    from rl.algorithms import advantages as package

    return discover(package, "ESTIMATOR", lambda e: e.name)


def store_schemas() -> None:
    """Every objective, correction and estimator as a choice of its Hydra group, typed by
    its config."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    for group, choices in (
        ("algorithm/objective", objectives()),
        ("algorithm/correction", corrections()),
        ("algorithm/advantage", estimators()),
    ):
        for c in choices.values():
            cs.store(group=group, name=c.name, node=c.config)


def _config(choice: Objective[Any] | Correction[Any] | Estimator[Any]) -> type:
    return choice.config


def estimator(a: AlgorithmConfig) -> Estimator[Any]:
    """The advantage estimator an ``AlgorithmConfig`` names (ValueError naming the field)."""
    return chosen(a.advantage, estimators(), _config, "algorithm/advantage", ValueError)


def loss_agg(a: AlgorithmConfig) -> str:
    """The loss aggregation in force: ``algorithm.loss_agg``, else the estimator's, else
    the objective's, else token_mean."""
    objective = chosen(a.objective, objectives(), _config, "algorithm/objective", ValueError)
    return a.loss_agg or estimator(a).loss_agg or objective.loss_agg or "token_mean"


def loss_from_config(a: AlgorithmConfig, max_response_tokens: int = 0) -> LossFn:
    """The loss an ``AlgorithmConfig`` names: ``objective`` with ``correction``'s weight,
    aggregated by :func:`loss_agg` (``max_response_tokens``: the constant of
    seq_mean_token_sum_norm, ``rollout.sampling.max_new_tokens``). Raises ValueError
    naming the bad field."""
    from rl.algorithms.aggregation import aggregator

    objective = chosen(a.objective, objectives(), _config, "algorithm/objective", ValueError)
    correction = chosen(a.correction, corrections(), _config, "algorithm/correction", ValueError)
    if objective.own_correction and correction.name != "none":
        raise ValueError(
            f"algorithm.correction={correction.name!r} must be 'none' with "
            f"algorithm.objective={objective.name} (it corrects for the lag itself)"
        )
    kl = 0.0 if estimator(a).kl_in_reward else a.kl_coef
    agg = aggregator(loss_agg(a), max_response_tokens)
    return objective.loss(a.objective, LossParts(correction.weight(a.correction), agg, kl))


def with_advantages(a: AlgorithmConfig, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
    """``batch`` with the advantages of the estimator ``a`` names (and a critic's returns,
    from an estimator that gives them), and the step's figures: the
    estimator's own and the advantages' mean, std and zero fraction over the loss-mask tokens,
    each as ``adv_<name>``."""
    from rl.algorithms.estimator import summary

    batch.require("loss_mask")
    assert batch.loss_mask is not None
    e = estimator(a)
    adv, stats, returns = e.estimate(a.advantage, a, batch)
    if a.distill_coef:
        from rl.algorithms.distill import distill_advantages

        adv, kl = distill_advantages(adv, batch, a.distill_coef, a.distill_only)
        stats = {**stats, **kl}
    figures = {**stats, **summary(adv, batch.loss_mask)}
    batch = replace(batch, advantages=adv, returns=returns)
    return batch, {f"adv_{k}": v for k, v in figures.items()}


def check_config(a: AlgorithmConfig, max_response_tokens: int, critic: bool = False) -> None:
    """The objective, correction, estimator and aggregation an ``AlgorithmConfig`` names,
    built as the trainer will build them, and what the estimator needs against what the
    run provides (``critic``: a value per token); raises :class:`ConfigError` in one
    line."""
    try:
        loss_from_config(a, max_response_tokens)
        e = estimator(a)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    chosen_as = f"algorithm/advantage={e.name}"
    groups = f"groups of >= 2 samples: algorithm.group_size={a.group_size}"
    provided = {
        "groups": (a.group_size >= 2, groups),
        "values": (critic, "a critic's value for every token, and this run has no critic"),
        "ref_logprobs": (a.kl_coef > 0, "the reference's log-probs: set algorithm.kl_coef > 0"),
    }  # fmt: skip
    for need in sorted(e.needs):
        ok, what = provided[need]
        if not ok:
            raise ConfigError(f"{chosen_as} needs {what}")
    if critic and "values" not in e.needs:
        raise ConfigError(
            f"critic.enabled=true but {chosen_as} uses no critic: the critic learns the "
            "returns of an estimator that uses its values (algorithm/advantage=gae)"
        )
