"""Save and load the trainer in Megatron's ``torch_dist`` format (any TP/PP on load).

Model weights are stored as sharded tensors with their global shapes, so a checkpoint
written at TP=2/PP=2 loads at TP=1/PP=1 (or any other layout). The save goes to a sibling
temporary directory that rank 0 renames once every rank has written, so a crash never
leaves a half-written checkpoint under the final name.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

if TYPE_CHECKING:
    from rl.trainer.trainer import MegatronTrainer

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
_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


class CheckpointError(ValueError):
    """A checkpoint path that is missing, incomplete or not a torch_dist checkpoint."""


def model_config_dict(m: Any) -> dict:
    """The model config as plain data, stored in every checkpoint's common state."""
    if isinstance(m, DictConfig):
        return OmegaConf.to_container(m, resolve=True)  # type: ignore[return-value]
    return dataclasses.asdict(m)


def model_state(model: Any, model_cfg: Any, **common: Any) -> dict:
    """A weights-only checkpoint state: the sharded model plus the common metadata."""
    return {
        "model": model.sharded_state_dict(),
        "format_version": FORMAT_VERSION,
        "has_optimizer": False,
        "model_config": model_config_dict(model_cfg),
        **common,
    }


def _state(tr: MegatronTrainer, with_optimizer: bool, is_loading: bool) -> dict:
    sd = model_state(tr.model.module, tr.mcfg)
    if with_optimizer:
        # "fully_reshardable": optimizer state stored by global parameter coordinates, so
        # it also loads under a different TP/PP/DP layout.
        sd["optimizer"] = tr.optimizer.sharded_state_dict(
            sd["model"], is_loading=is_loading, metadata=_OPTIM_METADATA
        )
        sd["scheduler"] = tr.scheduler.state_dict()
        sd["step"] = tr.step
        sd["has_optimizer"] = True
    return sd


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


def _materialize_optimizer_state(optimizer) -> None:
    """Create Adam's state (zeros, step 1) without changing any weight.

    Why: without TE/apex, Megatron's DistributedOptimizer reads Adam's ``step`` while
    building the *load* template, and a fresh optimizer has no state yet. A step at lr=0
    with zero gradients creates it; the loaded values then overwrite it in place.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if any(len(st) for st in inner.state.values()):
            continue
        saved = [g["lr"] for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"] = 0.0
            for prm in g["params"]:
                prm.grad = torch.zeros_like(prm)
        inner.step()
        for g, lr in zip(inner.param_groups, saved, strict=True):
            g["lr"] = lr
            for prm in g["params"]:
                prm.grad = None


def write(state: dict, path: str) -> None:
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


def save(tr: MegatronTrainer, path: str) -> None:
    from megatron_patches import cuda_to_cpu

    # Before the first step Adam has no state to save: such a checkpoint is weights only.
    # The distributed optimizer gathers its state with .cuda() tensors: build it in scope.
    with cuda_to_cpu():
        state = _state(tr, tr.step > 0, is_loading=False)
    write(state, path)


def check_architecture(common: dict, model_cfg: Any, path: str) -> None:
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


def load(tr: MegatronTrainer, path: str, load_optimizer: bool = True) -> None:
    """Load weights (and, if asked, optimizer/scheduler state) into ``tr`` in place."""
    from megatron.core import dist_checkpointing

    from megatron_patches import cuda_to_cpu

    p = check(path)
    common = dist_checkpointing.load_common_state_dict(str(p))
    if common.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(p)!r} has format_version={common.get('format_version')!r}, "
            f"expected {FORMAT_VERSION}"
        )
    check_architecture(common, tr.mcfg, str(p))
    # A weights-only checkpoint (saved before any step) resumes with a fresh optimizer.
    load_optimizer = load_optimizer and bool(common.get("has_optimizer"))
    with cuda_to_cpu():
        if load_optimizer:
            _materialize_optimizer_state(tr.optimizer)
        loaded = dist_checkpointing.load(_state(tr, load_optimizer, is_loading=True), str(p))
        tr.model.module.load_state_dict(loaded["model"])
        if load_optimizer:
            tr.optimizer.load_state_dict(loaded["optimizer"])
            tr.scheduler.load_state_dict(loaded["scheduler"])
            tr.step = int(loaded["step"])
        elif hasattr(tr.optimizer, "reload_model_params"):
            # Master copies (bf16 training, distributed optimizer) must follow the weights.
            tr.optimizer.reload_model_params()
