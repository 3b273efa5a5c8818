"""Patch: ``moe_utils.te_general_gemm`` exists (as None) without Transformer Engine.

Why: ``transformer/moe/moe_utils.py`` imports ``te_general_gemm`` only inside its
``try: import transformer_engine`` block, yet the router's ``RouterGatingLinearFunction``
tests ``te_general_gemm is not None`` on every forward and backward. Without TE the name
is undefined, so every MoE forward dies with ``NameError``. None is the value the code
already handles: it falls back to ``torch.mm``/``torch.addmm``.
Replaces: defines ``megatron.core.transformer.moe.moe_utils.te_general_gemm = None``, only
when the name is absent (with TE installed nothing changes).
Versions: megatron-core 0.16.1 without Transformer Engine.
"""

from __future__ import annotations

from megatron_patches._util import once

NAME = "moe_te_gemm"


def apply() -> bool:
    def _do() -> None:
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None

    return once(NAME, _do)
