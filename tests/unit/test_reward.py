"""Reward functions and their executor: built-ins score hand-made cases right, user
functions load by dotted path or file, bad specs fail in one line before launch, and a
function that raises, returns garbage, hangs or dies costs that one item (a failed 0,
counted) and nothing else."""

from __future__ import annotations

import pytest

from rl.reward.executor import RewardExecutor
from rl.tasks.scoring import (
    RewardFnError,
    RewardValueError,
    ScoreResult,
    call,
    check,
    exact,
    gsm8k,
    last_boxed,
    last_number,
    load,
    math_verify,
)
from tests.helpers.reward_scorers import item


# ---------------------------------------------------------------------- built-ins
def test_exact():
    assert exact("p", " 042\n", "042", {}) == 1.0
    assert exact("p", "42", 42, {}) == 1.0
    assert exact("p", "041", "042", {}) == 0.0


@pytest.mark.parametrize(
    "text,boxed,number",
    [
        ("so \\boxed{\\frac{1}{2}} is it", "\\frac{1}{2}", "2"),
        ("first \\boxed{1}, then \\boxed{ {2} }", " {2} ", "2"),
        ("unclosed \\boxed{3} and \\boxed{4", "3", "4"),
        ("it costs 1,234,567 dollars", None, "1234567"),
        ("from 3 down to -12.5.", None, "-12.5"),
        ("x2 and 3-5 and 1.2.3 and .75", None, ".75"),
        ("no answer at all", None, None),
    ],
)
def test_answer_extraction(text, boxed, number):
    assert last_boxed(text) == boxed
    assert last_number(text) == number


@pytest.mark.parametrize(
    "response,label,want",
    [
        ("so the answer is \\boxed{42.0}", "\\boxed{42}", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{1} at first, but \\boxed{2}", 2, 1.0),  # the last box counts
        ("The total is 1,234.", 1234, 1.0),  # no box: the last number, commas removed
        ("It drops by 7 to -3", "-3", 1.0),
        ("about 2.50 each", 2.5, 1.0),
        ("\\boxed{x^2 + 1}", "1 + x^2", 1.0),
        ("\\boxed{43}", "\\boxed{42}", 0.0),
        ("it is 41", 42, 0.0),
        ("no answer at all", "42", 0.0),
    ],
)
def test_math_verify(response, label, want):
    assert math_verify("prompt", response, label, {}) == want


@pytest.mark.parametrize(
    "response,label,want",
    [
        ("3 + 4 = 7\n#### 7", "She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7", 1.0),
        ("So it is $1,234.", "#### 1,234", 1.0),  # no ####: the last number; $ and commas
        ("#### 18\nThat took 3 steps.", 18, 1.0),  # the number right after the last ####
        ("#### 5 no wait\n#### -5", "-5", 1.0),
        ("the price is 0.50", "#### .5", 1.0),
        ("#### 72.00", "72", 1.0),
        ("#### 71", "#### 72", 0.0),
        ("#### 72 or so? 73", "73", 0.0),
        ("no number", "#### 72", 0.0),
    ],
)
def test_gsm8k(response, label, want):
    assert gsm8k("prompt", response, label, {}) == want


# ---------------------------------------------------------------------- user functions
def test_user_fn_by_dotted_path_with_metrics():
    fn = load("tests.helpers.reward_scorers:with_metrics")
    got = call(fn, item("<a>", "<a>", weight=2))
    assert got == ScoreResult(1.0, {"length": 3.0, "formatted": 1.0, "weight": 2.0})
    assert call(fn, item("b", "a")).score == 0.0
    star_args = load("tests.helpers.reward_scorers:star_args")  # *args is fine
    assert call(star_args, item("a", "a")).score == 1.0


def test_user_fn_by_file_path(tmp_path, monkeypatch):
    rewards = tmp_path / "my rewards.py"
    rewards.write_text(
        "from dataclasses import dataclass\n\n"
        "@dataclass\n"
        "class Cfg:\n"
        "    bonus: float = 0.5\n\n"
        "def length_bonus(prompt, response, label, metadata):\n"
        "    return {'score': float(response == label), 'bonus': Cfg().bonus}\n"
    )
    absolute = load(f"{rewards}:length_bonus")
    assert call(absolute, item("a", "a")) == ScoreResult(1.0, {"bonus": 0.5})
    monkeypatch.chdir(tmp_path)
    assert call(load("my rewards.py:length_bonus"), item("a", "b")).score == 0.0
    assert call(load("./my rewards.py:length_bonus"), item("b", "b")).score == 1.0


@pytest.mark.parametrize(
    "value,want",
    [
        (1, ScoreResult(1.0, {})),
        (True, ScoreResult(1.0, {})),  # a pass/fail check counts as 1/0
        (-0.5, ScoreResult(-0.5, {})),  # user functions are not clipped to [0, 1]
        ({"score": 0.25, "n": 3}, ScoreResult(0.25, {"n": 3.0})),
    ],
)
def test_call_accepts_numbers_and_dicts_with_score(value, want):
    assert call(lambda p, r, lab, m: value, item("x")) == want


@pytest.mark.parametrize(
    "value,fragment",
    [
        ("1.0", "str '1.0', not a number"),
        (None, "NoneType None, not a number"),
        (float("nan"), "nan, not a finite number"),
        (float("inf"), "inf, not a finite number"),
        ({"n": 1}, "without 'score'"),
        ({"score": "high"}, "'score' is str"),
        ({"score": 1.0, "note": "ok"}, "metric 'note' is str"),
        ([1.0], "list"),
    ],
)
def test_call_rejects_values_that_are_not_scores(value, fragment):
    with pytest.raises(RewardValueError) as e:
        call(lambda p, r, lab, m: value, item("x"))
    assert fragment in str(e.value)


@pytest.mark.parametrize(
    "spec,fragment",
    [
        ("regex", "not a built-in (exact, gsm8k, math_verify, env), judge"),
        ("tests.helpers.reward_scorers:", "not a built-in"),
        (":flaky", "not a built-in"),
        ("no such module:f", "not a built-in"),
        ("no_such_module:f", "importing 'no_such_module' failed: ModuleNotFoundError: No module"),
        (
            "tests.helpers.reward_scorers:missing",
            "'tests.helpers.reward_scorers' has no attribute 'missing'",
        ),
        ("tests.helpers.reward_scorers:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not callable"),
        (
            "tests.helpers.reward_scorers:two_args",
            "takes (response, answer); it must take (prompt, response, label",
        ),
        ("nowhere/rewards.py:fn", "no such file"),
        ("{tmp}/broken.py:fn", "failed: SyntaxError"),
        ("{tmp}/raises.py:fn", "failed: RuntimeError: needs a GPU and a coffee"),
    ],
)
def test_load_errors_are_one_line_naming_the_spec(spec, fragment, tmp_path):
    (tmp_path / "broken.py").write_text("def fn(:\n")
    (tmp_path / "raises.py").write_text("raise RuntimeError('needs a GPU\\nand a coffee')\n")
    spec = spec.format(tmp=tmp_path)
    with pytest.raises(RewardFnError) as e:
        check(spec)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(f"fn {spec!r}: ")  # validate prefixes "reward."
    assert fragment in msg


# ---------------------------------------------------------------------- executor
def test_unknown_fn_fails_before_any_process():
    with pytest.raises(RewardFnError, match="fn 'nope'"):
        RewardExecutor("nope")
