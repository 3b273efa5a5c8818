"""Routed experts (``--enable-return-routed-experts``, routing replay) on SGLang's CPU
servers (imported at start-up in every process of a CPU server, by the ``sitecustomize``
that rl/serving/cpu_shim.py writes).

Why: with the flag, SGLang's model runner keeps every KV slot's routed experts in a host
buffer (``state_capturer/base.py``: ``BaseHostCache``), allocated by
``ALLOC_MEMORY_FUNCS[device]``. A device without an entry of its own, ``cpu`` among them,
gets ``alloc_with_host_register``, which pins the buffer with CUDA's host-register call
(``torch.cuda.cudart().cudaHostRegister``), and a CPU server has no CUDA: a tiny
Qwen3-MoE started by rl/serving/launcher.py with the flag died while its scheduler
started ("Cannot re-initialize CUDA in forked subprocess"). Pinning only speeds up copies
between host and GPU; on a CPU server the "device" buffer the captures go through is
host memory already, so a plain tensor is all the host buffer needs.

What it replaces, once ``sglang.srt.state_capturer.base`` is imported: that module's own
name ``ALLOC_MEMORY_FUNCS`` (the table it shares with the HiCache host pools, which keep
it) with a table whose ``cpu`` entry is a plain zeroed tensor, as the original's was after
its ``zero_()``; and its ``_cuda_host_unregister``, which ``BaseHostCache.destroy`` calls
wherever CUDA is available, with one that does nothing, since nothing was registered.
Versions: sglang 0.5.23. Without SGLang, or if those names are gone, it does nothing and
says so in the server's log.

Standard library only at import time: it runs before anything else in the process.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING

from rl.serving.after_import import patch_on_import

if TYPE_CHECKING:
    import torch

BASE = "sglang.srt.state_capturer.base"
Alloc = Callable[..., "torch.Tensor"]


def plain_host_tensor(
    dims: tuple[int, ...], dtype: torch.dtype, device: str, pin_memory: bool, allocator: object,
    registration_granularity_bytes: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """``alloc_with_host_register``'s signature, a plain zeroed CPU tensor: not pinned,
    not registered with CUDA, no allocator of SGLang's."""
    import torch

    return torch.zeros(dims, dtype=dtype, device="cpu")


class HostTable(dict[str, Alloc]):
    """The shared allocation table with a plain ``cpu`` entry; every other device as
    before (the shared table's default included)."""

    msrl_plain = True

    def __init__(self, shared: Mapping[str, Alloc]) -> None:
        super().__init__(shared)
        self.shared = shared
        self["cpu"] = plain_host_tensor

    def __missing__(self, device: str) -> Alloc:
        return self.shared[device]


def _nothing_registered(buffer: torch.Tensor) -> None:
    """A host buffer of :func:`plain_host_tensor` was never registered with CUDA."""


def patch_base(module: ModuleType) -> None:
    """Plain host buffers for the capturers of ``module`` (idempotent)."""
    table = getattr(module, "ALLOC_MEMORY_FUNCS", None)
    if table is None or not hasattr(module, "_cuda_host_unregister"):
        print(f"[cpu_routed_experts] {BASE}.ALLOC_MEMORY_FUNCS or _cuda_host_unregister is "
              "gone: not patched; --enable-return-routed-experts may fail on CPU",
              file=sys.stderr)  # fmt: skip
        return
    if not getattr(table, "msrl_plain", False):
        vars(module)["ALLOC_MEMORY_FUNCS"] = HostTable(table)
    vars(module)["_cuda_host_unregister"] = _nothing_registered


def install() -> None:
    """Patch SGLang's state capturers as their module is imported (idempotent)."""
    patch_on_import({BASE: patch_base})
