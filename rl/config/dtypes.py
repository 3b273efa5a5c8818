"""The one map between dtype names (config fields, checkpoint headers, wire specs) and torch.

Config names are torch's own (``float32``, ``bfloat16``); safetensors headers use their
short codes. torch is imported only when a torch dtype is asked for, so config validation
stays torch-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# What the trainer (``trainer.params_dtype``) and the servers (``rollout.dtype``) accept.
PARAM_DTYPES = ("float32", "bfloat16")
# Every name a tensor may carry between our processes (float16 for HF checkpoints).
NAMES = ("float32", "bfloat16", "float16", "float64")
# safetensors header code -> name
SAFETENSORS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
# Bytes per element, for arithmetic (the planner, DDMA plans) that must not import torch.
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def itemsize(name: str) -> int:
    """Bytes per element of dtype ``name``; one line naming the value if it is unknown."""
    if name not in ITEMSIZE:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(NAMES)}")
    return ITEMSIZE[name]


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; one line naming the value if it is unknown."""
    import torch

    if name not in NAMES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(NAMES)}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the inverse of :func:`torch_dtype`)."""
    name = str(dtype).removeprefix("torch.")
    if name not in NAMES:
        raise ValueError(f"dtype {dtype} is not one of {', '.join(NAMES)}")
    return name
