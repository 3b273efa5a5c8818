"""The off-policy bound: how old a rollout may be when the trainer uses it.

A token sampled with policy version ``v`` and trained on while the trainer holds version
``s`` has lag ``s - v``; a rollout's lag is its oldest token's (partial rollouts mix
versions). With ``max_lag`` k, ``drop`` discards rollouts whose lag exceeds k (counted),
and ``throttle`` stops the generator from starting new prompts while k batches already
wait for the trainer, so nothing gets that old in the first place. k = 0 is synchronous
RL. Pure logic.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

MODES = ("drop", "throttle")


@dataclass
class StalenessGate:
    max_lag: int
    mode: str = "drop"
    dropped: int = 0
    histogram: Counter = field(default_factory=Counter)  # lag -> rollouts admitted

    def __post_init__(self) -> None:
        if self.max_lag < 0:
            raise ValueError(f"max_policy_lag={self.max_lag} must be >= 0")
        if self.mode not in MODES:
            raise ValueError(f"stale={self.mode!r} must be one of {MODES}")

    @staticmethod
    def lag(versions: Sequence[int], trainer_version: int) -> int:
        if not versions:
            raise ValueError("a rollout without tokens has no policy version")
        return trainer_version - min(versions)

    def admit(self, versions: Sequence[int], trainer_version: int) -> bool:
        """Keep a finished rollout for training at ``trainer_version``?"""
        lag = self.lag(versions, trainer_version)
        if lag < 0:
            raise ValueError(
                f"rollout sampled with version {min(versions)} is newer than the trainer's "
                f"{trainer_version}"
            )
        if lag > self.max_lag and self.mode == "drop":
            self.dropped += 1
            return False
        self.histogram[lag] += 1
        return True

    def may_start(self, waiting_batches: int) -> bool:
        """May the generator start another batch of prompts? (throttle mode: not while
        ``max_lag`` batches wait, since the last of them would be trained on too late)."""
        if self.mode != "throttle":
            return True
        return waiting_batches < max(self.max_lag, 1)
