"""Parameter counts of a model config: sums over its tensors (rl/models/arch.py).

The one formula the planner, validation and the conversion tools share. No torch, no
Megatron: tested in milliseconds.
"""

from __future__ import annotations

from rl.models.arch import Dims, ModelShape, kv_channels, padded_vocab_size
from rl.models.registry import count

__all__ = ["kv_channels", "layer_param_count", "padded_vocab_size", "param_count"]


def layer_param_count(m: ModelShape, tp: int = 1, ep: int = 1) -> int:
    """Parameters of one decoder layer (on one rank of TP ``tp`` and EP ``ep``)."""
    return count(Dims.of(m), tp, ep)


def param_count(m: ModelShape, padded: bool = False) -> int:
    """Total parameters: the HF count, or with ``padded`` the Megatron count (padding rows)."""
    d = Dims.of(m)
    if not padded:
        d = Dims(**{**d.__dict__, "padded_vocab": d.vocab})
    return count(d, per_layer=False) + d.layers * count(d)
