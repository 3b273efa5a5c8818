"""LoRA on Megatron-Core's tensor-parallel linears (``trainer.lora``).

Each targeted linear ``y = x W^T`` becomes ``y = x W^T + s * (x A^T) B^T`` with ``W``
frozen and ``s = alpha / rank``. The adapters are sharded the way the weight is:

- a column-parallel linear (fused QKV, fused gate/up) holds ``W`` as ``[out/tp, in]``:
  ``A`` (``[rank, in]``) is whole on every TP rank and ``B`` (``[out/tp, rank]``) holds
  this rank's output rows. ``x A^T`` is the same on every rank, so its gradient is summed
  over TP on the way back (Megatron's copy-to-region), which makes ``A``'s gradient whole.
- a row-parallel linear (attention's output, the MLP's down) holds ``W`` as
  ``[out, in/tp]``: ``A`` (``[rank, in/tp]``) holds this rank's input columns and ``B``
  (``[out, rank]``) is whole. ``x A^T`` is a partial sum, all-reduced over TP (``rank``
  wide, far narrower than the output) before ``B``.

``B`` starts at zero, so the adapted model starts as the base. ``A`` is drawn whole from a
generator seeded by the trainer's seed, the layer and the target, then split: the same
adapters at any TP or PP. The merged weight ``W + s * B @ A`` has ``W``'s layout, shard
for shard, which is what DDMA sends (rl/ddma/megatron_source.py) and what checkpoints
export. Adapters are children of their linear, in its checkpoint entry with their own
sharding, so a checkpoint holds them and a resume restores them.

Not built: adapters on experts (MoE models take ``qkv`` and ``proj`` only), under sequence
parallelism (MoE with TP > 1), and on Transformer Engine's fused norm-linear modules.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.mapping import ShardedStateDict
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from torch.distributed import ProcessGroup

    from rl.config.schema import LoraConfig

# A tensor-parallel linear's output: (y, its bias when the linear returns it unapplied).
LinearOutput = tuple[torch.Tensor, torch.Tensor | None]
# Megatron's sharded_state_dict(prefix, sharded_offsets, metadata) of one module.
ShardedStateDictFn = Callable[
    [str, tuple[tuple[int, int, int], ...], dict[str, object] | None], "ShardedStateDict"
]

# target -> (the transformer layer's submodule, its linear, column-parallel)
MODULES = {
    "qkv": ("self_attention", "linear_qkv", True),
    "proj": ("self_attention", "linear_proj", False),
    "fc1": ("mlp", "linear_fc1", True),
    "fc2": ("mlp", "linear_fc2", False),
}


class LoraError(ValueError):
    """Adapters that cannot be placed on this model; one line naming the field."""


class Adapter(torch.nn.Module):
    """The low-rank update of one tensor-parallel linear (see the module docstring)."""

    def __init__(
        self, weight: torch.Tensor, column: bool, lora: LoraConfig, tp: int, *, tp_rank: int,
        tp_group: ProcessGroup | None, seed: int,
    ) -> None:  # fmt: skip
        super().__init__()
        out_local, in_local = weight.shape
        rank = int(lora.rank)
        self.column, self.scale, self.tp_group = column, float(lora.alpha) / rank, tp_group
        whole_in = in_local if column else in_local * tp
        g = torch.Generator().manual_seed(seed)
        a = torch.empty(rank, whole_in)
        bound = 1 / math.sqrt(whole_in)  # PEFT's kaiming_uniform_(a=sqrt(5)) bound
        a.uniform_(-bound, bound, generator=g)
        if not column:
            a = a.chunk(tp, dim=1)[tp_rank]
        dtype, device = weight.dtype, weight.device
        self.lora_A = torch.nn.Parameter(a.contiguous().to(device=device, dtype=dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(out_local, rank, dtype=dtype, device=device))
        self.dropout = torch.nn.Dropout(lora.dropout) if lora.dropout else torch.nn.Identity()
        # Megatron counts a parameter without these in the gradient norm on TP rank 0 only
        # (a copy on every rank): the sharded one must say it is sharded, and along what.
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        sharded, dim = (self.lora_B, 0) if column else (self.lora_A, 1)
        set_tensor_model_parallel_attributes(sharded, True, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``s * (x A^T) B^T``: this rank's share of the update of the linear's output."""
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        h = F.linear(self.dropout(x), self.lora_A)
        if self.column:
            h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        else:
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return F.linear(h, self.lora_B) * self.scale

    @torch.no_grad()
    def merged(self, weight: torch.Tensor) -> torch.Tensor:
        """``W + s * B @ A`` for this rank's shard ``weight`` of the base (a new tensor)."""
        return weight + (self.lora_B @ self.lora_A).mul_(self.scale).to(weight.dtype)


def _seed(seed: int, layer: int, target: str) -> int:
    digest = hashlib.sha256(f"lora/{seed}/{layer}/{target}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _hook(adapter: Adapter) -> Callable[..., LinearOutput]:
    def hook(
        module: torch.nn.Module,
        args: tuple[torch.Tensor, ...],
        kwargs: dict[str, torch.Tensor],
        output: LinearOutput,
    ) -> LinearOutput:
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + adapter(x), bias

    return hook


def _sharded_state_dict(
    linear: torch.nn.Module, original: ShardedStateDictFn, column: bool, swiglu: bool
) -> ShardedStateDictFn:
    """The linear's checkpoint entry with its adapter sharded as the weight is: Megatron's
    own treats every tensor but ``weight`` (and a column's ``bias``) as whole on each rank,
    which holds for a column's ``A`` and a row's ``B`` but not for the other. Under SwiGLU
    fc1's rows are [gate; up] per rank, and its ``B`` is split into the two as the weight
    is, so the checkpoint reshards to any TP."""

    def sharded_state_dict(
        prefix: str = "",
        sharded_offsets: tuple[tuple[int, int, int], ...] = (),
        metadata: dict[str, object] | None = None,
    ) -> ShardedStateDict:
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = original(prefix, sharded_offsets, metadata)
        meta = metadata or {}  # Megatron's model-level call always passes it
        name, axis = ("adapter.lora_B", 0) if column else ("adapter.lora_A", 1)
        key = f"{prefix}{name}"
        sharded = make_sharded_tensors_for_checkpoint(
            {name: getattr(linear.adapter, name.split(".")[1])}, prefix, {name: axis},
            sharded_offsets, tp_group=linear.tp_group, dp_cp_group=meta.get("dp_cp_group"),
        )[key]  # fmt: skip
        if swiglu:
            singleton = bool(meta.get("singleton_local_shards", False))
            sharded = apply_swiglu_sharded_factory(sharded, sharded_offsets, singleton)
        out[key] = sharded
        return out

    return sharded_state_dict


def layers(model: GPTModel) -> Iterator[TransformerLayer]:
    decoder = getattr(model, "decoder", None)
    yield from getattr(decoder, "layers", [])


def apply(model: GPTModel, lora: LoraConfig, tp: int, tp_rank: int, seed: int) -> int:
    """Freeze ``model`` and give every targeted linear of every local layer an adapter;
    returns the adapters' parameter count on this rank."""
    from rl.models.megatron_gpt import have_transformer_engine

    if have_transformer_engine():
        raise LoraError("trainer.lora needs Megatron's local layer spec: Transformer Engine "
                        "fuses the input norm into linear_qkv and linear_fc1")  # fmt: skip
    for p in model.parameters():
        p.requires_grad_(False)
    count = 0
    for layer in layers(model):
        for target in lora.targets:
            owner, name, column = MODULES[target]
            linear = getattr(getattr(layer, owner), name)
            linear.adapter = Adapter(
                linear.weight,
                column,
                lora,
                tp,
                tp_rank=tp_rank,
                tp_group=linear.tp_group,
                seed=_seed(seed, layer.layer_number, target),
            )
            linear.register_forward_hook(_hook(linear.adapter), with_kwargs=True)
            swiglu = target == "fc1" and linear.config.gated_linear_unit
            linear.sharded_state_dict = _sharded_state_dict(
                linear, linear.sharded_state_dict, column, swiglu
            )
            count += sum(p.numel() for p in linear.adapter.parameters())
    return count


def adapters_by_weight(model: torch.nn.Module) -> dict[int, Adapter]:
    """``id(base weight)`` -> its adapter: how DDMA finds what to merge into a shard."""
    out = {}
    for module in model.modules():
        adapter = getattr(module, "adapter", None)
        if isinstance(adapter, Adapter):
            out[id(module.weight)] = adapter
    return out


def is_adapter_key(key: str) -> bool:
    """A checkpoint key of an adapter tensor (a base checkpoint has none)."""
    return ".adapter.lora_" in key or key.startswith("adapter.lora_")
