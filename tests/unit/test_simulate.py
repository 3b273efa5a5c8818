"""The step-time simulator's pieces, on hand-made inputs (no config composed, no plan)."""

from __future__ import annotations

import math

import pytest

from rl.config.schema import HardwareConfig
from rl.simulate.lengths import Lengths
from rl.simulate.phases import Engine, decode_step_s, straggler_s, streaming_s
from rl.simulate.step import Phases, async_step, bottleneck, sync_step

HW = HardwareConfig()


def _engine(tp: int = 1, pp: int = 1, eager: bool = False) -> Engine:
    # 8B-like: 16 GB of bf16 weights, 128 KiB of KV per token, 32 layers.
    return Engine(
        tp,
        pp,
        32,
        16e9 / tp,
        kv_per_token=131072 / tp,
        flops_per_token=2 * 8e9,
        peak_flops=HW.bf16_tflops * 1e12,
        eager=eager,
    )


def test_sync_step_sums_and_async_step_overlaps() -> None:
    p = Phases(generate=5.0, reward=0.5, train=3.0, sync=1.0, overhead=0.25)
    assert sync_step(p) == pytest.approx(9.75)
    assert async_step(p) == pytest.approx(max(5.0 + 0.5 + 1.0, 3.0 + 1.0) + 0.25)
    assert bottleneck(p) == "generator"
    slow_trainer = Phases(generate=1.0, reward=0.0, train=4.0, sync=1.0, overhead=0.0)
    assert async_step(slow_trainer) == pytest.approx(5.0)
    assert bottleneck(slow_trainer) == "trainer"


def test_lengths_cut_at_the_cap() -> None:
    d = Lengths.relative(cap=1000, median_frac=0.25, sigma=0.8)
    assert d.survival(0) == 1.0 and d.survival(1000) == 0.0
    assert d.survival(250) == pytest.approx(0.5, abs=1e-9)  # the median
    mean = d.mean()
    uncut = 250 * math.exp(0.8**2 / 2)
    assert 250 < mean < uncut  # cutting at the cap only shortens
    assert d.longest(1024) == 1000  # a 1,024-sample batch reaches the cap
    assert d.longest(3) < 1000
    fixed = Lengths.relative(cap=1000, median_frac=0.5, sigma=0.0)
    assert fixed.mean() == pytest.approx(500, rel=0.02)


def test_decode_is_memory_bound_at_small_batches() -> None:
    e = _engine()
    one = decode_step_s(e, HW, 1, 1000)
    assert one == pytest.approx(16e9 / (HW.hbm_gbps * 1e9 * HW.decode_efficiency), rel=0.01)
    assert decode_step_s(e, HW, 8, 1000) < 1.1 * one  # weights dominate
    # Compute-bound at a huge batch: grows with the batch.
    assert decode_step_s(e, HW, 4096, 10) > 2 * decode_step_s(e, HW, 1024, 10)


def test_tp_splits_weights_but_pays_all_reduces_and_pipelines_add_up() -> None:
    one, tp2 = decode_step_s(_engine(), HW, 1, 100), decode_step_s(_engine(tp=2), HW, 1, 100)
    assert tp2 < one
    assert tp2 > one / 2  # the all-reduces
    # A pipeline's stages run in turn: the same weight reads plus a send per boundary.
    pp = decode_step_s(_engine(tp=2, pp=4), HW, 1, 100)
    assert pp == pytest.approx(tp2 + 3 * HW.hop_latency_us * 1e-6)
    assert decode_step_s(_engine(tp=2, eager=True), HW, 1, 100) > tp2


def test_the_straggler_costs_more_than_streaming() -> None:
    e, d = _engine(), Lengths.relative(cap=2048, median_frac=0.25, sigma=0.8)
    waited = straggler_s(e, HW, 8, 256, d, d.longest(1024))
    streamed = streaming_s(e, HW, 8, 8, 256, d)
    assert waited > 2 * streamed  # the batch waits for its longest sample
    # Fewer slots than samples: slower.
    assert streaming_s(e, HW, 8, 2, 256, d) > 2 * streamed


def test_sample_reuse_costs_a_pass_per_epoch_and_a_scoring_forward() -> None:
    """algorithm.epochs passes of forward+backward (6 per token and parameter), plus pi_old's
    forward (2) once a batch takes several updates; minibatches alone add only that
    forward (the pipeline bubble aside: pp=1 here)."""
    from rl.compose import compose
    from rl.simulate.phases import Workload, train_s

    cfg = compose(["experiment=llama3_8b_256gpu"])
    cfg.trainer.pp = 1
    w = Workload.of(cfg)
    one = train_s(cfg, w, 8, 8)
    cfg.algorithm.epochs, cfg.algorithm.minibatches = 2, 2
    assert train_s(cfg, w, 8, 8) == pytest.approx(one * (6 * 2 + 2) / 6)
    cfg.algorithm.epochs = 1
    assert train_s(cfg, w, 8, 8) == pytest.approx(one * (6 + 2) / 6)
    # Full recomputation: each layer's forward again in the backward, 2 more per pass.
    cfg.algorithm.minibatches, cfg.trainer.recompute = 1, "full"
    assert train_s(cfg, w, 8, 8) == pytest.approx(one * (6 + 2) / 6)
