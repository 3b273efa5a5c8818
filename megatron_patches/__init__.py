"""CPU/gloo patches that let Megatron-Core 0.16.1 train on a machine without CUDA.

One module per patch; each has a header saying why, what it replaces and for which
versions, and an idempotent ``apply()``. Nothing is patched at import time: call
:func:`apply_all` once per process (every spawned rank too), before Megatron is imported.
On a CUDA device it does nothing, so the same code path runs unchanged on GPU clusters.
"""

from __future__ import annotations

from megatron_patches import (
    causal_mask,
    cuda_sync,
    current_device,
    device_mode,
    flash_mla_guard,
    moe_cuda_stream,
    moe_split_sizes,
    moe_te_gemm,
    optional_imports,
    psutil_check,
    rng_tracker,
    torch_adam_state,
    torch_norm_sp,
    uneven_gather,
)
from megatron_patches._util import applied
from megatron_patches.device_mode import cuda_to_cpu

# Order matters: the flash_mla guard and the optional-import guard must precede any
# Megatron import, and the MoE stream stand-in relies on cuda_sync's null
# ``torch.cuda.current_stream``.
PATCHES = (
    flash_mla_guard,
    optional_imports,
    psutil_check,
    current_device,
    cuda_sync,
    device_mode,
    rng_tracker,
    causal_mask,
    torch_adam_state,
    torch_norm_sp,
    moe_te_gemm,
    moe_cuda_stream,
    moe_split_sizes,
    uneven_gather,
)

__all__ = ["PATCHES", "applied", "apply_all", "cuda_to_cpu"]


def apply_all(device: str) -> list[str]:
    """Apply every patch for ``device`` ("cpu" or "cuda"); return the names newly applied."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":
        return []
    return [p.NAME for p in PATCHES if p.apply()]
