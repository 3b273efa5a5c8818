"""Megatron's ``torch_dist`` checkpoint format: what every writer and reader shares.

Model weights are stored as sharded tensors with their global shapes, so a checkpoint
written at TP=2/PP=2 loads at TP=1/PP=1 (or any other layout). Next to the tensors, the
common state carries a format version and the model config, which a reader checks against
the model it builds. The trainer (rl/trainer/checkpoint.py, which adds optimizer state) and
the converters (rl/weights/convert.py) both write through :func:`write`: a sibling
temporary directory that rank 0 renames once every rank has written, so a crash never
leaves a half-written checkpoint under the final name.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule

    from rl.config.schema import ModelConfig

FORMAT_VERSION = 1
# Fields that must agree between a checkpoint and the model loading it.
ARCH_FIELDS = (
    "architecture",
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "vocab_size",
    "make_vocab_size_divisible_by",
    "qkv_bias",
    "qk_norm",
    "head_dim",
    "tie_embeddings",
    "num_experts",
    "moe_ffn_hidden_size",
    "shared_expert_ffn_hidden_size",
    "shared_expert_gate",
)
# What a field absent from an older checkpoint meant (a Llama-family dense model).
_ARCH_DEFAULTS = {
    "architecture": "LlamaForCausalLM",
    "qk_norm": False,
    "head_dim": None,
    "num_experts": 0,
    "moe_ffn_hidden_size": None,
    "shared_expert_ffn_hidden_size": 0,
    "shared_expert_gate": False,
}


class CheckpointError(ValueError):
    """A checkpoint path that is missing, incomplete or not a torch_dist checkpoint."""


def model_config_dict(m: ModelConfig | DictConfig) -> dict[str, Any]:
    """The model config as plain data, stored in every checkpoint's common state."""
    if isinstance(m, DictConfig):
        return OmegaConf.to_container(m, resolve=True)  # type: ignore[return-value]
    return dataclasses.asdict(m)


def model_state(
    model: MegatronModule,
    model_cfg: ModelConfig | DictConfig,
    **common: Any,  # JSON-like metadata
) -> dict[str, Any]:
    """A weights-only checkpoint state: the sharded model plus the common metadata."""
    return {
        "model": model.sharded_state_dict(),
        "format_version": FORMAT_VERSION,
        "has_optimizer": False,
        "model_config": model_config_dict(model_cfg),
        **common,
    }


def check(path: str | os.PathLike) -> Path:
    """Raise CheckpointError unless ``path`` holds a complete torch_dist checkpoint."""
    from megatron.core import dist_checkpointing

    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist or is not a directory")
    if not dist_checkpointing.check_is_distributed_checkpoint(str(p)):
        raise CheckpointError(
            f"checkpoint {str(p)!r} is not a Megatron torch_dist checkpoint "
            "(no metadata.json): incomplete or wrong format"
        )
    return p


def write(state: dict[str, Any], path: str) -> None:
    """Collective save of ``state`` to ``path``, atomically (temp dir, then rename)."""
    from megatron.core import dist_checkpointing

    from megatron_patches import cuda_to_cpu

    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    with cuda_to_cpu():
        dist_checkpointing.save(state, str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        # Renames only: deleting the previous checkpoint file by file before the new one
        # is in place left a requeued job (SIGTERM mid-save) with neither.
        prev = final.with_name(final.name + ".old")
        shutil.rmtree(prev, ignore_errors=True)
        if final.exists():
            os.replace(final, prev)
        os.replace(tmp, final)
        shutil.rmtree(prev, ignore_errors=True)
    dist.barrier()


def check_architecture(
    common: dict[str, Any], model_cfg: ModelConfig | DictConfig, path: str
) -> None:
    """Refuse a checkpoint whose stored model shape differs from the model being built."""
    stored = common.get("model_config")
    if stored is None:
        return
    mine = model_config_dict(model_cfg)
    diffs = [
        f"{k}: checkpoint {stored.get(k, _ARCH_DEFAULTS.get(k))!r} vs config {mine.get(k)!r}"
        for k in ARCH_FIELDS
        if stored.get(k, _ARCH_DEFAULTS.get(k)) != mine.get(k)
    ]
    if diffs:
        raise CheckpointError(f"checkpoint {path!r} is for a different model: " + "; ".join(diffs))


def read_common(path: str | os.PathLike, model_cfg: ModelConfig | DictConfig) -> dict[str, Any]:
    """The common (non-tensor) state of the checkpoint at ``path``, after checking that it
    is complete, of this format version and for ``model_cfg``'s architecture."""
    from megatron.core import dist_checkpointing

    p = check(path)
    common = dist_checkpointing.load_common_state_dict(str(p))
    if common.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(p)!r} has format_version={common.get('format_version')!r}, "
            f"expected {FORMAT_VERSION}"
        )
    check_architecture(common, model_cfg, str(p))
    return common
