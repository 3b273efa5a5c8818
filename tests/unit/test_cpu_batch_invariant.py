"""The padded products a deterministic run's CPU servers use (rl/generator/
cpu_batch_invariant.py), without a server: on this machine's torch and MKL a row of an
fp32 product is bit-equal whatever rows come with it once the product has ``MIN_ROWS``
rows (the property the patch relies on; this fails when an upgrade changes it), the
unpadded product is not (the reason for the patch), and the patch goes in only when asked.
The server bit-equal alone and batched: tools/bench/batch_invariance.py."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F

from rl.serving import cpu_batch_invariant as bi


@pytest.fixture
def weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(1536, 576, generator=g), torch.randn(300, 576, generator=g)


@pytest.mark.parametrize("threads", [1, 2])
def test_padded_rows_are_the_same_in_any_batch(weights, threads):
    w, x = weights
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        linear, matmul = bi.padded(F.linear), bi.padded(torch.matmul)
        full = F.linear(x, w)
        for rows in (*range(1, 20), 64, 299):
            for offset in (0, 1):
                part = x[offset : offset + rows]
                expect = full[offset : offset + rows]
                assert torch.equal(linear(part, w), expect), (rows, offset)
                assert torch.equal(matmul(part, w.T), expect), (rows, offset)
        unpadded = [
            m for m in range(1, bi.MIN_ROWS) if not torch.equal(F.linear(x[:m], w), full[:m])
        ]
        assert unpadded, "MKL's small products now match: the patch may be unneeded"
    finally:
        torch.set_num_threads(before)


def test_other_calls_pass_through(weights):
    w, x = weights
    linear = bi.padded(F.linear)
    assert bi.padded(linear) is linear  # never wrapped twice
    b = torch.randn(1536)
    assert torch.equal(
        linear(x[:3], w, b), F.linear(torch.cat([x[:3], x.new_zeros(13, 576)]), w, b)[:3]
    )
    x3 = x[:6].reshape(2, 3, 576)  # not 2-D: unchanged
    assert torch.equal(linear(x3, w), F.linear(x3, w))
    xb = x[:3].bfloat16()
    assert torch.equal(linear(xb, w.bfloat16()), F.linear(xb, w.bfloat16()))


def test_installed_only_when_the_launcher_asks(monkeypatch):
    runner = types.ModuleType(bi.RUNNER)
    monkeypatch.setitem(sys.modules, bi.RUNNER, runner)
    monkeypatch.setattr(F, "linear", F.linear)  # restored after the test
    monkeypatch.setattr(torch, "matmul", torch.matmul)
    monkeypatch.delenv(bi.BATCH_INVARIANT_ENV, raising=False)
    bi.install()
    assert not getattr(F.linear, "_msrl_padded", False)
    monkeypatch.setenv(bi.BATCH_INVARIANT_ENV, "1")
    bi.install()
    bi.install()
    assert F.linear._msrl_padded and torch.matmul._msrl_padded


def test_every_batch_samples_on_the_sorted_path(monkeypatch):
    """A greedy row (an evaluation request) in a batch of sampled rollouts switches
    SGLang's sampler to another path for the whole batch; the patch takes that path for
    every batch, so a row's draw never depends on its neighbours."""

    class Info:
        is_all_greedy = need_top_k_sampling = None

        @classmethod
        def from_schedule_batch(cls, batch, vocab_size):
            info = cls()
            info.is_all_greedy = all(k <= 1 for k in batch)
            info.need_top_k_sampling = any(k != -1 for k in batch)
            return info

    module = types.ModuleType(bi.BATCH_INFO)
    module.SamplingBatchInfo = Info
    bi.patch_batch_info(module)
    bi.patch_batch_info(module)  # once only
    for batch in ([-1, -1], [1, 1], [1, -1]):
        info = Info.from_schedule_batch(batch, 10)
        assert (info.is_all_greedy, info.need_top_k_sampling) == (False, True)
