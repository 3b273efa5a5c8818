"""Patch: ``torch.cuda.synchronize`` and ``torch.cuda.current_stream`` become no-ops.

Why: ``dist_checkpointing`` (``strategies/filesystem_async.py``) calls
``torch.cuda.synchronize()`` on save, and DDP's grad sync
(``distributed/param_and_grad_buffer.py``) calls
``torch.cuda.current_stream().wait_event(...)``. On CPU every op is synchronous, so
waiting is correctly a no-op.
Replaces: ``torch.cuda.synchronize``, ``torch.cuda.current_stream``.
Versions: megatron-core 0.16.1.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_patches._util import once, replace_attr

NAME = "cuda_sync"


class _NullStream:
    """Stands in for a CUDA stream: every wait/record/sync returns immediately."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def _synchronize(device: Any = None) -> None:
    return None


def _current_stream(device: Any = None) -> _NullStream:
    return _NullStream()


def apply() -> bool:
    def _do() -> None:
        replace_attr(torch.cuda, "synchronize", _synchronize)
        replace_attr(torch.cuda, "current_stream", _current_stream)

    return once(NAME, _do)
