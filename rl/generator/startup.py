"""The generator's part of the job's config, and the directory its servers start from.

The one module of the generator that reads the whole job's config (``RootConfig``): the
servers of a policy with no HF checkpoint start from a directory written from the model
config with the task's token ids, so that needs the task. The entry point (rl/train.py)
calls :func:`settings` and binds :func:`model_path` to the config for the generator's
ranks (rl/generator/service.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rl.generator.settings import GeneratorSettings

if TYPE_CHECKING:
    from rl.config.schema import RootConfig


def settings(cfg: RootConfig) -> GeneratorSettings:
    """The generator's part of ``cfg``."""
    return GeneratorSettings(
        rollout=cfg.rollout, output_dir=cfg.run.output_dir,
        multi_node=cfg.cluster.nodes > 1, deterministic=cfg.rl.deterministic,
        routing_replay=cfg.algorithm.routing_replay,
    )  # fmt: skip


def model_path(cfg: RootConfig, out: Path) -> str:
    """The HF directory the servers start from: ``rollout.model_path``, else the policy's
    ``model.hf_checkpoint``, else a directory written under ``out`` from the model config
    with the task's token ids (the trainer pushes its weights before the first rollout)."""
    if cfg.rollout.model_path or cfg.model.hf_checkpoint:
        return str(cfg.rollout.model_path or cfg.model.hf_checkpoint)
    from rl.tasks import build_task
    from rl.weights.convert import init_hf_dir

    codec = build_task(cfg).codec
    ids = {"eos_token_id": codec.eos_ids[0], "pad_token_id": codec.pad_id}
    return str(init_hf_dir(cfg.model, str(out / "hf_init"), ids, cfg.rollout.dtype))
