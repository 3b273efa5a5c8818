"""Save and load a trainer's model, optimizer and schedule in ``torch_dist`` (any TP/PP on load).

The weights go through the shared format (rl/weights/dist_ckpt.py); this module adds the
training state: the optimizer's, stored by global parameter coordinates so that it too
reshards on load, the LR scheduler's and :class:`TrainState`. It takes those parts as
arguments and never sees the trainer that owns them.

A LoRA trainer that knows where its frozen base came from saves its adapters (and their
optimizer state) alone, naming the base by content (rl/config/lora_base.py); loading such
a checkpoint loads the base from there first.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from rl.config import lora_base
from rl.models import lora
from rl.weights.dist_ckpt import CheckpointError, model_config_dict, model_state, read_common, write
from rl.weights.dist_ckpt import load as load_state

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.transformer.module import MegatronModule

    from rl.config.schema import ModelConfig

_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
T = TypeVar("T")
KeyFilter = Callable[[str], bool]


@dataclass
class TrainState:
    """The trainer's own counters saved next to the optimizer state."""

    step: int = 0


class Loaded(NamedTuple):
    """What :func:`load` found: the saved train state (None: weights only) and, for a
    LoRA trainer, the checkpoint that holds its frozen base weights."""

    state: TrainState | None
    base: str | None


def _base_weights(key: str) -> bool:
    return not lora.is_adapter_key(key)


def _state(
    model: MegatronModule,
    model_cfg: ModelConfig | DictConfig,
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    state: TrainState | None,
    is_loading: bool,
    carried: dict[str, Any] | None = None,
    keep: KeyFilter | None = None,
) -> dict[str, Any]:
    """The sharded state to save or to load into; with ``state`` it includes the
    optimizer, the scheduler and the train state, otherwise it is weights only.
    ``carried``: common fields kept from the loaded checkpoint (dist_ckpt.HF_FIELDS);
    ``keep``: the model's keys it holds (None: all)."""
    sd = model_state(model, model_cfg, **(carried or {}))
    if keep is not None:
        sd["model"] = {k: v for k, v in sd["model"].items() if keep(k)}
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
    base: str | None = None,
    weights_only: bool = False,
) -> None:
    """Collective save of the model and, once a step was taken (and unless
    ``weights_only``), the training state, to a
    temporary sibling renamed into place once every rank has written (a kill mid-save
    leaves the previous checkpoint whole). ``keep_previous``: the replaced checkpoint
    stays at ``<path>.old`` until the resume state names the new one (RL checkpoints).
    ``base``: a LoRA model's frozen weights are in that checkpoint, so this one holds the
    adapters only and names it by content (rl/config/lora_base.py)."""
    from megatron_patches import cuda_to_cpu

    ref = None
    # Saved over the very checkpoint its base is in (a LoRA checkpoint that held its base,
    # resumed in place): that base is about to be replaced, so this one holds it again.
    if base is not None and lora.adapters_by_weight(model) and not _same(base, path):
        ref = _on_first_rank(lambda: lora_base.reference(base, path))
    # Before the first step Adam has no state to save: such a checkpoint is weights only.
    # The distributed optimizer gathers its state with .cuda() tensors: build it in scope.
    with cuda_to_cpu():
        saved = state if state.step > 0 and not weights_only else None
        keep = lora.is_adapter_key if ref else None
        sd = _state(model, model_cfg, optimizer, scheduler, saved, False, carried, keep)
    if ref:
        sd["lora"]["base"] = ref
    write(sd, path, keep_previous)


def _same(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _on_first_rank(fn: Callable[[], T]) -> T:
    """``fn()`` on rank 0 of the trainer's world (it reads a whole base checkpoint), its
    value or its one-line refusal on every rank."""
    box: list[Any] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            box = [(True, fn())]
        except lora_base.BaseError as e:
            box = [(False, str(e))]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    ok, value = box[0]
    if not ok:
        raise CheckpointError(value)
    return value


def _load_weights(
    path: str,
    model: MegatronModule,
    model_cfg: ModelConfig | DictConfig,
    optimizer: MegatronOptimizer | None,
    keep: KeyFilter | None,
) -> None:
    """The model's weights (those ``keep`` selects) from ``path``; the rest unchanged."""
    from megatron_patches import cuda_to_cpu

    with cuda_to_cpu():
        sd = _state(model, model_cfg, None, None, None, is_loading=True, keep=keep)
        missing, unexpected = model.load_state_dict(load_state(sd, path)["model"], strict=False)
        left = [*(k for k in missing if keep is None or keep(k)), *unexpected]
        if left:
            raise CheckpointError(f"checkpoint {path!r}: {left[0]} does not match the model")
        if optimizer is not None and hasattr(optimizer, "reload_model_params"):
            # Master copies (bf16 training, distributed optimizer) must follow the weights.
            optimizer.reload_model_params()


def load(
    path: str,
    model: MegatronModule,
    model_cfg: ModelConfig | DictConfig,
    optimizer: MegatronOptimizer | None,
    scheduler: OptimizerParamScheduler | None,
    load_optimizer: bool = True,
) -> Loaded:
    """Load the weights into ``model`` and, if asked and saved, the optimizer and scheduler
    state in place (the train state is returned then)."""
    from megatron_patches import cuda_to_cpu

    common = read_common(path, model_cfg)
    adapters = bool(lora.adapters_by_weight(model))
    saved = common.get("lora")
    if saved and not adapters:
        raise CheckpointError(
            f"checkpoint {path!r} holds LoRA adapters (rank {saved['rank']}): load "
            "it with trainer.lora.rank set, or export it merged (tools/convert_mcore_to_hf.py)"
        )
    keep: KeyFilter | None = None  # the keys this checkpoint gives the model
    base = path if adapters else None
    if adapters and not saved:
        # LoRA on a base checkpoint: the base's weights, the adapters as they start (B = 0),
        # and a fresh optimizer (only the adapters train).
        keep = _base_weights
    elif saved and saved.get("base"):  # adapters only: the base is where it names
        base = _on_first_rank(lambda: lora_base.resolve(saved["base"], path))
        read_common(base, model_cfg)
        _load_weights(base, model, model_cfg, None, _base_weights)
        keep = lora.is_adapter_key
    # A weights-only checkpoint (saved before any step) resumes with a fresh optimizer.
    if not (load_optimizer and common.get("has_optimizer")) or keep is _base_weights:
        _load_weights(path, model, model_cfg, optimizer, keep)
        return Loaded(None, base)
    assert optimizer is not None and scheduler is not None
    with cuda_to_cpu():
        _materialize_optimizer_state(optimizer)
        sd = _state(model, model_cfg, optimizer, scheduler, TrainState(), True, keep=keep)
        loaded = load_state(sd, path)
        model.load_state_dict(loaded["model"], strict=keep is None)
        optimizer.load_state_dict(loaded["optimizer"])
        scheduler.load_state_dict(loaded["scheduler"])
    return Loaded(TrainState(step=int(loaded["step"])), base)


def load_decoder(
    path: str,
    model: MegatronModule,
    model_cfg: ModelConfig | DictConfig,
    optimizer: MegatronOptimizer | None,
) -> None:
    """Every weight but the output layer's from ``path``, a checkpoint of the same decoder
    with the other head: a critic (scalar head) started from its policy (LM head), whose
    fresh head stays as initialised. Refused like :func:`load` for another decoder."""
    from omegaconf import OmegaConf

    from rl.models.arch import OUTPUT, causal_class

    policy = {**model_config_dict(model_cfg), "architecture": causal_class(model_cfg.architecture)}
    read_common(path, OmegaConf.create(policy))  # the same decoder, with the LM head
    _load_weights(path, model, model_cfg, optimizer, lambda key: key != OUTPUT)
