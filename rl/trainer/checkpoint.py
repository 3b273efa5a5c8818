"""Save and load a trainer's model, optimizer and schedule in ``torch_dist`` (any TP/PP on load).

The weights go through the shared format (rl/weights/dist_ckpt.py); this module adds the
training state: the optimizer's, stored by global parameter coordinates so that it too
reshards on load, the LR scheduler's and :class:`TrainState`. It takes those parts as
arguments and never sees the trainer that owns them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from omegaconf import DictConfig

from rl.models import lora
from rl.weights.dist_ckpt import CheckpointError, model_state, read_common, write
from rl.weights.dist_ckpt import load as load_state

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import MegatronModule

    from rl.config.schema import ModelConfig

_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


@dataclass
class TrainState:
    """The trainer's own counters saved next to the optimizer state."""

    step: int = 0


def _state(
    model: MegatronModule,
    model_cfg: ModelConfig | DictConfig,
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    state: TrainState | None,
    is_loading: bool,
    carried: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The sharded state to save or to load into; with ``state`` it includes the
    optimizer, the scheduler and the train state, otherwise it is weights only.
    ``carried``: common fields kept from the loaded checkpoint (dist_ckpt.HF_FIELDS)."""
    sd = model_state(model, model_cfg, **(carried or {}))
    adapters = lora.adapters_by_weight(model)
    if adapters:  # LoRA: which checkpoints hold adapters, and at what rank and scale
        first = next(iter(adapters.values()))
        sd["lora"] = {"rank": int(first.lora_A.shape[0]), "scale": first.scale}
    if state is not None:
        assert optimizer is not None and scheduler is not None
        # "fully_reshardable": optimizer state stored by global parameter coordinates, so
        # it also loads under a different TP/PP/DP layout.
        sd["optimizer"] = optimizer.sharded_state_dict(
            sd["model"], is_loading=is_loading, metadata=_OPTIM_METADATA
        )
        sd["scheduler"] = scheduler.state_dict()
        sd["step"] = state.step
        sd["has_optimizer"] = True
    return sd


def _materialize_optimizer_state(optimizer: MegatronOptimizer) -> None:
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


def save(
    path: str,
    model: MegatronModule,
    model_cfg: ModelConfig | DictConfig,
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    state: TrainState,
    keep_previous: bool = False,
    carried: dict[str, Any] | None = None,
) -> None:
    """Collective save of the model and, once a step was taken, the training state, to a
    temporary sibling renamed into place once every rank has written (a kill mid-save
    leaves the previous checkpoint whole). ``keep_previous``: the replaced checkpoint
    stays at ``<path>.old`` until the resume state names the new one (RL checkpoints)."""
    from megatron_patches import cuda_to_cpu

    # Before the first step Adam has no state to save: such a checkpoint is weights only.
    # The distributed optimizer gathers its state with .cuda() tensors: build it in scope.
    with cuda_to_cpu():
        saved = state if state.step > 0 else None
        sd = _state(model, model_cfg, optimizer, scheduler, saved, False, carried)
    write(sd, path, keep_previous)


def load(
    path: str,
    model: MegatronModule,
    model_cfg: ModelConfig | DictConfig,
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    load_optimizer: bool = True,
) -> TrainState | None:
    """Load the weights into ``model`` and, if asked and saved, the optimizer and scheduler
    state in place; returns the saved train state then (None for weights only)."""
    from megatron_patches import cuda_to_cpu

    common = read_common(path, model_cfg)
    adapters = bool(lora.adapters_by_weight(model))
    if common.get("lora") and not adapters:
        raise CheckpointError(
            f"checkpoint {path!r} holds LoRA adapters (rank {common['lora']['rank']}): load "
            "it with trainer.lora.rank set, or export it merged (tools/convert_mcore_to_hf.py)"
        )
    # LoRA on a base checkpoint: the base's weights, the adapters as they start (B = 0),
    # and a fresh optimizer (only the adapters train).
    base_only = adapters and not common.get("lora")
    # A weights-only checkpoint (saved before any step) resumes with a fresh optimizer.
    if not (load_optimizer and common.get("has_optimizer")) or base_only:
        with cuda_to_cpu():
            sd = _state(model, model_cfg, None, None, None, is_loading=True)
            if base_only:
                sd["model"] = {k: v for k, v in sd["model"].items() if not lora.is_adapter_key(k)}
            missing, unexpected = model.load_state_dict(load_state(sd, path)["model"], strict=False)
            left = [
                k for k in [*missing, *unexpected] if not (base_only and lora.is_adapter_key(k))
            ]
            if left:
                raise CheckpointError(f"checkpoint {path!r}: {left[0]} does not match the model")
            if optimizer is not None and hasattr(optimizer, "reload_model_params"):
                # Master copies (bf16 training, distributed optimizer) must follow the weights.
                optimizer.reload_model_params()
        return None
    assert optimizer is not None and scheduler is not None
    with cuda_to_cpu():
        _materialize_optimizer_state(optimizer)
        sd = _state(model, model_cfg, optimizer, scheduler, TrainState(), is_loading=True)
        loaded = load_state(sd, path)
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["scheduler"])
    return TrainState(step=int(loaded["step"]))
