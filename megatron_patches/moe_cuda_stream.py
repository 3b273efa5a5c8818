"""Patch: the alltoall MoE token dispatcher gets a null device-to-host stream.

Why: ``MoEAlltoAllTokenDispatcher.__init__`` (``transformer/moe/token_dispatcher.py``)
creates one class-wide side stream for its non-blocking DtoH copies of the split sizes,
``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()``, which fails
without a CUDA driver. It only does so while the class attribute is None, so presetting
it is enough. On CPU there is nothing to copy or overlap: ``_maybe_dtoh_and_synchronize``
waits on the stream, enters ``torch.cuda.stream(...)``, records an event and later calls
``event.synchronize()``; the stand-in returns at once for each (its ``record_event``
returns a null event). ``torch.cuda.Stream`` itself is left alone.
Replaces: the class attribute ``MoEAlltoAllTokenDispatcher.cuda_dtoh_stream`` (None ->
a null stream).
Versions: megatron-core 0.16.1. Not covered: ``SharedExpertMLP`` also calls
``torch.cuda.Stream()``, but only with ``moe_shared_expert_overlap=True``.
"""

from __future__ import annotations

from megatron_patches._util import once, replace_attr
from megatron_patches.cuda_sync import _NullStream

NAME = "moe_cuda_stream"


class _NullDtoHStream(_NullStream):
    """A null stream whose recorded events are null too (``event.synchronize()`` works)."""

    def record_event(self, event: object = None) -> _NullStream:
        return _NullStream()


def apply() -> bool:
    def _do() -> None:
        from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

        if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
            replace_attr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _NullDtoHStream())

    return once(NAME, _do)
