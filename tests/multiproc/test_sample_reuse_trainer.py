"""Sample reuse in the Megatron trainer (MegatronTrainer.train_batch): two epochs of two
minibatches take four optimizer steps on one RL batch; the train/rollout mismatch is
measured at pi_old, apart from the policy's own move; and two data-parallel ranks cut the
same minibatches as one rank, so they end on the same weights. A sequence-level loss
aggregation (GSPO's) divides by the batch's sequences, wherever its rows were trained."""

from __future__ import annotations

import pytest
import torch

from rl.batch import TrainBatch
from rl.runtime.launch import spawn
from tests.helpers.workers import reuse_steps

ROWS, SEQ, PROMPT = 8, 16, 4
BASE = ["trainer.tp=1", "trainer.micro_batch_size=2", "trainer.global_batch_size=8",
        "trainer.optim.lr=1e-2", "trainer.optim.warmup_steps=0",
        "trainer.optim.decay_style=constant", "algorithm=grpo"]  # fmt: skip


def _batch() -> TrainBatch:
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(3, 32, (ROWS, SEQ), generator=g)
    mask = torch.zeros(ROWS, SEQ)
    mask[:, PROMPT - 1 : SEQ - 1] = 1.0  # the response's tokens (index t scores t+1)
    adv = torch.tensor([1.0, -1.0] * (ROWS // 2))[:, None].expand(ROWS, SEQ).contiguous()
    return TrainBatch(tokens, mask, advantages=adv * mask)


@pytest.fixture(scope="module")
def one_rank() -> dict:
    return spawn(reuse_steps, 1, BASE, _batch(), 2, 2)[0]


def test_two_epochs_of_two_minibatches_take_four_steps(one_rank: dict):
    m = one_rank["metrics"]
    assert one_rank["step"] == 4 and m["updates"] == 4
    # Sampled by pi_old itself: no train/rollout mismatch, however far the updates move pi.
    assert m["mismatch_abs_logp"] < 1e-6, m
    assert m["policy_change_abs_logp"] > 1e-3, m
    assert m["truncated_frac"] > 0, m  # the clip acted on the moved policy
    # The steps climbed the objective: sum of A * log pi rose.
    adv = _batch().advantages
    assert (adv * one_rank["after"]).sum() > (adv * one_rank["before"]).sum() + 1.0


def test_data_parallel_ranks_cut_the_same_minibatches(one_rank: dict):
    ranks = spawn(reuse_steps, 2, [*BASE, "trainer.dp=2"], _batch(), 2, 2)
    for r in ranks:
        assert r["step"] == 4
        torch.testing.assert_close(r["after"], one_rank["after"], atol=1e-5, rtol=1e-5)
        for k in ("loss", "policy_change_abs_logp", "truncated_frac"):
            assert r["metrics"][k] == pytest.approx(one_rank["metrics"][k], rel=1e-4, abs=1e-6)


def _ragged(scaled: bool = False) -> TrainBatch:
    """Responses of 1 to 12 tokens, advantages +-1; ``scaled``: each row's advantage times
    T / (N * |y_i|), which makes the token mean's gradient the sequence mean's."""
    lengths = torch.tensor([1, 12, 3, 9, 5, 2, 11, 7])
    b = _batch()
    mask = torch.zeros(ROWS, SEQ)
    for i, n in enumerate(lengths.tolist()):
        mask[i, PROMPT - 1 : PROMPT - 1 + n] = 1.0
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, 1.0, -1.0, -1.0])
    if scaled:
        adv = adv * lengths.sum() / (ROWS * lengths)
    return TrainBatch(b.tokens, mask, advantages=adv[:, None] * mask)


def test_a_sequence_mean_is_over_the_whole_batch_at_any_dp():
    """GSPO on its own policy (ratio 1, its default seq_mean_token_mean): the gradient is
    (1/N) sum_i (A_i/|y_i|) sum_t grad log pi, at DP=1 and at DP=2, where each rank holds
    half the sequences (its micro-batches' denominators are summed by Megatron), and the
    same as the token mean's with each advantage scaled by T / (N |y_i|)."""
    gspo = [*BASE[:-1], "algorithm/objective=gspo", "algorithm/correction=none"]
    one = spawn(reuse_steps, 1, gspo, _ragged(), 1, 1)[0]
    two = spawn(reuse_steps, 2, [*gspo, "trainer.dp=2"], _ragged(), 1, 1)
    pg = [*BASE[:-1], "algorithm/correction=none", "algorithm.loss_agg=token_mean"]
    token = spawn(reuse_steps, 1, pg, _ragged(scaled=True), 1, 1)[0]
    assert one["metrics"]["seq_is_ratio"] == pytest.approx(1.0, abs=1e-5)
    norm = one["metrics"]["grad_norm"]
    for r, tol in [*((r, 1e-5) for r in two), (token, 1e-4)]:
        assert r["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-4)
        # The token mean reaches the same gradient by other sums: its rounding differs, and
        # Adam's first step at lr 1e-2 moves a weight by about lr whatever its gradient's
        # size (measured: 7.6e-5 packed, 2.2e-5 padded; the DP=2 run: 1.4e-6).
        torch.testing.assert_close(r["after"], one["after"], atol=tol, rtol=1e-5)
