"""Patch: uneven all-gather / reduce-scatter along the first dimension work on gloo.

Why: with MoE, tensor parallelism and expert parallelism together, the alltoall token
dispatcher gathers the tokens routed to this rank's experts over the expert-TP group with
``output_split_sizes`` (each TP rank holds another part of the sequence, so other counts),
and scatters them back with ``input_split_sizes``. Megatron passes lists of unequal tensors
to ``all_gather`` / ``reduce_scatter``, which NCCL accepts and gloo refuses
("ProcessGroupGloo::allgather: invalid tensor size"); gloo has no list reduce_scatter.
On CPU the uneven cases are done with equal-size collectives instead: the gather pads
every part to the largest and trims, the reduce-scatter all-reduces and keeps this rank's
rows. The even cases (no split sizes) run Megatron's own code.
Replaces: ``megatron.core.tensor_parallel.mappings._gather_along_first_dim`` and
``_reduce_scatter_along_first_dim`` (module globals, looked up at call time by the autograd
functions of the same module).
Versions: megatron-core 0.16.1 on gloo.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_patches._util import once, replace_attr

NAME = "uneven_gather"


def apply() -> bool:
    def _do() -> None:
        from megatron.core.tensor_parallel import mappings

        gather, scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

        def _gather(
            input_: torch.Tensor,
            group: dist.ProcessGroup,
            output_split_sizes: list[int] | None = None,
            use_global_buffer: bool = False,
        ) -> torch.Tensor:
            if output_split_sizes is None or group.size() == 1:
                return gather(input_, group, output_split_sizes, use_global_buffer)
            sizes = [int(s) for s in output_split_sizes]
            most = max(sizes)
            part = input_.new_zeros(most, *input_.shape[1:])
            part[: input_.shape[0]] = input_
            parts = [torch.empty_like(part) for _ in sizes]
            dist.all_gather(parts, part.contiguous(), group=group)
            return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)], dim=0)

        def _scatter(
            input_: torch.Tensor,
            group: dist.ProcessGroup,
            input_split_sizes: list[int] | None = None,
            use_global_buffer: bool = False,
        ) -> torch.Tensor:
            if input_split_sizes is None or group.size() == 1:
                return scatter(input_, group, input_split_sizes, use_global_buffer)
            sizes = [int(s) for s in input_split_sizes]
            total = input_.contiguous().clone()
            dist.all_reduce(total, group=group)
            start = sum(sizes[: group.rank()])
            return total[start : start + sizes[group.rank()]]

        replace_attr(mappings, "_gather_along_first_dim", _gather)
        replace_attr(mappings, "_reduce_scatter_along_first_dim", _scatter)

    return once(NAME, _do)
