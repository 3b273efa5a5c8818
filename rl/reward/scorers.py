"""Rule-based scorers: response text and reference answer in, reward in [0, 1] out.

Pure functions, run inside the reward executor's worker processes (rl/reward/executor.py),
which enforces time limits: ``math-verify``'s own timeouts use ``signal.alarm``, which only
works in a main thread, so they are switched off here and the executor kills a worker that
overruns instead.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

Scorer = Callable[[str, str], float]


def exact_answer(response: str, answer: str) -> float:
    """1.0 when the response (stripped) is exactly the answer: the arithmetic task."""
    return float(response.strip() == answer.strip())


def boxed_math(response: str, answer: str) -> float:
    """1.0 when the response's final (boxed) answer is mathematically equal to the
    reference, as ``math-verify`` judges it (``42.0`` = ``42``, ``\\frac{1}{2}`` = ``0.5``)."""
    from math_verify import parse, verify

    gold = parse(answer, parsing_timeout=None)
    target = parse(response, parsing_timeout=None)
    if not gold or not target:
        return 0.0
    return float(verify(gold, target, timeout_seconds=None))


SCORERS: dict[str, Scorer] = {"exact": exact_answer, "math": boxed_math}


def resolve(name: str) -> Scorer:
    """A built-in scorer by name, or any ``module:function`` (checked before workers start)."""
    if name in SCORERS:
        return SCORERS[name]
    module, sep, attr = name.partition(":")
    if not sep:
        raise ValueError(f"scorer {name!r}: not one of {sorted(SCORERS)} nor 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"scorer {name!r} cannot be imported: {e}") from None
    if not callable(fn):
        raise ValueError(f"scorer {name!r} is not callable")
    return fn
