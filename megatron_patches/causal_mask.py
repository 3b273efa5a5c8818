"""Patch: the default causal mask is built on the device of the caller, not "cuda".

Why: ``transformer/utils.py`` ``get_default_causal_mask`` hard-codes ``device="cuda"``;
it is used whenever ``attention_mask=None`` (the local spec's softmax path).
``fusions/fused_softmax.py`` imports it by name, so both references are replaced.
Replaces: ``megatron.core.transformer.utils.get_default_causal_mask`` and
``megatron.core.fusions.fused_softmax.get_default_causal_mask``.
Versions: megatron-core 0.16.1.
"""

from __future__ import annotations

import functools

import torch

from megatron_patches._util import once, replace_attr

NAME = "causal_mask"


@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    # Cached: the mask depends only on the length and is rebuilt for every layer otherwise.
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def apply() -> bool:
    def _do() -> None:
        from megatron.core.fusions import fused_softmax
        from megatron.core.transformer import utils

        replace_attr(utils, "get_default_causal_mask", _cpu_causal_mask)
        replace_attr(fused_softmax, "get_default_causal_mask", _cpu_causal_mask)

    return once(NAME, _do)
