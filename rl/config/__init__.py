"""Config schemas, composition and validation of the config's own fields (see conf/ for the
YAML tree), and the typed forms of config sections that executors share: the role map
(``roles``), sampling parameters (``sampling``), SGLang's server limits (``sglang``) and
dtypes (``dtypes``).

A leaf: nothing here imports ``rl`` outside ``rl.config``, so any layer may use it. The
checks that need another layer's code (the model family, the task, the DDMA plan) are
that layer's; rl/checks.py runs them all (``rl.checks.check``)."""

from __future__ import annotations

from pathlib import Path
from typing import cast

from rl.config.errors import ConfigError
from rl.config.schema import RootConfig, register

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

__all__ = [
    "CONF_DIR",
    "ConfigError",
    "compose",
    "composition_error",
    "register",
]


def compose(overrides: list[str] | None = None, config_name: str = "config") -> RootConfig:
    """Compose a config from conf/ the way the command line does (for tests and tools):
    a DictConfig with RootConfig's fields, typed as the schema (Hydra's structured config)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=list(overrides or []))
    return cast(RootConfig, cfg)


def composition_error(e: BaseException) -> str:
    """Hydra's error and its causes, on one line (what the CLIs print for a bad override)."""
    parts: list[str] = []
    err: BaseException | None = e
    while err is not None:
        text = " ".join(str(err).split())
        if text and text not in parts:
            parts.append(text)
        err = err.__cause__
    return " | ".join(parts)
