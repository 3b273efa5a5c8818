"""DDMA's Triton kernels (rl/ddma/checksum_triton.py, rl/ddma/fp8_triton.py), imported only
when a CUDA buffer needs one.

Why lazily and guarded: importing Triton costs a second, and on a machine without a GPU
toolchain a kernel module may fail to import at all; the callers then take their torch
path, which gives the same bytes. Pure logic: no torch.distributed.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType


@cache
def load(name: str) -> ModuleType | None:
    """``rl.ddma.<name>``, or None where it does not import (no Triton, or one that cannot
    find a GPU toolchain); imported once per process."""
    try:
        return importlib.import_module(f"rl.ddma.{name}")
    except Exception:
        return None
