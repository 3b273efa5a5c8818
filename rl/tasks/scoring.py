"""Scoring a task's responses: the reward function, ``fn(prompt, response, label, metadata)
-> float | dict``.

A task's evaluation and its reward are the same function: it scores training rollouts in
the reward executor's worker processes (rl/reward/executor.py, which enforce its time
limit and turn an exception, a bad return value or a dead process into a failed score of
0), the warm-up's evaluation in the trainer and the controller's evaluation alike. So this
module is pure (no torch) and everything here must be importable in a fresh process.

A function is named by a spec (``reward.fn``):

- a built-in: ``exact``, ``math_verify`` or ``gsm8k`` (each returns a float in [0, 1]), or
  ``env``, a multi-turn episode's reward as its environment gave it;
- a dotted path ``pkg.module:fn``, imported from ``sys.path``;
- a file ``path/to/rewards.py:fn`` (absolute, or relative to the current directory).

A dict return carries ``score`` plus extra numeric metrics (say ``{"score": 1.0,
"format_ok": 1.0}``), which are averaged and logged next to the reward.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import numbers
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

from rl.plugins import absolute_spec, load_object

if TYPE_CHECKING:
    from rl.config.schema import RewardConfig

RewardFn = Callable[[str, str, Any, dict], float | dict]


class RewardFnError(ValueError):
    """A spec that does not name a usable reward function (one line, naming the spec)."""


class RewardValueError(ValueError):
    """A reward function returned something that is not a score."""


@dataclass(frozen=True)
class ScoreItem:
    prompt: str
    response: str
    label: Any  # the reference: an answer string, a number, or whatever the function wants
    metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ScoreResult:
    score: float
    metrics: dict[str, float] = field(default_factory=dict)
    failed: bool = False  # the function raised, returned garbage, hung or died: score is 0


# ---------------------------------------------------------------------- answer extraction
# A number: optional sign, digits with optional thousands commas (1,234,567), optional
# decimals. Not glued to a preceding word, digit or dot, so "x2", "3-5" and "1.2.3" do not
# yield "2", "-5" or ".3" by accident.
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|(?<![\w.])-?\.\d+")


def last_boxed(text: str) -> str | None:
    """The contents of the last ``\\boxed{...}`` (braces balanced), or None."""
    start = text.rfind("\\boxed")
    while start >= 0:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                if text[j] == "{":
                    depth += 1
                elif text[j] == "}":
                    depth -= 1
                    if depth == 0:
                        return text[i + 1 : j]
        # An unclosed or bare \boxed: an earlier, complete one is still the answer.
        start = text.rfind("\\boxed", 0, start)
    return None


def last_number(text: str) -> str | None:
    """The last number in the text, commas removed ("1,234" -> "1234"), or None."""
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def _first_number(text: str) -> str | None:
    m = _NUMBER.search(text)
    return m.group().replace(",", "") if m else None


def _decimal(text: str | None) -> Decimal | None:
    if text is None:
        return None
    try:
        d = Decimal(text)
    except InvalidOperation:
        return None
    return d if d.is_finite() else None


# ---------------------------------------------------------------------- built-ins
def exact(prompt: str, response: str, label: object, metadata: dict) -> float:
    """1.0 when the response, stripped, is exactly the label, stripped."""
    return float(response.strip() == str(label).strip())


def math_verify(prompt: str, response: str, label: object, metadata: dict) -> float:
    """1.0 when the response's answer (its last ``\\boxed{}``, else its last number) is
    mathematically equal to the label as ``math-verify`` judges it (``42.0`` = ``42``,
    ``\\frac{1}{2}`` = ``0.5``, ``1,234`` = ``1234``)."""
    from math_verify import parse, verify

    answer = last_boxed(response)
    if answer is None:
        answer = last_number(response)
    if answer is None:
        return 0.0
    # Its signal-based timeouts only work in a main thread; the executor kills a worker
    # that overruns instead.
    target = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
    # A bare answer is read whole when boxed ("1 + x^2" alone would parse as 1); LaTeX
    # text with its own \boxed{} or $...$ is read as it is. The other reading is a fallback.
    raw, boxed = str(label), f"\\boxed{{{label}}}"
    gold: list = []
    for text in (raw, boxed) if "\\boxed" in raw or "$" in raw else (boxed, raw):
        gold = gold or parse(text, parsing_timeout=None)
    if not gold or not target:
        return 0.0
    return float(verify(gold, target, timeout_seconds=None))


def gsm8k(prompt: str, response: str, label: object, metadata: dict) -> float:
    """1.0 when the response's final number equals the gold one. The gold answer is the
    text after ``####`` in the label if present (a raw GSM8K solution), else the label;
    the response's is the first number after its last ``####`` if present, else its last
    number. Commas and ``$`` are ignored, and ``72.00`` equals ``72``."""
    gold_text = str(label).rpartition("####")[2].replace("$", "").replace(",", "").strip()
    gold = _decimal(gold_text)
    if gold is None:
        gold = _decimal(_first_number(gold_text))
    text = response.replace("$", "")
    _, sep, tail = text.rpartition("####")
    got = _decimal(_first_number(tail) if sep else last_number(text))
    return float(gold is not None and got is not None and got == gold)


def env(prompt: str, response: str, label: object, metadata: dict) -> float:
    """The reward a multi-turn episode's environment gave when it ended the episode
    (``metadata["env_reward"]``). An episode it did not score (cut by env.max_turns or by
    the token budget, or an environment that leaves scoring to the function) is a failed
    score, counted."""
    value = metadata.get("env_reward")
    if value is None:
        raise RewardValueError(
            f"the environment gave no reward (the episode ended by {metadata.get('env_stop')!r})"
        )
    return float(value)


BUILTINS: dict[str, RewardFn] = {
    "exact": exact, "math_verify": math_verify, "gsm8k": gsm8k, "env": env,
}  # fmt: skip


def prepare(fn: RewardFn) -> None:
    """Run once in each worker before it takes items, so that imports and a first call's
    set-up (sympy's, about 0.5 s) do not count against an item's time limit."""
    if fn is math_verify:
        math_verify("", "\\boxed{1}", "1", {})


# ---------------------------------------------------------------------- loading
_FORMS = (
    "a built-in (exact, gsm8k, math_verify, env), judge, 'pkg.module:fn' or 'path/to/rewards.py:fn'"
)


class _SpecError(RewardFnError):
    """The loader's error, worded as the reward function's field: ``fn '<spec>': ...``."""

    def __init__(self, message: str):
        super().__init__(f"fn {message}")


def absolute(spec: str) -> str:
    """The spec with a relative file path made absolute (against the current directory),
    so it means the same function in a process started elsewhere."""
    spec = spec.strip()
    return spec if spec in BUILTINS or spec == JUDGE else absolute_spec(spec, _FORMS, _SpecError)


def _check_signature(spec: str, fn: Callable[..., object]) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have none to inspect
        return
    try:
        sig.bind("prompt", "response", "label", {})
    except TypeError:
        # Without annotations: "(response, answer)" reads better than "(response: 'str', ...".
        bare = sig.replace(
            parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
            return_annotation=sig.empty,
        )
        raise RewardFnError(
            f"fn {spec!r}: takes {bare}; it must take (prompt, response, label, metadata)"
        ) from None


JUDGE = "judge"  # reward.fn=judge: the LLM judge on the reward ranks (rl/reward/judge.py)
MODEL = "model"  # reward.fn=model: the reward model's score (rl/companion/reward_model.py)


def rule_fn(r: RewardConfig) -> str:
    """The rule function that scores evaluation (and, unless ``reward.fn=model``, training):
    ``reward.fn``, or ``reward.eval_fn`` when the trained reward is the model's alone."""
    return r.eval_fn if r.fn.strip() == MODEL else r.fn


def load(spec: str) -> RewardFn:
    """The reward function a spec names; :class:`RewardFnError` if there is none."""
    spec = spec.strip()
    if spec == JUDGE:
        raise RewardFnError(
            "fn 'judge' is the LLM judge on the reward ranks, not a function to call here "
            "(a warm-up evaluation in the trainer cannot use it: set sft.eval_every=0 and "
            "sft.stop_at_accuracy=null)"
        )
    if spec in BUILTINS:
        fn = BUILTINS[spec]
        if fn is math_verify and importlib.util.find_spec("math_verify") is None:
            raise RewardFnError(f"fn {spec!r}: needs the math-verify package, not installed")
        return fn
    if ":" not in spec:
        raise RewardFnError(f"fn {spec!r}: not {_FORMS}")
    obj = load_object(spec, _FORMS, _SpecError)
    if not callable(obj):
        attr = spec.rpartition(":")[2]
        raise RewardFnError(f"fn {spec!r}: {attr!r} is a {type(obj).__name__}, not callable")
    _check_signature(spec, obj)
    return obj


def check(spec: str) -> None:
    """Fail before launch, in the caller's process, on a spec that names no function (the
    judge is checked with its own config)."""
    if spec.strip() != JUDGE:
        load(spec)


# ---------------------------------------------------------------------- calling
def _finite(value: object, what: str) -> float:
    # bool counts as 0/1: a pass/fail check is a natural reward. Strings, None and other
    # objects are refused rather than coerced, so a buggy function shows up as failures.
    if not isinstance(value, numbers.Real):
        shown = repr(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        raise RewardValueError(f"{what} is {type(value).__name__} {shown}, not a number")
    x = float(value)
    if not math.isfinite(x):
        raise RewardValueError(f"{what} is {x}, not a finite number")
    return x


def call(fn: RewardFn, item: ScoreItem) -> ScoreResult:
    """Score one item; :class:`RewardValueError` if the return is not a finite number or a
    dict with a numeric ``score`` and numeric other values."""
    value = fn(item.prompt, item.response, item.label, item.metadata)
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardValueError(f"returned a dict without 'score' (keys {list(value)[:8]})")
        score = _finite(value["score"], "'score'")
        metrics = {str(k): _finite(v, f"metric {k!r}") for k, v in value.items() if k != "score"}
        return ScoreResult(score, metrics)
    return ScoreResult(_finite(value, "the return value"), {})
