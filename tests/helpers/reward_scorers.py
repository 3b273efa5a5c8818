"""Reward functions for the reward tests, imported by name (``reward_scorers:fn``) in the
test process and in the executor's worker processes."""

from __future__ import annotations

import os
import time
from typing import Any

from rl.tasks.scoring import ScoreItem


def item(response: str, label: Any = "", prompt: str = "", **metadata: Any) -> ScoreItem:  # JSON
    """A score request as the reward executor receives it."""
    return ScoreItem(prompt, response, label, metadata)


def flaky(prompt: str, response: str, label: Any, metadata: dict) -> Any:
    """Misbehaves on cue, else exact match: 'boom' raises, 'hang' sleeps past any limit,
    'die' kills its process, 'str' / 'none' / 'nan' return something that is no score."""
    if response == "boom":
        raise ValueError("reward fn exploded")
    if response == "hang":
        time.sleep(60)
    if response == "die":
        os._exit(7)
    bad = {"str": "1.0", "none": None, "nan": float("nan")}
    if response in bad:
        return bad[response]
    return float(response == label)


def with_metrics(prompt: str, response: str, label: Any, metadata: dict) -> dict:
    """A score plus extra metrics, one of them read from the item's metadata."""
    return {
        "score": float(response == label),
        "length": len(response),
        "formatted": response.startswith("<"),
        "weight": metadata.get("weight", 0.0),
    }


def two_args(response: str, answer: str) -> float:  # the old scorer signature
    return float(response == answer)


def star_args(*args: Any) -> float:
    return float(args[1] == args[2])


NOT_CALLABLE = 3
