"""Every check of a config before anything starts, for the entry points (rl.train,
rl.world_size, rl.plan): the config's own (rl/config/validate.py) and then those that
belong to a layer above it, today the DDMA transport's (rl/ddma/transport.py: the
transports are code, so the config layer cannot know them). Each raises
:class:`~rl.config.ConfigError` with one line."""

from __future__ import annotations

from rl.config import validate
from rl.config.schema import RootConfig
from rl.ddma import transport


def check(cfg: RootConfig, world_size: int | None = None) -> None:
    """``validate`` and the checks of the owners above the config layer."""
    validate(cfg, world_size)
    transport.check(cfg)
