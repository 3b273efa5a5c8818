"""Token-budget micro-batching is exact: packing rows of different lengths into
micro-batches of at most N tokens (each trimmed to its longest row) gives the same
log-probs, loss, gradient norm and update as fixed ``micro_batch_size`` micro-batches,
on one rank and on two data-parallel ranks that run different numbers of micro-batches.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rl.batch import TrainBatch
from rl.engine.trainer import MegatronTrainer, pack_by_tokens, row_extents
from rl.runtime.launch import spawn
from tests.helpers.workers import budget_parity

SEQ = 24
# Rows 0-3 (DP rank 0) are long, rows 4-7 (DP rank 1) short: under a budget of 24 tokens
# rank 0 runs 3 micro-batches and rank 1 one. Extents (prompt + response): 13 7 20 8 5 3 6 4.
PROMPTS = [3, 5, 8, 4, 2, 2, 3, 2]
RESPONSES = [10, 2, 12, 4, 3, 1, 3, 2]
BASE = ["trainer.micro_batch_size=2", "trainer.global_batch_size=8", "trainer.optim.lr=1e-3"]
BASE += ["trainer.optim.warmup_steps=0", "trainer.optim.decay_style=constant", "trainer.tp=1"]
TOL = 1e-5


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    rows = len(PROMPTS)
    tokens = torch.zeros(rows, SEQ, dtype=torch.long)  # right padding with id 0
    mask = torch.zeros(rows, SEQ)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        tokens[i, : p + r] = torch.randint(3, 32, (p + r,), generator=g)
        mask[i, p - 1 : p - 1 + r] = 1.0  # index t scores token t+1
    # A per-row field: it must follow its rows through packing untouched.
    return TrainBatch(tokens, mask, rewards=torch.arange(rows).float())


def test_pack_by_tokens():
    lengths = [13, 7, 20, 8, 5, 3, 6, 4]
    groups = pack_by_tokens(lengths, 16)
    # Longest first; 20 > 16 still runs, alone.
    assert groups == [[2], [0], [1, 3], [4, 6], [5, 7]]
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups[1:]:
        assert len(g) * max(lengths[i] for i in g) <= 16
    assert pack_by_tokens(lengths, 1000) == [list(range(8))]
    assert pack_by_tokens([0, 0], 1) == [[0], [1]]  # empty rows still take one position
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        pack_by_tokens(lengths, 0)


def test_row_extents():
    b = _batch()
    assert row_extents(b) == [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    assert row_extents(TrainBatch(b.tokens)) == [SEQ] * len(PROMPTS)
    b.loss_mask[1] = 0.0  # nothing scored: the row needs no column
    assert row_extents(b)[1] == 0


def test_budget_refused_with_pipelining():
    # Checked before Megatron is touched, so no ranks are needed.
    tcfg = SimpleNamespace(max_tokens_per_microbatch=64)
    with pytest.raises(ValueError, match=r"trainer\.max_tokens_per_microbatch=64.*trainer\.pp"):
        MegatronTrainer(None, tcfg, SimpleNamespace(pp=2), total_steps=1)


@pytest.fixture(scope="module")
def single_rank() -> dict:
    # 16 tokens: micro-batches of 1, 1, 2, 2, 2 rows at widths 20 (over budget), 13, 8, 6, 4.
    return spawn(budget_parity, 1, BASE, _batch(), 16)[0]


def _check(res: dict, ref: dict) -> None:
    """``res`` (budgeted) against ``ref`` (micro_batch_size) on every column that scores
    a real token: a row of n tokens has n - 1. Its last column scores the padding after it
    (in a trimmed micro-batch the label wraps around instead); it is never counted."""
    for p, r, got_b, want_b, got_a, want_a in zip(
        PROMPTS, RESPONSES, res["before"], ref["before"], res["after"], ref["after"], strict=True
    ):
        n = p + r - 1
        torch.testing.assert_close(got_b[:n], want_b[:n], atol=1e-6, rtol=0)
        torch.testing.assert_close(got_a[:n], want_a[:n], atol=TOL, rtol=TOL)
    torch.testing.assert_close(res["loss"], ref["loss"], atol=TOL, rtol=TOL)
    torch.testing.assert_close(res["grad_norm"], ref["grad_norm"], atol=TOL, rtol=TOL)


def test_budget_matches_micro_batch_size_single_rank(single_rank: dict):
    out = single_rank
    assert out["budget"]["num_microbatches"] == 5 and out["plain"]["num_microbatches"] == 4
    mask = _batch().loss_mask.bool()
    learned = out["plain"]["after"][mask].mean() - out["plain"]["before"][mask].mean()
    assert learned > 0.01, learned  # the step changed the model: the comparison means something
    _check(out["budget"], out["plain"])


def test_budget_matches_with_unequal_microbatch_counts_over_dp(single_rank: dict):
    one = single_rank["plain"]
    ranks = spawn(budget_parity, 2, [*BASE, "trainer.dp=2"], _batch(), 24)
    assert [r["budget"]["dp"] for r in ranks] == [2, 2]
    assert [r["budget"]["num_microbatches"] for r in ranks] == [3, 1]
    for r in ranks:
        _check(r["budget"], r["plain"])
        _check(r["budget"], one)  # and DP=2 matches one rank
