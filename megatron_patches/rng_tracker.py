"""Patch: Megatron's model-parallel RNG tracker keeps CPU generator states.

Why: ``tensor_parallel/random.py`` keeps one "CUDA" RNG state per stream name (data
parallel, tensor parallel, expert) so that dropout and init differ across TP ranks but
agree across DP ranks. ``CudaRNGStatesTracker.add`` and ``fork`` and activation recompute
(``_get_cuda_rng_state`` / ``_set_cuda_rng_state``) all call ``torch.cuda`` RNG functions,
which fail without CUDA. On CPU the device generator *is* the CPU default generator, so the
tracker swaps that generator's state instead, with the same semantics.
Replaces: ``megatron.core.tensor_parallel.random._get_cuda_rng_state``,
``._set_cuda_rng_state``, ``CudaRNGStatesTracker.add`` and ``CudaRNGStatesTracker.fork``
(the original ``fork`` warns whenever the CPU state changes inside it, which on CPU is
every fork that draws a random number).
Versions: megatron-core 0.16.1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from megatron_patches._util import once, replace_attr

NAME = "rng_tracker"


def _get_state(device: object = None, clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _set_state(new_state: torch.Tensor, device: object = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _add(self, name: str, seed: int) -> None:
    self._is_initialized = True
    if seed in self.seeds_:
        raise ValueError(f"seed {seed} already exists")
    if name in self.states_:
        raise ValueError(f"rng state {name} already exists")
    self.seeds_.add(seed)
    orig = torch.get_rng_state()
    torch.manual_seed(seed)
    self.states_[name] = torch.get_rng_state()
    torch.set_rng_state(orig)


@contextlib.contextmanager
def _fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
    if name not in self.states_:
        raise ValueError(f"rng state {name} is not added")
    outer = torch.get_rng_state()
    outer_name = self._current_state_name
    if outer_name != "default-rng":
        self.states_[outer_name] = outer
    torch.set_rng_state(self.states_[name])
    self._current_state_name = name
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        if outer_name != "default-rng":
            outer = self.states_[outer_name]
        torch.set_rng_state(outer)
        self._current_state_name = outer_name


def apply() -> bool:
    def _do() -> None:
        from megatron.core.tensor_parallel import random as mrandom

        replace_attr(mrandom, "_get_cuda_rng_state", _get_state)
        replace_attr(mrandom, "_set_cuda_rng_state", _set_state)
        replace_attr(mrandom.CudaRNGStatesTracker, "add", _add)
        default = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME

        def fork(self, name: str = default):
            return _fork(self, name)

        replace_attr(mrandom.CudaRNGStatesTracker, "fork", fork)

    return once(NAME, _do)
