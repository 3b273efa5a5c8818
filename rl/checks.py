"""Every check of a config before anything starts, for the entry points (rl.train,
rl.world_size, rl.plan, rl.simulate).

rl.config checks the config's own fields (rl/config/validate.py) and knows nothing above
it; each layer that owns a part of the job checks that part: the model and the trainer's
layout on it (rl/models/checks.py), the task and the reward function
(rl/tasks/checks.py), the objective and its correction (rl/algorithms/registry.py), the DDMA
plan (rl/ddma/plan.py) and its transport (rl/ddma/transport.py). This module runs them
all. Each raises :class:`~rl.config.ConfigError` with one line.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from hydra.errors import HydraException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from rl import companion
from rl.algorithms import registry as algorithms
from rl.compose import compose
from rl.config import ConfigError, composition_error
from rl.config.prelaunch import prelaunch
from rl.config.roles import COMPANIONS
from rl.config.schema import RootConfig
from rl.config.validate import validate
from rl.ddma import plan, transport
from rl.models.checks import validate_model, validate_routing_replay, validate_trainer
from rl.tasks import checks as task_checks
from rl.tasks.checks import check_task
from rl.weights.hf_model import resolve_model

__all__ = ["PrelaunchCheck", "check", "check_job", "check_task", "compose_resolved",
           "resolve_model"]  # fmt: skip


def check(cfg: RootConfig, world_size: int | None = None) -> None:
    """Every check that reads no data: the model and its trainer first (the shape errors
    name the most), the config's other fields, then each other owner's.
    ``world_size``: the ranks a launcher started, checked against the role map.
    (:func:`check_task` then builds the task from its data.)"""
    validate_model(cfg.model)
    validate_trainer(cfg.trainer, cfg.model)
    if cfg.model.vision is not None:
        check_vision_job(cfg)
    validate_routing_replay(cfg.algorithm.routing_replay, cfg.trainer, cfg.model)
    validate(cfg, world_size)
    task_checks.check(cfg)
    companion.check(cfg)
    critic = bool(cfg.critic.enabled)
    algorithms.check_config(cfg.algorithm, cfg.rollout.sampling.max_new_tokens, critic)
    plan.check_config(cfg)
    transport.check(cfg)


def check_vision_job(cfg: RootConfig) -> None:
    """What a vision-language policy's job needs: no model executor (their forwards take no
    images), a frozen tower in RL (the servers' tower is not synced)."""
    m = cfg.model
    if m.train_vision and cfg.rl.steps > 0:
        raise ConfigError(
            "model.train_vision=true with rl.steps > 0: weight sync sends the decoder only, "
            "so the servers would sample with the tower as loaded (train the tower in a "
            "warm-up-only job, rl.steps=0, and start RL from its export)"
        )
    if m.max_pixels is not None and m.max_pixels < 1:
        raise ConfigError(f"model.max_pixels={m.max_pixels} must be >= 1 or null")
    for role in COMPANIONS:
        if getattr(cfg, role).enabled and cfg.rl.steps > 0:
            raise ConfigError(
                f"{role}.enabled=true with model.architecture={m.architecture}: the "
                f"{role}'s forward takes no images (a vision-language policy trains alone)"
            )


def compose_resolved(overrides: list[str]) -> RootConfig:
    """:func:`~rl.compose.compose` and :func:`resolve_model` (the architecture from
    model.hf_checkpoint's config.json) for a command-line tool: a bad override or model is
    a :class:`ConfigError` whose message is the one line to print."""
    try:
        cfg = compose(overrides)
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(composition_error(e)) from None
    try:
        resolve_model(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(str(e)) from None
    return cfg


def check_job(cfg: RootConfig, world_size: int | None = None) -> None:
    """All that rl.train checks before it writes a file or starts a rank: the architecture
    from model.hf_checkpoint's config.json (filled into ``cfg``), every value, the task's
    data (read and rendered: bad rows fail here) and the files and directories it names."""
    resolve_model(cfg)
    check(cfg, world_size)
    if cfg.model.vision is not None and not cfg.model.hf_checkpoint:
        raise ConfigError(
            f"model.architecture={cfg.model.architecture} needs model.hf_checkpoint: its "
            "image processor expands the prompts and makes the trainer's patches"
        )
    check_task(cfg)
    prelaunch(cfg)


class PrelaunchCheck(Callback):
    """:func:`check_job` as a Hydra callback (conf/config.yaml), which Hydra runs before it
    creates ``run.output_dir`` and its log there, then a restarted job's resume state (its
    checkpoints as ``trainer.load_dir``'s are checked): a config or a state that cannot work
    exits in one line and writes nothing. Under a launcher, each rank checks its world's
    size."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from rl.checkpoints import resume

        launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        try:
            check_job(config, int(os.environ["WORLD_SIZE"]) if launched else None)  # type: ignore[arg-type]
        except ConfigError as e:
            sys.exit(f"config error: {e}")
        except Exception as e:  # Hydra would only warn, and the job would start unchecked
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            sys.exit(f"config error: the checks before launch failed: {type(e).__name__}: {first}")
        out = config.run.output_dir
        try:  # a restarted job's state and the checkpoints it names
            if config.rl.steps > 0 and (point := resume.read(out, config.rl.resume)):
                resume.check(out, point)
        except resume.ResumeError as e:
            sys.exit(f"resume error: {e}")
