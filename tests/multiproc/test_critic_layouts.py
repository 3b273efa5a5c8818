"""A critic (a scalar-head model trained with the clipped value loss) at TP=2 and PP=2 gives
TP=1's values after three steps, from TP=1's initial checkpoint: the head is replicated
over TP ranks, lives on the last pipeline stage, and is saved and loaded across layouts."""

from __future__ import annotations

import pytest
import torch

from rl.batch import TrainBatch
from rl.runtime.launch import spawn
from tests.helpers.workers import critic_steps, random_batches

STEPS = 3
BASE = ["model.architecture=LlamaForSequenceClassification", "trainer.micro_batch_size=2",
        "trainer.global_batch_size=8", "trainer.optim.lr=1e-4", "trainer.optim.warmup_steps=0",
        "trainer.optim.decay_style=constant", "trainer.tp=1", "trainer.pp=1",
        "trainer.dp=1"]  # fmt: skip


def _batches() -> list[TrainBatch]:
    """One batch, three times (a batch's epochs): old values near 0, returns about 1 away."""
    g = torch.Generator().manual_seed(3)
    (b,) = random_batches(1)
    values = 0.1 * torch.randn(b.tokens.shape, generator=g)
    returns = values + torch.randn(b.tokens.shape, generator=g)
    return [TrainBatch(b.tokens, b.loss_mask, values=values, returns=returns)] * STEPS


@pytest.fixture(scope="module")
def init(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("critic") / "init")


@pytest.fixture(scope="module")
def tp1(init: str) -> dict:
    return spawn(critic_steps, 1, BASE, _batches(), 0.2, init, True)[0]


def test_the_critic_learns_its_returns(tp1: dict) -> None:
    assert tp1["losses"][-1] < tp1["losses"][0]
    assert 0 < max(tp1["clipfrac"]) <= 1  # the clip was reached and counted
    assert not torch.equal(tp1["values"][0], tp1["values"][1])


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_values_at_tp2_and_pp2_equal_tp1s_after_three_steps(
    tp1: dict, init: str, layout: str
) -> None:
    extra = ["trainer.tp=2"] if layout == "tp2" else ["trainer.pp=2"]
    for r in spawn(critic_steps, 2, BASE + extra, _batches(), 0.2, init, False):
        assert r["losses"] == pytest.approx(tp1["losses"], rel=1e-5, abs=1e-6)
        for got, want in zip(r["values"], tp1["values"], strict=True):
            assert (got - want).abs().max() < 1e-5


def test_packed_values_equal_the_padded_paths(tp1: dict, init: str) -> None:
    """The critic's values and losses with packed micro-batches (tp1, the default) equal the
    right-padded reference's on every position a row has: the batch's mask leaves each
    row's last column unscored, and a packed row is cut one past its last scored token."""
    (padded,) = spawn(critic_steps, 1, [*BASE, "trainer.packing=false"], _batches(), 0.2, init,
                      False)  # fmt: skip
    assert padded["losses"] == pytest.approx(tp1["losses"], rel=1e-5, abs=1e-6)
    scored = _batches()[0].loss_mask.bool()
    for got, want in zip(padded["values"], tp1["values"], strict=True):
        assert (got - want)[scored].abs().max() < 1e-5
