"""Packed micro-batches and context parallelism change no number the trainer gives.

From the same initial weights, one optimizer step on a batch of uneven rows gives the same
log-probs (before and after the step), loss and gradient norm whether the rows are
right-padded (``trainer.packing=false``, the reference) or packed, with or without a token
budget, at TP=1, TP=2 with sequence parallelism, PP=2, DP=2 (ranks running different
numbers of micro-batches), EP=2 with routing replay, with LoRA; and with context
parallelism, CP=2 and TP=2 x CP=2 against one rank. Each property is shown able to fail:
a row attending across its boundary, positions restarted at the wrong token, the wrong
zigzag chunks.

Tolerances (fp32): log-probs before the step 1e-6 (the same sums, in other shapes); after
it 2e-5, since Adam's first step moves each weight by about lr whatever its gradient's
size, so a rounding-level gradient difference is magnified; the loss and grad norm 1e-5
relative.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rl.batch import TrainBatch
from rl.engine.trainer import MegatronTrainer, pack_by_tokens, row_extents
from rl.runtime.launch import spawn
from tests.helpers.workers import variant_steps

SEQ = 24
# Rows 0-3 (DP rank 0) are long, rows 4-7 (DP rank 1) short: under a budget of 24 tokens
# rank 0 runs more micro-batches than rank 1. Extents (prompt + response): 13 7 20 8 5 3 6 4.
PROMPTS = [3, 5, 8, 4, 2, 2, 3, 2]
RESPONSES = [10, 2, 12, 4, 3, 1, 3, 2]
BASE = ["trainer.micro_batch_size=2", "trainer.global_batch_size=8", "trainer.optim.lr=1e-3"]
BASE += ["trainer.optim.warmup_steps=0", "trainer.optim.decay_style=constant", "trainer.tp=1"]
PADDED = ["trainer.packing=false"]
PACKED = ["trainer.packing=true"]
LORA = ["trainer.lora.rank=4", "trainer.lora.alpha=8"]
BEFORE, AFTER, TOL = 1e-6, 2e-5, 1e-5


def _batch(routing: bool = False) -> TrainBatch:
    g = torch.Generator().manual_seed(7)
    rows = len(PROMPTS)
    tokens = torch.zeros(rows, SEQ, dtype=torch.long)  # right padding with id 0
    mask = torch.zeros(rows, SEQ)
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        tokens[i, : p + r] = torch.randint(3, 32, (p + r,), generator=g)
        mask[i, p - 1 : p - 1 + r] = 1.0  # index t scores token t+1
    # tiny_moe's routing (2 layers, top-2 of 4 experts), -1 (unknown) on the padding
    route = None
    if routing:
        route = torch.rand(rows, SEQ, 2, 4, generator=g).argsort(-1)[..., :2].to(torch.int8)
        route[tokens == 0] = -1
    # A per-row field: it must follow its rows through packing untouched.
    return TrainBatch(tokens, mask, rewards=torch.arange(rows).float(), routing=route)


def _close(got: dict, want: dict) -> None:
    """``got`` against ``want`` on every column that scores a real token (a row of n
    tokens has n - 1; its last column scores past it and is never counted)."""
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
        n = p + r - 1
        torch.testing.assert_close(got["before"][i, :n], want["before"][i, :n], atol=BEFORE, rtol=0)
        torch.testing.assert_close(got["after"][i, :n], want["after"][i, :n], atol=AFTER, rtol=0)
    assert got["loss"] == pytest.approx(want["loss"], rel=TOL)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=TOL)


def _differs(got: dict, want: dict) -> float:
    mask = _batch().loss_mask.bool()
    return float((got["before"] - want["before"])[mask].abs().max())


def test_pack_by_tokens():
    lengths = [13, 7, 20, 8, 5, 3, 6, 4]
    groups = pack_by_tokens(lengths, 16)
    # Longest first; 20 > 16 still runs, alone.
    assert groups == [[2], [0], [1, 3], [4, 6], [5, 7]]
    for g in groups[1:]:
        assert len(g) * max(lengths[i] for i in g) <= 16
    with pytest.raises(ValueError, match="max_tokens_per_microbatch"):
        pack_by_tokens(lengths, 0)


def test_row_extents():
    b = _batch()
    assert row_extents(b) == [p + r for p, r in zip(PROMPTS, RESPONSES, strict=True)]
    assert row_extents(TrainBatch(b.tokens)) == [SEQ] * len(PROMPTS)
    b.loss_mask[1] = 0.0  # nothing scored: the row needs no column
    assert row_extents(b)[1] == 0


def test_padded_budget_refused_with_pipelining():
    # Checked before Megatron is touched, so no ranks are needed.
    tcfg = SimpleNamespace(max_tokens_per_microbatch=64, packing=False)
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch=64.*trainer\.pp"):
        MegatronTrainer(None, tcfg, SimpleNamespace(pp=2), total_steps=1)


@pytest.fixture(scope="module")
def one_rank() -> dict:
    variants = {
        "padded": PADDED,
        "padded_budget": [*PADDED, "trainer.max_tokens_per_microbatch=16"],
        "packed": PACKED,
        "packed_budget": [*PACKED, "trainer.max_tokens_per_microbatch=16"],
        "lora_padded": [*PADDED, *LORA],
        "lora_packed": [*PACKED, *LORA],
        "cross": PACKED,
        "positions": PACKED,
    }
    mutate = {"cross": "cross", "positions": "positions"}
    return spawn(variant_steps, 1, BASE, _batch(), variants, mutate)[0]


def test_packed_equals_padded_on_one_rank(one_rank: dict):
    ref, mask = one_rank["padded"], _batch().loss_mask.bool()
    assert (ref["after"] - ref["before"])[mask].mean() > 0.01  # the step learned something
    for name in ("padded_budget", "packed", "packed_budget"):
        _close(one_rank[name], ref)
    # micro_batch_size rows each; under 16 tokens: 20 alone, 13+3, 8+7, 6+5+4
    assert one_rank["packed"]["num_microbatches"] == 4
    assert one_rank["packed_budget"]["num_microbatches"] == 4
    assert one_rank["padded_budget"]["num_microbatches"] == 5
    _close(one_rank["lora_packed"], one_rank["lora_padded"])
    # LoRA starts as the base (B = 0) and then trains its adapters only: another step
    assert (one_rank["lora_padded"]["after"] - ref["after"])[mask].abs().max() > 1e-3


@pytest.mark.parametrize("bug", ["cross", "positions"])
def test_the_parity_fails_when_packing_is_wrong(one_rank: dict, bug: str):
    assert _differs(one_rank[bug], one_rank["padded"]) > 1e-3


@pytest.mark.parametrize(
    "layout",
    [["trainer.tp=2", "trainer.sequence_parallel=true"], ["trainer.pp=2"]],
    ids=["tp2-sp", "pp2"],
)
def test_packed_equals_padded_at_tp2_sp_and_pp2(one_rank: dict, layout: list[str]):
    variants = {"padded": PADDED, "packed": PACKED,
                "packed_budget": [*PACKED, "trainer.max_tokens_per_microbatch=16"]}  # fmt: skip
    for r in spawn(variant_steps, 2, [*BASE, *layout], _batch(), variants):
        if "trainer.tp=2" in layout:  # TP builds the same weights as one rank (PP does not)
            _close(r["padded"], one_rank["padded"])
        _close(r["packed"], r["padded"])
        _close(r["packed_budget"], r["padded"])


def test_unequal_microbatch_counts_over_dp(one_rank: dict):
    variants = {"padded": [*PADDED, "trainer.max_tokens_per_microbatch=24"],
                "packed": [*PACKED, "trainer.max_tokens_per_microbatch=24"]}  # fmt: skip
    ranks = spawn(variant_steps, 2, [*BASE, "trainer.dp=2"], _batch(), variants)
    assert [r["padded"]["num_microbatches"] for r in ranks] == [3, 1]
    assert [r["packed"]["num_microbatches"] for r in ranks] == [3, 1]  # 20, 13+8, 7 | 5+3+6+4
    for r in ranks:
        _close(r["padded"], one_rank["padded"])
        _close(r["packed"], one_rank["padded"])


@pytest.mark.parametrize(
    "layout",
    [["trainer.dp=2", "trainer.ep=2"], ["trainer.tp=2", "trainer.sequence_parallel=true"]],
    ids=["ep2", "tp2-sp"],
)
def test_moe_packed_equals_padded_with_routing_replay(layout: list[str]):
    # Without the load-balancing loss: it counts every token routed, padding included, and
    # the two paths route different padding (none packed at TP=1, one token at TP=2).
    moe = ["model=tiny_moe", "model.moe_aux_loss_coeff=0", *layout]
    variants = {"padded": PADDED, "packed": PACKED}
    for r in spawn(variant_steps, 2, [*BASE, *moe], _batch(routing=True), variants):
        _close(r["packed"], r["padded"])


@pytest.fixture(scope="module")
def cp2() -> list[dict]:
    variants = {"cp": [], "again": [], "zigzag": []}
    return spawn(
        variant_steps, 2, [*BASE, "trainer.cp=2"], _batch(), variants, {"zigzag": "zigzag"}
    )


def test_cp2_equals_one_rank_and_repeats_bit_for_bit(one_rank: dict, cp2: list[dict]):
    for r in cp2:
        _close(r["cp"], one_rank["padded"])
        for key in ("before", "after"):
            assert torch.equal(r["again"][key], r["cp"][key])
        assert (r["again"]["loss"], r["again"]["grad_norm"]) == (
            r["cp"]["loss"],
            r["cp"]["grad_norm"],
        )


def test_cp2_fails_with_the_wrong_zigzag_chunks(cp2: list[dict]):
    assert _differs(cp2[0]["zigzag"], cp2[0]["cp"]) > 1e-3


def test_tp2_cp2_equals_one_rank(one_rank: dict):
    layout = ["trainer.tp=2", "trainer.sequence_parallel=true", "trainer.cp=2"]
    for r in spawn(variant_steps, 4, [*BASE, *layout], _batch(), {"cp": []}):
        _close(r["cp"], one_rank["padded"])
