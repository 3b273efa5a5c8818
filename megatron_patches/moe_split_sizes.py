"""Patch: the alltoall dispatcher's split sizes reach ``all_to_all_single`` as numpy.

Why: ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` moves ``input_splits``,
``output_splits`` and ``output_splits_tp`` to the host with
``maybe_move_tensor_to_cpu(t, as_numpy=True)``; on GPU that returns numpy arrays, which
``tensor_parallel.all_to_all`` hands to ``torch.distributed.all_to_all_single`` (and
``output_splits_tp.tolist()`` with TP > 1). ``maybe_move_tensor_to_cpu`` only acts on
CUDA tensors, so on CPU it ignores ``as_numpy`` and returns the tensors, and
``all_to_all_single`` raises ``TypeError`` (it wants a sequence of ints). The replacement
honours ``as_numpy`` for CPU tensors too, so the dispatcher sees what it sees on GPU.
Replaces: ``megatron.core.transformer.moe.token_dispatcher.maybe_move_tensor_to_cpu``
(the token dispatcher's own reference, its only caller; ``moe_utils``' original stays).
Versions: megatron-core 0.16.1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_patches._util import once, replace_attr

if TYPE_CHECKING:
    import numpy as np

NAME = "moe_split_sizes"


def apply() -> bool:
    def _do() -> None:
        from megatron.core.transformer.moe import token_dispatcher

        original = token_dispatcher.maybe_move_tensor_to_cpu

        def maybe_move_tensor_to_cpu(
            tensor: torch.Tensor | None, as_numpy: bool = False, record_stream: bool = False
        ) -> torch.Tensor | np.ndarray | None:
            if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
                return tensor.detach().clone().numpy()  # a copy, as the GPU path returns
            return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

        replace_attr(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)

    return once(NAME, _do)
