"""DDMA's Triton kernels (rl/ddma/checksum_triton.py, rl/ddma/fp8_triton.py,
rl/ddma/copy_triton.py), imported only when a CUDA buffer needs one.

Why lazily and guarded: importing Triton costs a second, and on a machine without a GPU
toolchain a kernel module may fail to import at all; the callers then take their torch
path, which gives the same bytes. Pure logic: no torch.distributed.
"""

from __future__ import annotations

import importlib
import os
from functools import cache
from types import ModuleType

import torch

# The kernels take host tensors too. Only under Triton's interpreter (TRITON_INTERPRET=1),
# where they run on the CPU: how the CPU tests run them against the torch path.
ON_HOST = False


@cache
def load(name: str) -> ModuleType | None:
    """``rl.ddma.<name>``, or None where it does not import (no Triton, or one that cannot
    find a GPU toolchain); imported once per process."""
    try:
        return importlib.import_module(f"rl.ddma.{name}")
    except Exception:
        return None


def for_tensor(name: str, t: torch.Tensor) -> ModuleType | None:
    """The kernel module ``name`` for work on ``t``'s device: on CUDA where it imports
    (and on the host under the interpreter, see :data:`ON_HOST`), else None."""
    if t.is_cuda or (ON_HOST and os.environ.get("TRITON_INTERPRET") == "1"):
        return load(name)
    return None
