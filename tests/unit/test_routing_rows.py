"""Routing replay's pure parts: a batch's routing rows from the rollouts, their padding, and
one router's replayed choice (its weights from its own scores, its agreement counted)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rl.batch import TrainBatch
from rl.controller.batch import routing_rows
from rl.engine.routing_replay import LayerReplay


def _rollout(prompt: int, out: int, routing: torch.Tensor | None) -> SimpleNamespace:
    return SimpleNamespace(prompt_ids=[1] * prompt, output_ids=[2] * out, routing=routing,
                           rid="r")  # fmt: skip


def test_each_rollouts_rows_from_its_first_position_and_unknown_after():
    a = torch.arange(4 * 2 * 2, dtype=torch.int8).view(4, 2, 2)  # 2 + 3 tokens: 4 inputs
    b = torch.ones(2, 2, 2, dtype=torch.int8)  # 1 + 2 tokens: 2 inputs
    out = routing_rows([_rollout(2, 3, a), _rollout(1, 2, b)], seq=6)
    assert out is not None and out.shape == (2, 6, 2, 2) and out.dtype == torch.int8
    assert torch.equal(out[0, :4], a) and (out[0, 4:] == -1).all()
    assert torch.equal(out[1, :2], b) and (out[1, 2:] == -1).all()
    assert routing_rows([_rollout(2, 3, None)], seq=6) is None


def test_a_rollout_whose_routing_does_not_fit_its_tokens_is_refused():
    with pytest.raises(ValueError, match=r"rollout r: routing \(5, 2, 2\), expected \(4, 2, 2\)"):
        routing_rows([_rollout(2, 3, torch.zeros(5, 2, 2, dtype=torch.int8))], seq=6)
    with pytest.raises(ValueError, match=r"routing None, expected"):
        routing_rows([_rollout(2, 3, torch.zeros(4, 2, 2)), _rollout(2, 3, None)], seq=6)


def test_padding_columns_leaves_routing_unknown():
    batch = TrainBatch(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3),
                       routing=torch.zeros(2, 3, 2, 2, dtype=torch.int8),
                       rewards=torch.ones(2))  # fmt: skip
    padded = batch.pad_columns(2)
    assert padded.tokens.shape == (2, 5) and (padded.tokens[:, 3:] == 0).all()
    assert padded.routing is not None and padded.routing.shape == (2, 5, 2, 2)
    assert (padded.routing[:, 3:] == -1).all() and (padded.routing[:, :3] == 0).all()
    assert padded.rewards is not None and padded.rewards.shape == (2,)


def _topk(scores, topk, num_groups=None, group_topk=None):
    return torch.topk(scores, k=topk, dim=1)


def test_a_router_takes_the_replayed_experts_weighted_by_its_own_scores():
    scores = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.4, 0.3, 0.2, 0.1], [0.7, 0.2, 0.05, 0.05]])
    replay = LayerReplay()
    replay.target = torch.tensor([[2, 3], [1, 0], [-1, -1]], dtype=torch.int8)
    probs, idx = replay.get_replay_topk(scores, 2, None, None, _topk)
    assert idx.tolist() == [[2, 3], [1, 0], [0, 1]]  # the last row unknown: its own
    assert torch.equal(probs, scores.gather(1, idx))
    assert replay.agree.tolist() == [1.0, 2.0]  # row 1 agrees as a set, row 0 does not
    replay.target = None
    assert replay.get_replay_topk(scores, 2, None, None, _topk)[1].tolist() == [
        [1, 2],
        [0, 1],
        [0, 1],
    ]
    replay.target = torch.zeros(2, 2, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"routing of shape \(2, 2\) for a router of \(3, 2\)"):
        replay.get_replay_topk(scores, 2, None, None, _topk)
