"""The critic (``critic=``): the policy's decoder with a scalar head, trained on each RL
batch beside the policy with the clipped value loss; its values are what GAE needs.

It runs on the model executor (rl/companion/service.py) with a layout, batch, optimizer and
dtype of its own (``critic.trainer``). Its checkpoint sits beside the policy's, named after
it (:func:`checkpoint_of`), so one resume point names both. The values of a batch come from
the critic trained on the batches before it: one version behind the batch, always.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from rl.algorithms.reuse import Reuse
from rl.companion.settings import (
    CompanionSettings,
    Training,
    check_hf_model,
    check_layout,
    hf_model,
    with_head,
)
from rl.config.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from omegaconf import DictConfig

    from rl.algorithms.losses import LossFn
    from rl.batch import TrainBatch
    from rl.config.schema import AlgorithmConfig, ModelConfig, RootConfig

ROLE = "critic"
INITS = ("policy", "hf")


def model(cfg: RootConfig) -> ModelConfig | DictConfig:
    """The policy's decoder with its family's scalar head, or the model at
    ``critic.hf_checkpoint`` (``critic.init=hf``: a reward model)."""
    if cfg.critic.init == "hf":
        return hf_model(cfg.critic.hf_checkpoint, ROLE)
    return with_head(cfg.model, "score")


def settings(cfg: RootConfig) -> CompanionSettings:
    c = cfg.critic
    return CompanionSettings(
        role=ROLE, model=model(cfg), trainer=c.trainer,
        steps=cfg.rl.steps, deterministic=cfg.rl.deterministic,
        training=Training(_Targets(cfg.algorithm, c.clip),
                          Reuse(c.epochs, c.minibatches, c.trainer.seed)),
    )  # fmt: skip


class _Targets:
    """A critic's step: GAE's returns from the batch's rewards and values (the estimator
    the policy's advantages come from: rl/algorithms/registry.py), and the value loss."""

    def __init__(self, algorithm: AlgorithmConfig, clip: float | None):
        self.algorithm, self.clip = algorithm, clip

    def __call__(self, batch: TrainBatch) -> tuple[TrainBatch, LossFn]:
        from rl.algorithms.registry import with_advantages
        from rl.algorithms.value_loss import clipped_value_loss

        return with_advantages(self.algorithm, batch)[0], clipped_value_loss(self.clip)


def with_values(batch: TrainBatch, values: torch.Tensor) -> TrainBatch:
    """``batch`` with the critic's values, 0 off the loss mask."""
    mask = batch.loss_mask
    return replace(batch, values=values * mask if mask is not None else values)


def checkpoint_of(policy_checkpoint: str) -> str:
    """Where the critic's checkpoint goes beside the policy's ``policy_checkpoint``."""
    return policy_checkpoint.rstrip("/") + "_critic"


def check(cfg: RootConfig) -> None:
    """A configured critic's own fields and its layout on its model, in one line naming
    the ``critic.`` field."""
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
    for name in ("epochs", "minibatches"):
        v = getattr(c, name)
        if not (isinstance(v, int) and v >= 1):
            raise ConfigError(f"critic.{name}={v!r} must be an integer >= 1")
    rows = cfg.rl.prompts_per_step * cfg.algorithm.group_size
    unit = t.dp if t.max_tokens_per_microbatch else t.micro_batch_size * t.dp
    if rows % (unit * c.minibatches):
        raise ConfigError(
            f"critic.minibatches={c.minibatches} does not cut the batch of {rows} rows into "
            f"minibatches of whole critic.trainer micro-batches ({unit} rows)"
        )
    if t.global_batch_size != cfg.trainer.global_batch_size:
        raise ConfigError(
            f"critic.trainer.global_batch_size={t.global_batch_size} must be the policy's "
            f"trainer.global_batch_size={cfg.trainer.global_batch_size}: the critic trains on "
            "each RL batch whole"
        )
    if c.init == "hf":
        needs = "a critic starts from a scalar head (*ForSequenceClassification, num_labels=1)"
        check_hf_model(cfg, model(cfg), ROLE, score=True, needs=needs, what="values")
    elif c.hf_checkpoint:
        raise ConfigError(
            f"critic.hf_checkpoint is set but critic.init={c.init}: set critic.init=hf to "
            "start from it"
        )
    check_layout("critic", t, model(cfg), "the critic's " if c.init == "hf" else "model.")
