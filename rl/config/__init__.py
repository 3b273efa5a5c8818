"""Config schemas and validation of the config's own fields (see conf/ for the
YAML tree), and the typed forms of config sections that executors share: the role map
(``roles``), sampling parameters (``sampling``), SGLang's server limits (``sglang``) and
dtypes (``dtypes``).

A leaf: nothing here imports ``rl`` outside ``rl.config``, so any layer may use it. The
checks that need another layer's code (the model family, the task, the DDMA plan) are
that layer's; rl/checks.py runs them all (``rl.checks.check``). Composing a config needs
every layer's choices registered: rl/compose.py."""

from __future__ import annotations

from pathlib import Path

from rl.config.errors import ConfigError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"

__all__ = ["CONF_DIR", "ConfigError", "composition_error"]


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
