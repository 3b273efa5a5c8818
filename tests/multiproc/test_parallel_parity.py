"""Sharded training is real and exact: TP, PP and TP x DP match TP=1 from the same weights.

Every layout starts from one torch_dist checkpoint written by the TP=1 reference (so PP
stages, which would otherwise draw different initial weights, start identical) and trains
5 optimizer steps on the same batches. Losses and per-token log-probs must agree with the
reference to 1e-5, while each rank holds only its shard of the parameters.
"""

from __future__ import annotations

import pytest
import torch

from rl.runtime.launch import spawn
from tests.helpers.workers import random_batches, run_layout

STEPS = 5
BASE = ["trainer.micro_batch_size=2", "trainer.global_batch_size=8", "trainer.optim.lr=1e-3"]
BASE += ["trainer.optim.warmup_steps=0", "trainer.optim.decay_style=constant"]
TOL = 1e-5
# Log-probs also get a relative 1e-5: TP=2 sums row-parallel partial products in another
# order than TP=1 (and the order depends on the CPU's SIMD width), and Adam turns those
# ~1e-7 differences in near-zero gradients into ~3e-6 relative after one step. A wrong
# shard or layout shows up as errors of order 1e-1, far above this.
LOGPROB_RTOL = 1e-5


def _layout(tp: int, pp: int, dp: int) -> list[str]:
    return [*BASE, f"trainer.tp={tp}", f"trainer.pp={pp}", f"trainer.dp={dp}"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    init = str(tmp_path_factory.mktemp("ckpt") / "init")
    res = spawn(run_layout, 1, _layout(1, 1, 1), random_batches(STEPS), init)[0]
    return init, res


def test_reference_learns(reference):
    """The comparison means something only if the steps change the model."""
    _, ref = reference
    mask = random_batches(1)[0].loss_mask.bool()
    before, after = ref["logprobs"][0][mask].mean(), ref["logprobs"][-1][mask].mean()
    assert after > before + 0.02, (before, after)


RECOMPUTE_SP = ["trainer.recompute=full", "trainer.sequence_parallel=true"]


@pytest.mark.parametrize(
    ("tp", "pp", "dp", "extra"),
    [(2, 1, 1, []), (1, 2, 1, []), (2, 1, 2, []), (2, 1, 1, RECOMPUTE_SP)],
    ids=["tp2", "pp2", "tp2xdp2", "tp2-sp-recompute"],
)
def test_layout_matches_tp1(reference, tp: int, pp: int, dp: int, extra: list[str]):
    """With sequence parallelism and full recomputation as well: every layer's forward
    runs twice per micro-batch, and the numbers do not move."""
    init, ref = reference
    overrides = [*_layout(tp, pp, dp), *extra]
    out = spawn(run_layout, tp * pp * dp, overrides, random_batches(STEPS), None, init)
    micro = 8 // (2 * dp)  # global batch 8 in micro-batches of 2 rows
    for r in out:  # every rank reports the same numbers
        assert r["layout"] == (tp, pp, dp)
        assert r["sequence_parallel"] == bool(extra)
        assert r["mlp_forwards"] == STEPS * micro * (2 if extra else 1)
        assert ref["mlp_forwards"] == STEPS * 4
        torch.testing.assert_close(r["losses"], ref["losses"], atol=TOL, rtol=0)
        torch.testing.assert_close(r["grad_norms"], ref["grad_norms"], atol=1e-4, rtol=1e-5)
        assert len(r["logprobs"]) == STEPS + 1
        for got, want in zip(r["logprobs"], ref["logprobs"], strict=True):
            torch.testing.assert_close(got, want, atol=TOL, rtol=LOGPROB_RTOL)
    # The sharding is real: with TP or PP of 2 no rank holds more than ~half the model.
    total = ref["local_params"]
    for r in out:
        assert r["local_params"] < 0.6 * total, (r["local_params"], total)
