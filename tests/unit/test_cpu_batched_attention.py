"""The batched torch-native attention of CPU servers (rl/serving/cpu_batched_attention.py)
against SGLang's own per-request loops, on the same random caches: equal within fp32
rounding (``TOL``) in decode and extend, with GQA, mixed lengths, cached prefixes, runs
split by the memory bound, and every unused cache slot NaN.

SGLang's loops are its own source (``torch_native_backend.py`` of the installed wheel),
compiled into a stand-in class: importing the real module costs ~20 s of SGLang imports.
The live servers' parity with transformers is tests/servers/test_sglang_reference.py.
"""

from __future__ import annotations
import __future__

import ast
import itertools
import sys
from importlib.metadata import distribution
from pathlib import Path
from types import ModuleType
from typing import Optional

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from rl.serving import cpu_batched_attention as ba
from rl.serving.after_import import AfterImport
from rl.serving.cpu_batch_invariant import BATCH_INVARIANT_ENV

TOL = 1e-6  # absolute; outputs are averages of N(0, 1) values, |out| < 4
HEADS, KV_HEADS, DIM = 6, 2, 16
METHODS = ("_make_sliding_window_mask", "_run_sdpa_forward_extend", "_run_sdpa_forward_decode")


def _sglang() -> ModuleType:
    """A module holding ``TorchNativeAttnBackend`` with SGLang's SDPA methods only."""
    path = Path(str(distribution("sglang").locate_file(ba.BACKEND.replace(".", "/") + ".py")))
    tree = ast.parse(path.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == ba.CLASS)
    body = [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in METHODS]
    assert sorted(n.name for n in body) == sorted(METHODS), f"{path} changed"
    stand_in = ast.ClassDef(name=ba.CLASS, bases=[], keywords=[], body=body, decorator_list=[])
    code = compile(
        ast.fix_missing_locations(ast.Module(body=[stand_in], type_ignores=[])),
        str(path),
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    module = ModuleType(ba.BACKEND)
    vars(module).update(
        torch=torch, Optional=Optional, scaled_dot_product_attention=scaled_dot_product_attention
    )
    exec(code, vars(module))
    return module


def _backends() -> tuple[object, object]:
    """SGLang's backend and the patched one (a subclass, so SGLang's stays unpatched)."""
    original = getattr(_sglang(), ba.CLASS)
    module = ModuleType(ba.BACKEND)
    setattr(module, ba.CLASS, type(ba.CLASS, (original,), {}))
    ba.patch_backend(module)
    ba.patch_backend(module)  # idempotent
    patched = getattr(module, ba.CLASS)
    assert patched._msrl_loop_decode is original._run_sdpa_forward_decode
    return original(), patched()


class Batch:
    """A KV cache whose unused slots are NaN, and requests of ``lens`` tokens each at
    random slots (``req_to_token`` past a request's length points at NaN slots)."""

    def __init__(self, lens: list[int], seed: int = 0, dtype: torch.dtype = torch.float32):
        g = torch.Generator().manual_seed(seed)
        slots = 4 * sum(lens) + 8
        self.k = torch.full((slots, KV_HEADS, DIM), float("nan"), dtype=dtype)
        self.v = torch.full((slots, KV_HEADS, DIM), float("nan"), dtype=dtype)
        used = torch.randperm(slots, generator=g)[: sum(lens)]
        nan = torch.tensor([s for s in range(slots) if s not in set(used.tolist())])
        width = max(lens) + 5
        self.req_to_token = nan[torch.randint(len(nan), (len(lens) + 3, width), generator=g)]
        self.pool = torch.randperm(len(lens) + 3, generator=g)[: len(lens)]
        for r, part in enumerate(used.split(lens)):
            self.req_to_token[self.pool[r], : lens[r]] = part
        self.k[used] = torch.randn(len(used), KV_HEADS, DIM, generator=g).to(dtype)
        self.v[used] = torch.randn(len(used), KV_HEADS, DIM, generator=g).to(dtype)
        self.req_to_token = self.req_to_token.int()
        self.lens = torch.tensor(lens)
        self.g = g

    def queries(self, n: int) -> torch.Tensor:
        return torch.randn(n, HEADS, DIM, generator=self.g)


def _decode(backend: object, b: Batch, q: torch.Tensor, **kw: object) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    backend._run_sdpa_forward_decode(  # type: ignore[attr-defined]
        q, out, b.k, b.v, b.req_to_token, b.pool, b.lens, None, scaling=0.3, enable_gqa=True, **kw
    )
    return out


def _extend(
    backend: object, b: Batch, q: torch.Tensor, prefix: list[int], **kw: object
) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    backend._run_sdpa_forward_extend(  # type: ignore[attr-defined]
        q, out, b.k, b.v, b.req_to_token, b.pool, b.lens, torch.tensor(prefix),
        b.lens - torch.tensor(prefix), None, scaling=0.3, enable_gqa=True, **kw,
    )  # fmt: skip
    return out


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert not got.isnan().any() and not want.isnan().any()
    assert (got - want).abs().max().item() <= TOL


LENS = [7, 1, 23, 2, 16, 9, 30, 4]


def test_decode_equals_sglangs_loop_with_mixed_lengths_gqa_and_nan_slots():
    sglang, batched = _backends()
    b = Batch(LENS)
    q = b.queries(len(LENS))
    _close(_decode(batched, b, q), _decode(sglang, b, q))


@pytest.mark.parametrize("causal", [True, False])
def test_extend_after_cached_prefixes_equals_sglangs_loop(causal):
    sglang, batched = _backends()
    b = Batch(LENS, seed=1)
    prefix = [3, 0, 10, 1, 0, 8, 29, 0]  # 0: a fresh prompt; 29 of 30: one new token
    q = b.queries(sum(LENS) - sum(prefix))
    _close(
        _extend(batched, b, q, prefix, causal=causal), _extend(sglang, b, q, prefix, causal=causal)
    )


def test_runs_split_by_the_memory_bound_still_equal_sglangs_loop(monkeypatch):
    # 600 elements: a run holds a few short requests; the 30-token one goes alone, as
    # SGLang's loop does it.
    monkeypatch.setattr(ba, "MAX_ELEMENTS", 60 * HEADS * DIM)
    lens = [2, 3, 2, 30, 3, 2, 2, 4, 1]
    cut = list(ba.runs([1] * len(lens), lens, HEADS, DIM))
    assert cut[0][0] == 0 and cut[-1][1] == len(lens)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(cut))
    assert (3, 4) in cut and any(hi - lo > 1 for lo, hi in cut)
    sglang, batched = _backends()
    b = Batch(lens, seed=2)
    q = b.queries(len(lens))
    _close(_decode(batched, b, q), _decode(sglang, b, q))
    prefix = [0, 1, 0, 12, 2, 0, 1, 3, 0]
    q = b.queries(sum(lens) - sum(prefix))
    _close(_extend(batched, b, q, prefix), _extend(sglang, b, q, prefix))


def test_what_the_batch_does_not_cover_is_sglangs_loop_bit_for_bit():
    sglang, batched = _backends()
    b = Batch(LENS, seed=3)
    q = b.queries(len(LENS))
    # A sliding window; then a cache of another dtype than the queries.
    assert torch.equal(
        _decode(batched, b, q, sliding_window_size=4), _decode(sglang, b, q, sliding_window_size=4)
    )
    half = Batch(LENS, seed=3, dtype=torch.bfloat16)
    assert torch.equal(_decode(batched, half, q), _decode(sglang, half, q))
    prefix = [0] * len(LENS)
    q = b.queries(sum(LENS))
    assert torch.equal(_extend(batched, half, q, prefix), _extend(sglang, half, q, prefix))
    # A lone request.
    one = Batch([12], seed=4)
    q = one.queries(1)
    assert torch.equal(_decode(batched, one, q), _decode(sglang, one, q))
    q = one.queries(5)
    assert torch.equal(_extend(batched, one, q, [7]), _extend(sglang, one, q, [7]))


@pytest.mark.parametrize("env", [{BATCH_INVARIANT_ENV: "1"}, {ba.BATCHED_ATTENTION_ENV: "0"}, {}])
def test_installed_unless_batch_invariant_or_switched_off(monkeypatch, env):
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    for var in (BATCH_INVARIANT_ENV, ba.BATCHED_ATTENTION_ENV):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delitem(sys.modules, ba.BACKEND, raising=False)
    ba.install()
    hook = next((f for f in sys.meta_path if isinstance(f, AfterImport)), None)
    fixes = hook.patches.pop(ba.BACKEND, []) if hook is not None else []
    assert fixes == ([] if env else [ba.patch_backend])


def test_a_backend_without_the_loops_is_left_alone_and_the_log_says_so(capsys):
    module = ModuleType(ba.BACKEND)
    ba.patch_backend(module)
    assert "SDPA loops gone: not patched" in capsys.readouterr().err
