"""Patch: make ``import flash_mla`` raise ImportError on CPU.

Why: SGLang depends on ``flash_mla``. On a machine without CUDA its import raises
*OSError* (its CUDA library cannot load), but Megatron-Core's
``transformer/attention.py`` only catches ImportError around ``from flash_mla import ...``,
so importing Megatron's attention dies in a venv that also holds SGLang.
Replaces: the ``sys.modules["flash_mla"]`` entry (set to None, which Python turns into
ImportError). Must run in every process before Megatron is imported.
Versions: megatron-core 0.16.1 with sglang 0.5.23 (flash_mla as shipped with it).
"""

from __future__ import annotations

import sys

from megatron_patches._util import once

NAME = "flash_mla_guard"


def apply() -> bool:
    def _do() -> None:
        if "megatron.core.transformer.attention" in sys.modules:
            raise RuntimeError(
                "megatron_patches.flash_mla_guard must be applied before Megatron-Core's "
                "attention is imported; call megatron_patches.apply_all('cpu') first"
            )
        mod = sys.modules.get("flash_mla")
        if mod is None:
            sys.modules["flash_mla"] = None  # type: ignore[assignment]

    return once(NAME, _do)
