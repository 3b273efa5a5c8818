"""The off-policy bound: how old a rollout may be when the trainer uses it.

A token sampled with policy version ``v`` and trained on while the trainer holds version
``s`` has lag ``s - v``; a group's lag is its oldest token's (partial rollouts mix
versions). With ``max_lag`` k the trainer never uses a group whose lag exceeds k: such a
group is dropped and counted. What differs between the two modes is how the generator
is kept from producing such groups in the first place:

* ``throttle``: a new group may start only while fewer than ``(committed - first + k + 1)
  * per_step`` groups have been started (dropped ones not counted), where ``committed``
  is the newest version the generator holds. The groups of step t then start no earlier
  than version t-1-k, so in completion order none is ever too old. k = 0 is synchronous
  RL: the next batch starts only after the weights it must be sampled with arrived.
* ``drop``: the generator never waits for a weight version, only for room: at most
  ``(k + 1) * per_step`` groups may be started and not yet consumed. When it runs ahead
  of the trainer its oldest groups are dropped at consumption and replaced.

Pure logic.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import KW_ONLY, dataclass, field

MODES = ("drop", "throttle")


@dataclass
class StalenessGate:
    max_lag: int
    mode: str = "throttle"
    per_step: int = 1  # groups the trainer consumes per step
    dropped: int = 0
    _: KW_ONLY
    skipped: int = 0  # groups that carried no signal (all rewards equal), never trained on
    histogram: Counter = field(default_factory=Counter)  # lag -> groups admitted

    def __post_init__(self) -> None:
        if self.max_lag < 0:
            raise ValueError(f"max_policy_lag={self.max_lag} must be >= 0")
        if self.mode not in MODES:
            raise ValueError(f"stale={self.mode!r} must be one of {MODES}")
        if self.per_step < 1:
            raise ValueError(f"per_step={self.per_step} must be >= 1")

    @staticmethod
    def lag(versions: Sequence[int], trainer_version: int) -> int:
        if not versions:
            raise ValueError("a rollout without tokens has no policy version")
        return trainer_version - min(versions)

    def admit(self, versions: Sequence[int], trainer_version: int) -> bool:
        """Train on a finished group (all its tokens' versions) at ``trainer_version``?"""
        lag = self.lag(versions, trainer_version)
        if lag < 0:
            raise ValueError(
                f"rollout sampled with version {min(versions)} is newer than the trainer's "
                f"{trainer_version}"
            )
        if lag > self.max_lag:
            self.dropped += 1
            return False
        self.histogram[lag] += 1
        return True

    def skip(self) -> None:
        """A finished group left without being trained on for another reason than its
        lag (dynamic sampling): it makes room for a replacement, like a dropped one."""
        self.skipped += 1

    def may_start(self, started: int, consumed: int, committed: int, first: int) -> bool:
        """May the generator start another group? ``started`` and ``consumed`` count groups
        since the run began (``consumed`` includes dropped ones); ``committed`` is the
        newest version the generator holds and ``first`` the version it started with."""
        if self.mode == "drop":
            return started - consumed < (self.max_lag + 1) * self.per_step
        budget = (committed - first + self.max_lag + 1) * self.per_step
        return started - self.dropped - self.skipped < budget
