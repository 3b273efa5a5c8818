"""One attention call per batch on SGLang's CPU servers, not one per request (imported at
start-up in every process of a CPU server, by the ``sitecustomize`` that
rl/serving/cpu_shim.py writes).

Why: a CPU server attends with SGLang's torch-native backend
(``sglang/srt/layers/attention/torch_native_backend.py``), whose
``_run_sdpa_forward_decode`` and ``_run_sdpa_forward_extend`` loop over the batch in
Python, one ``scaled_dot_product_attention`` per request per layer. With the RL job's
hundreds of short rollouts in flight, that loop was ~40% of the scheduler's time (py-spy,
22.7% decode, 17.2% extend). Here one call serves many requests: each request's keys and
values are gathered from the cache into a batch padded to its longest sequence, and a
boolean mask hides the padding (and, in an extend, gives each query its causal window:
key ``j`` is visible to query ``i`` of request ``r`` iff ``j <= prefix_len[r] + i`` and
``j < seq_len[r]``). A padded slot reads the request's own first token, never an unused
cache slot: those hold whatever the pool was allocated with (NaN, say), and a masked
NaN still poisons the sum.

What it replaces, once ``sglang.srt.layers.attention.torch_native_backend`` is imported:
``TorchNativeAttnBackend._run_sdpa_forward_decode`` and ``_run_sdpa_forward_extend``, with
methods that keep SGLang's (kept as ``_msrl_loop_decode``/``_msrl_loop_extend``) for what
they do not cover: encoder lengths or cross attention, sliding windows, a cache whose
dtype is not the query's, a device other than CPU, a causal decode, a request without
tokens (or, in an extend, without new ones), and any batch of one request (so a lone
request is attended exactly as SGLang does). Requests are batched in runs whose padded
tensors stay under ``MAX_ELEMENTS``; a request too long to share a run goes through
SGLang's loop alone. Not installed when the server runs batch-invariant
(``BATCH_INVARIANT_ENV``: per-request attention gives a request the same bits whatever it
is batched with; padding to the batch's longest need not) nor when
``BATCHED_ATTENTION_ENV=0`` (a baseline: tools/bench/batched_attention.py). Outputs
equal SGLang's within fp32 rounding (tests/unit/test_cpu_batched_attention.py).
Versions: sglang 0.5.23, torch 2.14.1.

Standard library only at import time: it runs before anything else in the process.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from itertools import accumulate
from types import ModuleType
from typing import TYPE_CHECKING

from rl.serving.after_import import patch_on_import
from rl.serving.cpu_batch_invariant import BATCH_INVARIANT_ENV

if TYPE_CHECKING:
    import torch

BACKEND = "sglang.srt.layers.attention.torch_native_backend"
CLASS = "TorchNativeAttnBackend"
BATCHED_ATTENTION_ENV = "MSRL_BATCHED_ATTENTION"
# Elements of one run's padded tensors (scores, keys and values spread to every head,
# queries and outputs): 2**24 fp32 elements is 64 MiB.
MAX_ELEMENTS = 1 << 24

Method = Callable[..., "torch.Tensor"]


def runs(lq: list[int], lk: list[int], heads: int, dim: int) -> Iterator[tuple[int, int]]:
    """Consecutive requests ``[lo, hi)`` whose padded tensors (``lq`` queries, ``lk`` keys
    per request, each run padded to its longest) stay under ``MAX_ELEMENTS``; a request
    over it alone is a run of one."""

    def size(n: int, q: int, k: int) -> int:
        return n * heads * (q * k + 2 * (k + q) * dim)

    if lq and size(len(lq), max(lq), max(lk)) <= MAX_ELEMENTS:  # the usual case: one run
        yield 0, len(lq)
        return
    lo, mq, mk = 0, 0, 0
    for r, (q, k) in enumerate(zip(lq, lk, strict=True)):
        nq, nk = max(mq, q), max(mk, k)
        if r > lo and size(r - lo + 1, nq, nk) > MAX_ELEMENTS:
            yield lo, r
            lo, nq, nk = r, q, k
        mq, mk = nq, nk
    if lo < len(lq):
        yield lo, len(lq)


def _covered(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    encoder_lens: torch.Tensor | None,
    is_cross_attn: bool,
    sliding_window_size: int | None,
) -> bool:
    """Whether the batched path attends as SGLang's loop does for these arguments."""
    return (
        encoder_lens is None
        and not is_cross_attn
        and (sliding_window_size is None or sliding_window_size <= -1)
        and query.device.type == "cpu"
        and query.dtype == k_cache.dtype == v_cache.dtype
    )


def _keys(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    pool: torch.Tensor,
    seq_lens: torch.Tensor,
    lk: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys and values ``[B, H_kv, lk, D]`` of requests ``pool`` (``seq_lens`` tokens
    each), and ``[B, lk]`` which slots are real; a padded slot reads the request's first
    token, which the mask hides."""
    import torch

    slots = req_to_token[pool, :lk]
    real = torch.arange(lk, device=slots.device) < seq_lens[:, None]
    flat = torch.where(real, slots, slots[:, :1]).view(-1).long()
    # index_select: a quarter of the time of ``k_cache[slots]`` here
    key = k_cache.index_select(0, flat).view(*slots.shape, *k_cache.shape[1:])
    value = v_cache.index_select(0, flat).view(*slots.shape, *v_cache.shape[1:])
    return key.transpose(1, 2), value.transpose(1, 2), real


def batched_decode(loop: Method) -> Method:
    """``_run_sdpa_forward_decode`` attending runs of requests at once; ``loop`` (SGLang's)
    for the rest."""

    def decode(
        self: object,
        query: torch.Tensor,
        output: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        encoder_lens: torch.Tensor | None = None,
        scaling: float | None = None,
        enable_gqa: bool = False,
        causal: bool = False,
        is_cross_attn: bool = False,
        sliding_window_size: int | None = None,
    ) -> torch.Tensor:
        from torch.nn.functional import scaled_dot_product_attention

        lens = seq_lens.tolist()
        if (
            not _covered(query, k_cache, v_cache, encoder_lens, is_cross_attn, sliding_window_size)
            or causal  # SGLang's decode never asks for it; its loop would mask top-left
            or query.shape[0] != len(lens)
            or min(lens, default=1) < 1
        ):
            return loop(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                        seq_lens, encoder_lens, scaling=scaling, enable_gqa=enable_gqa,
                        causal=causal, is_cross_attn=is_cross_attn,
                        sliding_window_size=sliding_window_size)  # fmt: skip
        heads, dim = query.shape[1], query.shape[2]
        for lo, hi in runs([1] * len(lens), lens, heads, dim):
            if hi - lo == 1:
                loop(self, query[lo:hi], output[lo:hi], k_cache, v_cache, req_to_token,
                     req_pool_indices[lo:hi], seq_lens[lo:hi], None, scaling=scaling,
                     enable_gqa=enable_gqa, causal=False)  # fmt: skip
                continue
            key, value, real = _keys(k_cache, v_cache, req_to_token, req_pool_indices[lo:hi],
                                     seq_lens[lo:hi], max(lens[lo:hi]))  # fmt: skip
            out = scaled_dot_product_attention(
                query[lo:hi, :, None, :],  # [B, H, 1, D]
                key,
                value,
                attn_mask=real[:, None, None, :],
                scale=scaling,
                enable_gqa=enable_gqa,
            )
            output[lo:hi] = out[:, :, 0, :]
        return output

    decode._msrl_batched = True  # type: ignore[attr-defined]
    return decode


def batched_extend(loop: Method) -> Method:
    """``_run_sdpa_forward_extend`` attending runs of requests at once; ``loop``
    (SGLang's) for the rest."""

    def extend(
        self: object,
        query: torch.Tensor,
        output: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        extend_prefix_lens: torch.Tensor,
        extend_seq_lens: torch.Tensor,
        encoder_lens: torch.Tensor | None = None,
        scaling: float | None = None,
        enable_gqa: bool = False,
        causal: bool = False,
        is_cross_attn: bool = False,
        sliding_window_size: int | None = None,
    ) -> torch.Tensor:
        import torch
        from torch.nn.functional import scaled_dot_product_attention

        lens, lq = seq_lens.tolist(), extend_seq_lens.tolist()
        if (
            not _covered(query, k_cache, v_cache, encoder_lens, is_cross_attn, sliding_window_size)
            or min(lens, default=1) < 1
            or min(lq, default=1) < 1
        ):
            return loop(self, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                        seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens,
                        scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                        is_cross_attn=is_cross_attn,
                        sliding_window_size=sliding_window_size)  # fmt: skip
        starts = [0, *accumulate(lq)]
        heads, dim = query.shape[1], query.shape[2]
        for lo, hi in runs(lq, lens, heads, dim):
            if hi - lo == 1:
                q = slice(starts[lo], starts[hi])
                loop(self, query[q], output[q], k_cache, v_cache, req_to_token,
                     req_pool_indices[lo:hi], seq_lens[lo:hi], extend_prefix_lens[lo:hi],
                     extend_seq_lens[lo:hi], None, scaling=scaling, enable_gqa=enable_gqa,
                     causal=causal)  # fmt: skip
                continue
            n_q, n_k = max(lq[lo:hi]), max(lens[lo:hi])
            i = torch.arange(n_q)
            ext = extend_seq_lens[lo:hi, None].long()
            asked = i < ext  # [B, n_q]: which padded queries are real
            # A padded query repeats its request's last one; its output is dropped.
            rows = torch.tensor(starts[lo:hi])[:, None] + torch.minimum(i, ext - 1)
            key, value, real = _keys(k_cache, v_cache, req_to_token, req_pool_indices[lo:hi],
                                     seq_lens[lo:hi], n_k)  # fmt: skip
            mask = real[:, None, :]  # [B, 1, n_k]
            if causal:
                last = extend_prefix_lens[lo:hi, None] + i  # the last key each query sees
                mask = mask & (torch.arange(n_k) <= last[:, :, None])  # [B, n_q, n_k]
            asked_q = query.index_select(0, rows.view(-1)).view(*rows.shape, *query.shape[1:])
            out = scaled_dot_product_attention(
                asked_q.transpose(1, 2),  # [B, H, n_q, D]
                key,
                value,
                attn_mask=mask[:, None],
                scale=scaling,
                enable_gqa=enable_gqa,
            )
            output.index_copy_(0, rows[asked], out.transpose(1, 2)[asked])
        return output

    extend._msrl_batched = True  # type: ignore[attr-defined]
    return extend


def patch_backend(module: ModuleType) -> None:
    """Batched decode and extend in ``module``'s torch-native backend (idempotent)."""
    import sys

    cls = getattr(module, CLASS, None)
    decode = getattr(cls, "_run_sdpa_forward_decode", None)
    extend = getattr(cls, "_run_sdpa_forward_extend", None)
    if cls is None or decode is None or extend is None:
        print(f"[cpu_batched_attention] {module.__name__}.{CLASS}'s SDPA loops gone: not "
              "patched; attention runs per request", file=sys.stderr)  # fmt: skip
        return
    if getattr(decode, "_msrl_batched", False):
        return
    cls._msrl_loop_decode, cls._msrl_loop_extend = decode, extend
    cls._run_sdpa_forward_decode = batched_decode(decode)
    cls._run_sdpa_forward_extend = batched_extend(extend)


def install() -> None:
    """Batch the torch-native backend's attention as its module is imported, unless the
    server runs batch-invariant or ``BATCHED_ATTENTION_ENV=0`` (idempotent)."""
    if os.environ.get(BATCH_INVARIANT_ENV) == "1" or os.environ.get(BATCHED_ATTENTION_ENV) == "0":
        return
    patch_on_import({BACKEND: patch_backend})
