"""Reward functions and their executor: built-ins score hand-made cases right, user
functions load by dotted path or file, bad specs fail in one line before launch, and a
function that raises, returns garbage, hangs or dies costs that one item (a failed 0,
counted) and nothing else."""

from __future__ import annotations

import pickle
import queue
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rl.reward.executor import RewardExecutor
from rl.tasks.scoring import (
    RewardFnError,
    RewardValueError,
    ScoreItem,
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

FAILED = ScoreResult(0.0, {}, failed=True)


def item(response: str, label: Any = "", prompt: str = "", **metadata: Any) -> ScoreItem:
    return ScoreItem(prompt, response, label, metadata)


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
    assert call(load("tests.helpers.reward_scorers:star_args"), item("a", "a")).score == 1.0  # *args is fine


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
        ("regex", "not a built-in (exact, gsm8k, math_verify)"),
        ("tests.helpers.reward_scorers:", "not a built-in"),
        (":flaky", "not a built-in"),
        ("no such module:f", "not a built-in"),
        ("no_such_module:f", "importing 'no_such_module' failed: ModuleNotFoundError: No module"),
        ("tests.helpers.reward_scorers:missing", "'tests.helpers.reward_scorers' has no attribute 'missing'"),
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


def test_batch_scores_in_order():
    with RewardExecutor("exact", workers=2) as ex:
        got = ex.score([item("1", "1"), item("2", "3"), item("4", 4), item("5", "6")])
    assert [r.score for r in got] == [1.0, 0.0, 1.0, 0.0]
    assert not any(r.failed for r in got)
    assert ex.stats.scored == 4 and ex.stats.failures == 0


def test_builtin_and_file_fns_load_in_the_workers(tmp_path, monkeypatch):
    (tmp_path / "rewards.py").write_text(
        "def fn(prompt, response, label, metadata):\n"
        "    return {'score': float(response == label), 'depth': metadata['depth']}\n"
    )
    monkeypatch.chdir(tmp_path)
    with RewardExecutor("rewards.py:fn", workers=1) as ex:
        monkeypatch.chdir(Path(__file__).parent)  # workers got the absolute path
        got = ex.score([item("a", "a", depth=2), item("a", "b", depth=3)])
    assert got == [ScoreResult(1.0, {"depth": 2.0}), ScoreResult(0.0, {"depth": 3.0})]
    with RewardExecutor("math_verify", workers=1, timeout_s=2.0) as ex:
        got = ex.score([item("\\boxed{\\frac{2}{4}}", "0.5"), item("it is 7", 8)])
    assert [r.score for r in got] == [1.0, 0.0] and ex.stats.timeouts == 0


def test_misbehaving_fns_cost_one_item_each():
    cases = ["a", "boom", "str", "none", "nan", "hang", "die", "b"]
    with RewardExecutor("tests.helpers.reward_scorers:flaky", workers=2, timeout_s=1.0) as ex:
        t0 = time.monotonic()
        got = ex.score([item(c, c) for c in cases])
        elapsed = time.monotonic() - t0
        ok = ScoreResult(1.0, {})
        assert got == [ok, FAILED, FAILED, FAILED, FAILED, FAILED, FAILED, ok]
        assert ex.stats.failures == 5  # the exception, 3 bad values and the dead worker
        assert ex.stats.timeouts == 1
        assert ex.stats.scored == 2
        assert elapsed < 15  # the hang cost its timeout, not its 60 s
        # Still serving afterwards, with replaced workers.
        assert ex.score([item("c", "c")]) == [ok]


def test_workers_that_cannot_start_fail_items_instead_of_hanging(tmp_path):
    # Loads in the parent (so the spec passes its check) but kills every worker process.
    (tmp_path / "child_dies.py").write_text(
        "import multiprocessing, os\n"
        "if multiprocessing.parent_process() is not None:\n"
        "    os._exit(3)\n"
        "def fn(prompt, response, label, metadata):\n"
        "    return 1.0\n"
    )
    with RewardExecutor(f"{tmp_path}/child_dies.py:fn", workers=1, timeout_s=1.0) as ex:
        assert ex.score([item("a", "a"), item("b", "b")]) == [FAILED, FAILED]
        assert ex.stats.failures == 2 and "failed to start" in ex.stats.last_error
        assert ex.score([item("c", "c")]) == [FAILED]


# ---------------------------------------------------------------------- service
class _Queue:
    """A channel stand-in: pickles each message as the store-backed channel does."""

    def __init__(self) -> None:
        self.q: queue.Queue = queue.Queue()

    def put(self, msg: Any) -> None:
        self.q.put(pickle.dumps(msg))

    def get(self) -> Any:
        return pickle.loads(self.q.get(timeout=30))

    wait = get  # an executor's inbox waits as long as it takes; here 30 s is plenty


class _Job:
    role_rank = 0

    def __init__(self) -> None:
        self.queues: dict[str, _Queue] = {}

    def channel(self, name: str, *types: type) -> _Queue:
        return self.queues.setdefault(name, _Queue())

    def role_size(self, role: str) -> int:
        return 1


def test_handle_scores_through_a_reward_rank():
    from types import SimpleNamespace

    from rl.reward.service import RewardHandle, serve

    job = _Job()
    cfg = SimpleNamespace(reward=SimpleNamespace(fn="tests.helpers.reward_scorers:flaky", workers=1, timeout_s=2))
    rank = threading.Thread(target=serve, args=(cfg, job), daemon=True)
    rank.start()
    handle = RewardHandle(job)
    try:
        a = handle.score([item("x", "x"), item("boom", "x"), item("y", "x")])
        empty = handle.score([])
        assert [r.score for r in a.result(timeout=30)] == [1.0, 0.0, 0.0]
        assert a.result()[1].failed and empty.result(timeout=30) == []
        assert handle.failures == 1 and handle.timeouts == 0
    finally:
        handle.stop()
        rank.join(timeout=15)
    assert not rank.is_alive()
