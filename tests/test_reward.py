"""The reward executor: correct scores, and a scorer that raises, hangs or dies costs
that one item (reward 0, counted) and nothing else."""

from __future__ import annotations

import time

import pytest

from rl.reward.executor import RewardExecutor
from rl.reward.scorers import boxed_math, exact_answer, resolve


def test_exact_answer():
    assert exact_answer(" 042", "042") == 1.0
    assert exact_answer("041", "042") == 0.0


@pytest.mark.parametrize(
    "response,answer,want",
    [
        ("so the answer is \\boxed{42.0}", "\\boxed{42}", 1.0),
        ("\\boxed{\\frac{1}{2}}", "\\boxed{0.5}", 1.0),
        ("\\boxed{43}", "\\boxed{42}", 0.0),
        ("no answer at all", "\\boxed{42}", 0.0),
    ],
)
def test_boxed_math(response, answer, want):
    assert boxed_math(response, answer) == want


def test_unknown_scorer_fails_before_any_process():
    with pytest.raises(ValueError, match="scorer 'nope'"):
        RewardExecutor("nope")
    with pytest.raises(ValueError, match="cannot be imported"):
        resolve("no_such_module:f")


def test_batch_scores_in_order():
    with RewardExecutor("exact", workers=2) as ex:
        got = ex.score([("1", "1"), ("2", "3"), ("4", "4"), ("5", "6")])
    assert got == [1.0, 0.0, 1.0, 0.0]
    assert ex.stats.scored == 4 and ex.stats.failures == 0


def test_raising_hanging_and_dying_scorers_cost_one_item_each():
    with RewardExecutor("reward_scorers:flaky", workers=2, timeout_s=1.0) as ex:
        t0 = time.monotonic()
        got = ex.score([("a", "a"), ("boom", "x"), ("hang", "x"), ("die", "x"), ("b", "b")])
        elapsed = time.monotonic() - t0
        assert got == [1.0, 0.0, 0.0, 0.0, 1.0]
        assert ex.stats.failures == 2  # the exception and the dead worker
        assert ex.stats.timeouts == 1
        assert elapsed < 20  # the hang cost its timeout, not its 60 s
        # Still serving afterwards, with replaced workers.
        assert ex.score([("c", "c")]) == [1.0]
