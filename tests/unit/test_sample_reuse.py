"""Sample reuse's minibatches and metrics (rl/algorithms/reuse.py), pure logic. The losses
on a policy that moved within a batch: tests/unit/test_rl_losses.py; the trainer taking
the steps: tests/multiproc/test_sample_reuse_trainer.py."""

from __future__ import annotations

import pytest
import torch

from rl.algorithms.reuse import Reuse, combine
from rl.config import ConfigError
from rl.config.schema import RootConfig
from rl.config.validate import validate_algorithm, validate_rl


def test_each_epoch_is_a_fresh_permutation_cut_into_equal_minibatches():
    r = Reuse(epochs=3, minibatches=4, seed=7)
    parts = r.minibatch_rows(16, step=5)
    assert len(parts) == r.updates == 12 and all(len(p) == 4 for p in parts)
    epochs = [torch.cat(parts[i : i + 4]) for i in range(0, 12, 4)]
    for e in epochs:
        assert sorted(e.tolist()) == list(range(16))  # every row once per epoch
    assert not torch.equal(epochs[0], epochs[1])  # reshuffled
    # Every rank, and a resumed run, cuts the same minibatches for the same step.
    again = Reuse(epochs=3, minibatches=4, seed=7).minibatch_rows(16, step=5)
    assert all(torch.equal(a, b) for a, b in zip(parts, again, strict=True))
    other = r.minibatch_rows(16, step=6)
    assert not all(torch.equal(a, b) for a, b in zip(parts, other, strict=True))


def test_one_update_takes_the_batch_as_it_is():
    assert [p.tolist() for p in Reuse().minibatch_rows(6, step=1)] == [list(range(6))]


def test_bad_reuse_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"algorithm.epochs=0 must be an integer >= 1"):
        Reuse(epochs=0)
    with pytest.raises(ValueError, match=r"6 rows does not split into algorithm.minibatches=4"):
        Reuse(minibatches=4).minibatch_rows(6, step=0)
    cfg = RootConfig()
    cfg.algorithm.minibatches = 0
    with pytest.raises(ConfigError, match=r"^algorithm.minibatches=0 must be an integer >= 1$"):
        validate_algorithm(cfg.algorithm)
    cfg.algorithm.minibatches, cfg.rl.steps = 3, 1  # 16 prompts x 8 = 128 rows
    with pytest.raises(ConfigError, match=r"^algorithm.minibatches=3 does not cut the batch"):
        validate_rl(cfg)


def test_combined_metrics_weight_loss_stats_by_tokens():
    a = {"loss": 1.0, "mismatch_abs_logp": 0.0, "grad_norm": 2.0, "lr": 1e-3,
         "num_tokens": 10.0, "step_seconds": 1.0, "skipped": 0.0, "tokens_per_s": 100.0,
         "moe_aux_loss": 1.0}  # fmt: skip
    b = {"loss": 4.0, "mismatch_abs_logp": 0.3, "grad_norm": 4.0, "lr": 2e-3,
         "num_tokens": 30.0, "step_seconds": 3.0, "skipped": 1.0, "tokens_per_s": 20.0,
         "moe_aux_loss": 3.0}  # fmt: skip
    m = combine([a, b], epochs=2)
    assert m["loss"] == pytest.approx((10 * 1 + 30 * 4) / 40)
    assert m["mismatch_abs_logp"] == pytest.approx(30 * 0.3 / 40)
    assert m["grad_norm"] == 3.0 and m["moe_aux_loss"] == 2.0 and m["lr"] == 2e-3
    assert m["step_seconds"] == 4.0 and m["skipped"] == 1.0 and m["updates"] == 2.0
    assert m["num_tokens"] == 20.0  # one pass of two
    assert m["tokens_per_s"] == pytest.approx((100 + 60) / 4)
    assert combine([a]) == {**a, "updates": 1.0}
