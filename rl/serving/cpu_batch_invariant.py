"""Batch-invariant matrix products on SGLang's CPU servers: a request's log-probs, bit for
bit, whatever it is batched with (a deterministic run's generator; imported at start-up
by the ``sitecustomize`` that rl/serving/cpu_shim.py writes, when the launcher sets
``BATCH_INVARIANT_ENV``).

Why: a CPU server's only op whose result for one row depends on the other rows is the
fp32 matrix product. MKL's sgemm takes another code path for a product of fewer than
about a dozen rows, and that path sums in another order: row ``i`` of ``x @ W.T``
differs in its last bits with 1-3 rows (one thread) or 1-11 rows (two), and is the same
for any 12 or more rows, at any offset, up to 5,000 rows (measured on this machine's
Xeon, torch 2.14.1 with MKL 2024.2, for the shapes of SmolLM2 and the tiny model).
Decoding a few requests is exactly such a product, so the same request got log-probs
1.6e-5 apart alone and in a batch (tools/bench/batch_invariance.py). Padding every such
product with zero rows up to ``MIN_ROWS`` puts it on the path larger batches take.
Norms, rotary embeddings and the torch-native attention (one request at a time: the
batched attention of rl/serving/cpu_batched_attention.py stays off in such a run) work
row by row already.

The sampler does too, but picks its path for the whole batch: argmax when every row is
greedy, a plain seeded draw when no row asks for top-k/top-p, else a seeded draw over the
sorted probabilities, which turns the same uniform into another token. So a rollout
sampled while a greedy evaluation request shared its batch got another token (found by
the deterministic job test: tests/servers/test_rl_resume.py). Every batch is sent down
the sorted path, the one a mixed batch takes.

What it replaces: once SGLang's model runner is imported (torch is loaded by then),
``torch.nn.functional.linear`` and ``torch.matmul`` in the server's process, with
wrappers that pad a 2-D fp32 CPU input of fewer than ``MIN_ROWS`` rows and pass every
other call through unchanged; once its sampling module is, ``SamplingBatchInfo.
from_schedule_batch`` is wrapped to set ``is_all_greedy=False`` and
``need_top_k_sampling=True`` (merging batches keeps both). Versions: torch 2.14.1
(MKL 2024.2), sglang 0.5.23; the row-invariance test in
tests/unit/test_cpu_batch_invariant.py fails when a new torch or MKL changes it.

Standard library only at import time: it runs before anything else in the process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

from rl.serving.after_import import Patch, patch_on_import

if TYPE_CHECKING:
    import torch

BATCH_INVARIANT_ENV = "MSRL_BATCH_INVARIANT"
MIN_ROWS = 16
RUNNER = "sglang.srt.model_executor.model_runner"
BATCH_INFO = "sglang.srt.sampling.sampling_batch_info"

Product = Callable[..., "torch.Tensor"]


def padded(fn: Product) -> Product:
    """``fn(x, w, ...)`` with a 2-D fp32 CPU ``x`` of fewer than ``MIN_ROWS`` rows padded
    with zero rows (and the padding's rows cut off the result)."""
    if getattr(fn, "_msrl_padded", False):
        return fn

    def call(x: torch.Tensor, w: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        import torch

        rows = x.shape[0] if x.dim() == 2 else MIN_ROWS
        if rows >= MIN_ROWS or x.dtype != torch.float32 or x.device.type != "cpu" or kw:
            return fn(x, w, *args, **kw)
        pad = x.new_zeros(MIN_ROWS - rows, x.shape[1])
        return fn(torch.cat([x, pad]), w, *args)[:rows]

    call._msrl_padded = True  # type: ignore[attr-defined]
    return call


def patch_torch(_: ModuleType | None = None) -> None:
    """Pad small fp32 products in this process (idempotent)."""
    import torch
    import torch.nn.functional as F

    F.linear = padded(F.linear)
    torch.matmul = padded(torch.matmul)


def patch_batch_info(module: ModuleType) -> None:
    """Every batch samples on one path, whatever rows it holds (idempotent)."""
    cls = getattr(module, "SamplingBatchInfo", None)
    original = getattr(cls, "from_schedule_batch", None)
    if cls is None or original is None or getattr(cls, "_msrl_one_path", False):
        return
    build = original.__func__

    def from_schedule_batch(klass: type, *args: object, **kw: object) -> object:
        info = build(klass, *args, **kw)
        info.is_all_greedy, info.need_top_k_sampling = False, True
        return info

    cls.from_schedule_batch = classmethod(from_schedule_batch)
    cls._msrl_one_path = True


PATCHES: dict[str, Patch] = {RUNNER: patch_torch, BATCH_INFO: patch_batch_info}


def install() -> None:
    """Pad small products once SGLang's model runner is imported, if the launcher asked
    for batch invariance (``BATCH_INVARIANT_ENV=1``)."""
    if os.environ.get(BATCH_INVARIANT_ENV) == "1":
        patch_on_import(PATCHES)
