"""Per-request sampling seeds on SGLang's CPU servers (imported at start-up in every process
of a CPU server, by the ``sitecustomize`` that rl/serving/cpu_shim.py writes).

Why: SGLang 0.5.23 honours a request's ``sampling_seed`` only under
``--enable-deterministic-inference``, and refuses that flag on CPU (its CPU attention
backend is not one of the deterministic ones), so a seeded request sampled differently
alone and in a batch (tools/bench/batch_invariance.py). Its sampler has a seeded path (a
draw hashed from the request's seed and the token's position: the same wherever the row
sits in the batch); two things keep it from running on CPU without the flag.

What it replaces, each once its module is imported: ``SamplingBatchInfo.
from_schedule_batch`` is wrapped to fill ``sampling_seed`` from the requests, and the
sampler's ``multinomial_with_seed`` becomes a seeded draw in plain torch (SGLang's calls an
sgl-kernel CPU op that only its AMX build has). A request without a seed gets a
random one of its own, drawn once (so it samples as randomly as before, and every batch
has a seed per row: SGLang merges two batches' seeds only when both have them). Versions:
sglang 0.5.23. Without SGLang, or if the class changed shape, it does nothing and says so
in the server's log.

Standard library only at import time: it runs before anything else in the process.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from rl.serving.after_import import Patch, patch_on_import

if TYPE_CHECKING:  # imported at run time only once SGLang's sampler needs it
    import torch


class _Params(Protocol):
    sampling_seed: int | None


class _Req(Protocol):
    """The part of SGLang's ``Req`` read here."""

    @property
    def sampling_params(self) -> _Params: ...


class _Batch(Protocol):
    """The part of SGLang's ``ScheduleBatch`` read here."""

    @property
    def reqs(self) -> Sequence[_Req]: ...

    @property
    def device(self) -> str: ...


BATCH_INFO = "sglang.srt.sampling.sampling_batch_info"
SAMPLER = "sglang.srt.layers.sampler"
_rng = random.SystemRandom()
_M32 = 0xFFFFFFFF


def seeds_of(reqs: Sequence[_Req]) -> list[int]:
    """Each request's sampling seed, a random one drawn once for a request without."""
    out = []
    for r in reqs:
        p = r.sampling_params
        if p.sampling_seed is None:
            p.sampling_seed = _rng.getrandbits(63)
        out.append(p.sampling_seed)
    return out


def patch_batch_info(module: ModuleType) -> None:
    cls = getattr(module, "SamplingBatchInfo", None)
    original = getattr(cls, "from_schedule_batch", None)
    if getattr(cls, "_msrl_seeds", False):
        return
    if cls is None or original is None:
        _unpatched(f"{BATCH_INFO}.SamplingBatchInfo.from_schedule_batch")
        return
    build = original.__func__

    def from_schedule_batch(
        klass: type, batch: _Batch, vocab_size: int, *args: object, **kw: object
    ) -> object:
        import torch

        info = build(klass, batch, vocab_size, *args, **kw)
        if info.sampling_seed is None:  # SGLang's deterministic mode fills it itself
            seeds = seeds_of(batch.reqs)
            info.sampling_seed = torch.tensor(seeds, dtype=torch.int64, device=batch.device)
        return info

    cls.from_schedule_batch = classmethod(from_schedule_batch)
    cls._msrl_seeds = True


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """One murmur3 round on 32-bit values held in int64 tensors (the products may wrap
    past 2**63; the low 32 bits, all that is kept, are right either way)."""
    k = (k * 0xCC9E2D51) & _M32
    k = ((k << 15) | (k >> 17)) & _M32
    k = (k * 0x1B873593) & _M32
    h = h ^ k
    h = ((h << 13) | (h >> 19)) & _M32
    return (h * 5 + 0xE6546B64) & _M32


def hash32(seed: torch.Tensor, positions: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``[n, m]`` 32-bit hashes of (seed, position) per row and token id per column:
    murmur3 of seed (low, high), position and column, as SGLang's GPU kernel hashes."""
    seed = seed.long()
    h = _mix(seed.new_zeros(seed.shape), seed & _M32)
    h = _mix(h, (seed >> 32) & _M32)
    h = _mix(h, positions.long() & _M32)[:, None]
    h = _mix(h, (cols.long() & _M32)[None, :])
    h = h ^ 16
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def multinomial_with_seed(
    logprobs: torch.Tensor, seed: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """``[n, 1]`` token ids, row i drawn from ``softmax(logprobs[i])`` by inverse CDF at one
    uniform hashed from ``(seed[i], positions[i])``: a function of the row alone, so the
    same in any batch. SGLang's own draws a Gumbel variate per vocabulary entry with a CPU
    kernel of sgl-kernel's AMX build, which PyPI does not ship; one hash per row is also
    cheaper (37 ms against 128 ms for Gumbel in plain torch and 52 ms for
    ``torch.multinomial``, at 64 rows of a 49,152-token vocabulary on one core)."""
    import torch

    u = (hash32(seed, positions, torch.zeros(1, dtype=torch.long)).double() + 0.5) / 2.0**32
    cdf = torch.softmax(logprobs.double(), dim=1).cumsum(dim=1)
    drawn = torch.searchsorted(cdf, u * cdf[:, -1:])
    return drawn.clamp_max(logprobs.shape[1] - 1)


def patch_sampler(module: ModuleType) -> None:
    if not hasattr(module, "multinomial_with_seed"):
        _unpatched(f"{SAMPLER}.multinomial_with_seed")
        return
    # The sampler's functions look it up among the module's globals at each call.
    vars(module)["multinomial_with_seed"] = multinomial_with_seed


def _unpatched(what: str) -> None:
    print(f"[cpu_seeds] {what} is gone: not patched; per-request seeds are ignored",
          file=sys.stderr)  # fmt: skip


PATCHES: dict[str, Patch] = {BATCH_INFO: patch_batch_info, SAMPLER: patch_sampler}


def install() -> None:
    """Patch SGLang's sampling as its modules are imported (idempotent)."""
    patch_on_import(PATCHES)
