"""Controller logic without processes: batch assembly and the staleness bound (ms)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rl.controller.batch import build_batch
from rl.controller.staleness import StalenessGate


def _r(prompt, out, logprobs=None, versions=None):
    return SimpleNamespace(
        prompt_ids=prompt,
        output_ids=out,
        logprobs=logprobs or [-0.5] * len(out),
        versions=versions or [3] * len(out),
        rid="t",
    )


def test_batch_alignment_and_padding():
    g = [[_r([1, 5, 6], [7, 2], [-0.1, -0.2], [4, 5]), _r([1, 5, 6], [8], [-0.3], [5])]]
    b = build_batch(g, [[1.0, 0.0]], normalize_std=False, pad_id=0)
    assert b["tokens"].tolist() == [[1, 5, 6, 7, 2], [1, 5, 6, 8, 0]]
    # index t scores token t+1: the response starts predicting at the prompt's last index
    assert b["loss_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 0, 1, 0, 0]]
    torch.testing.assert_close(
        b["behaviour_logprobs"], torch.tensor([[0, 0, -0.1, -0.2, 0], [0, 0, -0.3, 0, 0]])
    )
    assert b["versions"].tolist() == [[-1, -1, 4, 5, -1], [-1, -1, 5, -1, -1]]
    torch.testing.assert_close(
        b["advantages"], torch.tensor([[0, 0, 0.5, 0.5, 0], [0, 0, -0.5, 0, 0]])
    )
    assert b["rewards"].tolist() == [1.0, 0.0]


def test_batch_fixed_length_and_errors():
    g = [[_r([1, 2], [3]), _r([1, 2], [4])]]
    assert build_batch(g, [[1, 0]], seq_len=6)["tokens"].shape == (2, 6)
    with pytest.raises(ValueError, match="seq_len=2 is shorter"):
        build_batch(g, [[1, 0]], seq_len=2)
    with pytest.raises(ValueError, match="same number of samples"):
        build_batch([[_r([1], [2])], [_r([1], [2]), _r([1], [3])]], [[1], [1, 0]])
    bad = _r([1], [2, 3], [-0.1], [1, 1])
    with pytest.raises(ValueError, match="2 tokens, 1 log-probs"):
        build_batch([[bad, _r([1], [2])]], [[1, 0]])


def test_drop_mode_counts_and_histogram():
    gate = StalenessGate(max_lag=1, mode="drop")
    assert gate.admit([5, 5], trainer_version=5)  # lag 0
    assert gate.admit([4, 5], trainer_version=5)  # partial rollout: oldest token counts
    assert not gate.admit([3, 5], trainer_version=5)  # lag 2 > 1
    assert gate.dropped == 1 and gate.histogram == {0: 1, 1: 1}
    with pytest.raises(ValueError, match="newer than the trainer"):
        gate.admit([6], trainer_version=5)


def test_throttle_mode_bounds_the_queue_instead():
    gate = StalenessGate(max_lag=2, mode="throttle")
    assert gate.may_start(0) and gate.may_start(1) and not gate.may_start(2)
    assert gate.admit([1], trainer_version=5)  # throttled at the source, never dropped
    assert gate.dropped == 0
    assert StalenessGate(max_lag=0, mode="drop").may_start(10)


@pytest.mark.parametrize("k,mode,match", [(-1, "drop", "max_policy_lag=-1"), (1, "wait", "stale")])
def test_bad_settings(k, mode, match):
    with pytest.raises(ValueError, match=match):
        StalenessGate(max_lag=k, mode=mode)
