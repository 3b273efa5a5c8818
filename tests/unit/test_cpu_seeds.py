"""The seeded sampler a CPU server runs (rl/serving/cpu_seeds.py), without a server: the
draw is a function of (seed, position) only, follows the distribution, and the patches go
in once. The server honouring seeds: tests/servers/test_generator.py."""

from __future__ import annotations

import sys
import types

import torch

from rl.serving import cpu_seeds


def test_the_draw_depends_on_seed_and_position_only():
    lp = torch.log_softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), 1)
    seeds, pos = torch.tensor([11, 11, 12]), torch.tensor([4, 4, 4])
    h = cpu_seeds.hash32(seeds, pos, torch.arange(50))
    assert torch.equal(h[0], h[1]) and not torch.equal(h[0], h[2])
    assert int(h.min()) >= 0 and int(h.max()) < 2**32
    one = cpu_seeds.multinomial_with_seed(lp[:1], seeds[:1], pos[:1])
    rows = cpu_seeds.multinomial_with_seed(lp[[2, 0]], seeds[[2, 0]], pos[[2, 0]])
    assert rows[1, 0] == one[0, 0]  # the same row, wherever it sits in the batch
    # The next position is a fresh draw, not the same one again.
    assert not torch.equal(cpu_seeds.hash32(seeds, pos + 1, torch.arange(50)), h)


def test_draws_follow_the_distribution():
    p = torch.tensor([0.6, 0.25, 0.1, 0.05])
    n = 40_000
    lp = torch.log(p).repeat(n, 1)
    idx = cpu_seeds.multinomial_with_seed(lp, torch.arange(n), torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(idx[:, 0], minlength=4) / n
    assert torch.allclose(freq, p, atol=0.01), freq  # 4 sigma at n=40k is ~0.01


def test_requests_without_a_seed_get_their_own_once():
    reqs = [types.SimpleNamespace(sampling_params=types.SimpleNamespace(sampling_seed=s))
            for s in (7, None, None)]  # fmt: skip
    first = cpu_seeds.seeds_of(reqs)
    assert first[0] == 7 and first[1] != first[2]
    assert cpu_seeds.seeds_of(reqs) == first  # kept on the request: the same next batch


def test_patches_go_in_once_whichever_comes_first(monkeypatch):
    class Info:
        sampling_seed = None

        @classmethod
        def from_schedule_batch(cls, batch, vocab_size):
            return cls()

    batch_info = types.ModuleType(cpu_seeds.BATCH_INFO)
    batch_info.SamplingBatchInfo = Info
    sampler = types.ModuleType(cpu_seeds.SAMPLER)
    sampler.multinomial_with_seed = None
    monkeypatch.setitem(sys.modules, cpu_seeds.BATCH_INFO, batch_info)
    monkeypatch.setitem(sys.modules, cpu_seeds.SAMPLER, sampler)
    cpu_seeds.install()
    cpu_seeds.install()
    assert sampler.multinomial_with_seed is cpu_seeds.multinomial_with_seed
    req = types.SimpleNamespace(sampling_params=types.SimpleNamespace(sampling_seed=5))
    info = Info.from_schedule_batch(types.SimpleNamespace(reqs=[req], device="cpu"), 10)
    assert info.sampling_seed.tolist() == [5]
