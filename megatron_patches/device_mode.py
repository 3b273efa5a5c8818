"""Patch: a scoped TorchFunctionMode that maps ``device="cuda"`` to the CPU.

Why: the pipeline schedules (``torch.zeros([], dtype=torch.int, device="cuda")``), the
Megatron optimizer (FP32Optimizer, clip_grads and the grad scaler create tensors with
``device='cuda'``) and DistributedOptimizer's dtype check
(``param.type() == 'torch.cuda.FloatTensor'``) assume CUDA. Rewriting those call sites
would fork Megatron; instead, inside :func:`cuda_to_cpu`, every torch call that names a
CUDA device gets the CPU, ``Tensor.cuda()`` returns the tensor itself, and
``Tensor.type()`` reports the CUDA type name that those checks expect.
The mode is entered only around the schedule and optimizer calls: entering it for the
whole process was measured to make a TP=2 step about 1.6x slower.
Replaces: nothing globally; :func:`cuda_to_cpu` is a context manager (a no-op off CPU).
Versions: megatron-core 0.16.1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_patches._util import once

NAME = "device_mode"
_ENABLED = False
_CPU = torch.device("cpu")


def _is_cuda(dev: Any) -> bool:
    if isinstance(dev, torch.device):
        return dev.type == "cuda"
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return False


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if args[0].device.type == "cpu" and name.startswith("torch."):
                return "torch.cuda." + name[len("torch.") :]
            return name
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and args and any(_is_cuda(a) for a in args[1:]):
            args = tuple(_CPU if _is_cuda(a) else a for a in args)
        return func(*args, **kwargs)


def apply() -> bool:
    def _do() -> None:
        global _ENABLED
        _ENABLED = True

    return once(NAME, _do)


@contextlib.contextmanager
def cuda_to_cpu() -> Iterator[None]:
    """Run the body with CUDA device requests redirected to the CPU (only once applied)."""
    if not _ENABLED:
        yield
        return
    with _CudaToCpu():
        yield
