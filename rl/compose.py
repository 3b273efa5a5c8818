"""Every schema registered in Hydra's ConfigStore, and the composition of a config from
conf/ the way the command line composes it.

rl.config holds the root schema and the base of each choice; the choices themselves (each
task, objective and correction, with its own fields) are registered by the layers that own
them, which is why composing starts here and not in rl.config."""

from __future__ import annotations

from typing import cast

from rl.algorithms import registry as algorithms
from rl.config import CONF_DIR
from rl.config import schema as root
from rl.config.schema import RootConfig

__all__ = ["compose", "is_group", "register"]


def register() -> None:
    """The root schema once, and every choice of each registry (again each call, so a
    choice added to a registry since is a choice of its group too)."""
    from rl import tasks

    root.register()
    tasks.store_schemas()
    algorithms.store_schemas()


def is_group(key: str) -> bool:
    """A config group (``task``, ``algorithm/correction``): a folder of conf/, or one
    whose choices are registered schemas."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.object_type import ObjectType

    register()
    return (CONF_DIR / key).is_dir() or ConfigStore.instance().get_type(key) == ObjectType.GROUP


def _choice_as_value(overrides: list[str]) -> str | None:
    """One line for an override that sets a nested group as a value
    (``algorithm.correction=tis``, which Hydra reports as a type error), else None."""
    for text in overrides:
        key, sep, value = text.partition("=")
        group = key.replace(".", "/")
        if sep and "." in key and key[0] not in "+~" and is_group(group):
            return (
                f"{text}: {key} is a choice of the config group {group}, with its own fields: "
                f"pick it with {group}={value}"
            )
    return None


def compose(overrides: list[str] | None = None, config_name: str = "config") -> RootConfig:
    """Compose a config from conf/ the way the command line does (for tests and tools):
    a DictConfig with RootConfig's fields, typed as the schema (Hydra's structured config)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import ConfigCompositionException

    register()
    overrides = list(overrides or [])
    if (wrong := _choice_as_value(overrides)) is not None:
        raise ConfigCompositionException(wrong)
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=overrides)
    return cast(RootConfig, cfg)
