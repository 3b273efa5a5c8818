"""What the critic executor is given of the job's config, and its checks before launch.

The critic is the policy's decoder with a scalar head (the family's
``*ForSequenceClassification``: rl/models/score_head.py), on a layout, batch, optimizer and
dtype of its own (``critic.trainer``). Its checkpoint sits beside the policy's, named after
it (:func:`checkpoint_of`), so one resume point names both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from rl.config.errors import ConfigError
from rl.models import registry

if TYPE_CHECKING:
    from rl.config.schema import AlgorithmConfig, CriticConfig, ModelConfig, RootConfig

INITS = ("policy",)


@dataclass(frozen=True, kw_only=True)
class CriticSettings:
    """The critic ranks' part of the config: its model (the policy's, with a scalar head),
    its own section, the algorithm (GAE's settings give its targets) and ``rl.steps`` and
    ``rl.deterministic``."""

    model: ModelConfig | DictConfig
    critic: CriticConfig
    algorithm: AlgorithmConfig
    steps: int
    deterministic: bool


def critic_model(m: ModelConfig | DictConfig) -> DictConfig:
    """The policy's model config with its family's scalar-head class."""
    arch = registry.get(str(m.architecture))
    fields = OmegaConf.to_container(OmegaConf.structured(m), resolve=True)
    assert isinstance(fields, dict)
    return OmegaConf.create({**fields, "architecture": arch.score_class})


def settings(cfg: RootConfig) -> CriticSettings:
    return CriticSettings(
        model=critic_model(cfg.model), critic=cfg.critic, algorithm=cfg.algorithm,
        steps=cfg.rl.steps, deterministic=cfg.rl.deterministic,
    )  # fmt: skip


def checkpoint_of(policy_checkpoint: str) -> str:
    """Where the critic's checkpoint goes beside the policy's ``policy_checkpoint``."""
    return policy_checkpoint.rstrip("/") + "_critic"


def check(cfg: RootConfig) -> None:
    """A configured critic's own fields and its layout on its model, in one line naming
    the ``critic.`` field."""
    from rl.models.checks import validate_trainer

    c = cfg.critic
    if not c.enabled:
        return
    if c.init not in INITS:
        raise ConfigError(
            f"critic.init={c.init!r} is not supported (supported: {', '.join(INITS)})"
        )
    if c.clip is not None and not c.clip > 0:
        raise ConfigError(f"critic.clip={c.clip} must be > 0 (or null: no clip)")
    t = c.trainer
    if t.lora.rank:
        raise ConfigError(f"critic.trainer.lora.rank={t.lora.rank}: a critic trains in full")
    if t.global_batch_size != cfg.trainer.global_batch_size:
        raise ConfigError(
            f"critic.trainer.global_batch_size={t.global_batch_size} must be the policy's "
            f"trainer.global_batch_size={cfg.trainer.global_batch_size}: the critic trains on "
            "each RL batch whole"
        )
    try:
        validate_trainer(t, critic_model(cfg.model))  # type: ignore[arg-type]
    except ConfigError as e:  # its messages name the policy's trainer.* fields
        raise ConfigError(str(e).replace("trainer.", "critic.trainer.")) from None
