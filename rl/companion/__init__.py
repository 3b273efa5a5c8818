"""The model executor: models an algorithm brings besides the policy (a critic, a reward
model, a teacher), each on ranks of its own (rl/config/roles.py:COMPANIONS), served by
service.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from rl.companion.settings import CompanionSettings
    from rl.config.schema import ModelConfig, RootConfig


def settings_of(cfg: RootConfig, role: str) -> CompanionSettings:
    """What the ranks of ``role`` are given of the job's config."""
    from rl.companion import critic, reward_model, teacher

    uses = {u.ROLE: u.settings for u in (critic, reward_model, teacher)}
    return uses[role](cfg)


def model_of(cfg: RootConfig, role: str) -> ModelConfig | DictConfig:
    """The model of ``role``, its head named by its architecture (the planner's input)."""
    from rl.companion import critic, reward_model, teacher

    uses = {u.ROLE: u.model for u in (critic, reward_model, teacher)}
    return uses[role](cfg)


TRAINED = ("critic",)  # the roles that train (the others are frozen)


def check(cfg: RootConfig) -> None:
    """Every model executor's checks before launch."""
    from rl.companion import critic, reward_model, teacher

    for use in (critic, reward_model, teacher):
        use.check(cfg)
