"""Save and load the trainer in Megatron's ``torch_dist`` format (any TP/PP on load).

Model weights are stored as sharded tensors with their global shapes, so a checkpoint
written at TP=2/PP=2 loads at TP=1/PP=1 (or any other layout). The save goes to a sibling
temporary directory that rank 0 renames once every rank has written, so a crash never
leaves a half-written checkpoint under the final name.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from rl.trainer.trainer import MegatronTrainer

FORMAT_VERSION = 1
_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


class CheckpointError(ValueError):
    """A checkpoint path that is missing, incomplete or not a torch_dist checkpoint."""


def _state(tr: MegatronTrainer, with_optimizer: bool, is_loading: bool) -> dict:
    model_sd = tr.model.module.sharded_state_dict()
    sd: dict = {"model": model_sd}
    if with_optimizer:
        # "fully_reshardable": optimizer state stored by global parameter coordinates, so
        # it also loads under a different TP/PP/DP layout.
        sd["optimizer"] = tr.optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=_OPTIM_METADATA
        )
        sd["scheduler"] = tr.scheduler.state_dict()
        sd["step"] = tr.step
    sd["format_version"] = FORMAT_VERSION
    sd["has_optimizer"] = with_optimizer
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


def save(tr: MegatronTrainer, path: str) -> None:
    from megatron.core import dist_checkpointing

    from megatron_patches import cuda_to_cpu

    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    with cuda_to_cpu():
        # Before the first step Adam has no state to save: such a checkpoint is weights only.
        dist_checkpointing.save(_state(tr, tr.step > 0, is_loading=False), str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
    dist.barrier()


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
