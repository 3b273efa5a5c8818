"""Patch: the local spec's torch norms accept sequence parallelism, as Megatron's own do.

Why: Megatron-Core refuses to *train* an MoE layer with tensor parallelism but without
sequence parallelism (``moe_layer.py``: "performance may degrade..."), and the local
(non-Transformer-Engine) spec's ``WrappedTorchNorm`` asserts ``not sequence_parallel``, so
on CPU an MoE model could not train at TP > 1 at all. A norm needs nothing under sequence
parallelism but its weight marked ``sequence_parallel``: each TP rank then holds the
gradient of its own part of the sequence, and ``finalize_model_grads`` sums marked
parameters' gradients over the TP group, which is what TE's and Apex's norms do.
Replaces: ``megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__``: with
``config.sequence_parallel`` it builds the same torch norm and marks its parameters;
otherwise it calls the original.
Versions: megatron-core 0.16.1 (local spec, without Transformer Engine).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from megatron_patches._util import once, replace_attr

if TYPE_CHECKING:
    from megatron.core.transformer import TransformerConfig

NAME = "torch_norm_sp"


def apply() -> bool:
    def _do() -> None:
        from megatron.core.transformer import torch_norm

        cls = torch_norm.WrappedTorchNorm
        original = cls.__new__

        def __new__(
            wrapped: type, config: TransformerConfig, *args: object, **kwargs: object
        ) -> torch.nn.Module:
            if not config.sequence_parallel:
                return original(wrapped, config, *args, **kwargs)
            plain = copy.copy(config)  # not dataclasses.replace: no second __post_init__
            plain.sequence_parallel = False
            norm = original(wrapped, plain, *args, **kwargs)
            for p in norm.parameters():
                p.sequence_parallel = True
            return norm

        replace_attr(cls, "__new__", staticmethod(__new__))

    return once(NAME, _do)
