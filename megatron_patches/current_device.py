"""Patch: ``torch.cuda.current_device()`` returns the CPU device.

Why: Megatron-Core passes ``device=torch.cuda.current_device()`` at about 100 call sites
(rotary ``inv_freq``, ``GlobalMemoryBuffer``, p2p buffers, grad buffers). Without CUDA that
raises ``Torch not compiled with CUDA enabled``.
Replaces: ``torch.cuda.current_device`` (process-wide; only applied when the device is CPU).
Versions: megatron-core 0.16.1 (torch 2.13/2.14 CPU builds and CUDA builds without a GPU).
"""

from __future__ import annotations

import torch

from megatron_patches._util import once, replace_attr

NAME = "current_device"


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def apply() -> bool:
    return once(NAME, lambda: replace_attr(torch.cuda, "current_device", _cpu_current_device))
