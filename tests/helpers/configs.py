"""Composed configs for the in-process tests, without paying Hydra's ~0.2 s per call.

Each set of config-group choices (``experiment=...``, ``algorithm=grpo``) is composed by
Hydra once per session; value overrides (``trainer.tp=4``) are then applied to a copy the
way Hydra applies them after composing: parsed by Hydra's own override parser, in order,
with ``OmegaConf.update``. Anything else (deletions, additions, ``???``) is composed by
Hydra itself. Tests of composition itself (every file in conf/, Hydra's errors) call
:func:`rl.compose.compose` directly.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from functools import cache

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from omegaconf import DictConfig, OmegaConf

from rl.compose import compose, is_group
from rl.plan import ClusterPlan, plan_cluster


@cache
def _parser() -> OverridesParser:
    return OverridesParser.create()


@cache
def _groups_composed(groups: tuple[str, ...], config_name: str) -> DictConfig:
    return compose(list(groups), config_name)


def composed(overrides: Iterable[str] = (), config_name: str = "config") -> DictConfig:
    """The config ``compose(overrides, config_name)`` returns, as a fresh copy."""
    overrides = list(overrides)
    groups: list[str] = []
    values: list[tuple[str, object]] = []
    for text, o in zip(overrides, _parser().parse_overrides(overrides), strict=True):
        plain = o.type == OverrideType.CHANGE and o.package is None
        if not plain or text.endswith("=???"):
            return compose(overrides, config_name)
        if is_group(o.key_or_group):
            groups.append(text)
        else:
            values.append((o.key_or_group, o.value()))
    cfg = copy.deepcopy(_groups_composed(tuple(groups), config_name))
    for key, value in values:
        OmegaConf.update(cfg, key, value, merge=True)
    return cfg


@cache
def config_of(*overrides: str) -> DictConfig:
    """One shared config per set of overrides, for tests that only read it."""
    return composed(overrides)


@cache
def plan_of(*overrides: str) -> ClusterPlan:
    """The planner's verdict on ``config_of(*overrides)``, computed once per session (a
    1,024-GPU MoE preset's DDMA plan takes seconds)."""
    return plan_cluster(config_of(*overrides))
