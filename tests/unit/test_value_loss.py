"""The critic's clipped value loss, by hand on a few tokens."""

from __future__ import annotations

import pytest
import torch

from rl.algorithms.value_loss import clipped_value_loss
from rl.batch import TrainBatch


def _mb(old: list[float], returns: list[float], mask: list[float]) -> TrainBatch:
    n = len(old)
    return TrainBatch(
        torch.zeros(1, n, dtype=torch.long),
        torch.tensor([mask]),
        values=torch.tensor([old]),
        returns=torch.tensor([returns]),
    )


def test_unclipped_is_half_the_squared_error_over_the_mask():
    mb = _mb([0.0, 0.0, 0.0], [1.0, -2.0, 5.0], [1.0, 1.0, 0.0])
    v = torch.tensor([[0.5, 0.0, 0.0]])
    out = clipped_value_loss(None)(v, mb)
    assert out.loss_sum.item() == pytest.approx(0.5 * (0.25 + 4.0))
    assert out.num_tokens.item() == 2
    assert "vf_clipfrac" not in out.stats


def test_the_clip_takes_the_pessimistic_error_and_stops_the_gradient_past_it():
    # Token 0 moved 0.5 from its old value 0 toward the return 1: clipped at 0.2, the
    # clipped error 0.64 exceeds the plain 0.25, and no gradient passes the clamp.
    # Token 1 moved 0.5 away from the return: the plain error 2.25 is the larger one.
    mb = _mb([0.0, 0.0], [1.0, 1.0], [1.0, 1.0])
    v = torch.tensor([[0.5, -0.5]], requires_grad=True)
    out = clipped_value_loss(0.2)(v, mb)
    assert out.loss_sum.item() == pytest.approx(0.5 * (0.64 + 2.25))
    assert out.stats["vf_clipfrac"].item() == 1.0
    out.loss_sum.backward()
    assert v.grad is not None
    assert v.grad[0, 0].item() == 0.0  # past the clip: no pull
    assert v.grad[0, 1].item() == pytest.approx(-1.5)  # 0.5 * 2 * (v - R)


def test_within_the_clip_it_is_the_plain_loss():
    mb = _mb([0.0], [1.0], [1.0])
    v = torch.tensor([[0.1]])
    assert clipped_value_loss(0.2)(v, mb).loss_sum.item() == pytest.approx(0.5 * 0.81)


@pytest.mark.parametrize("clip", [0.0, -1.0])
def test_a_clip_that_is_not_positive_is_refused(clip: float):
    with pytest.raises(ValueError, match=rf"critic.clip={clip} must be > 0 \(or null: no clip\)"):
        clipped_value_loss(clip)


def test_a_batch_without_returns_is_refused_naming_the_field():
    mb = TrainBatch(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2), values=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="the batch has no returns"):
        clipped_value_loss(0.2)(torch.zeros(1, 2), mb)
