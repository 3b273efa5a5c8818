"""One RL step from the time of its phases, synchronous and asynchronous.

The one place both the paper-scale model (rl/simulate/phases.py) and the CPU calibration
(rl/simulate/calibrate.py) turn phase times into a step time, so the calibration tests
the same overlap rule the paper-scale prediction uses:

* sync (generate -> score -> train -> push, in sequence): the sum of the phases;
* async (the generator samples step t+1 with the weights of step t-1 while the trainer
  trains step t, AIPO correcting the one-step lag): the slower of the two loops, each
  paying the weight sync (the trainer sends, the servers pause to take the weights in),
  plus the controller's per-step overhead, which neither loop overlaps.

Pure logic.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, asdict, dataclass


@dataclass(frozen=True)
class Phases:
    """Seconds of each phase of one step (``reward``: what the step waits for scoring)."""

    generate: float
    reward: float
    train: float
    sync: float  # weight sync: DDMA (async) or reloading the weights in place (sync)
    _: KW_ONLY
    overhead: float  # controller: batch assembly, logging, handing work out

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def sync_step(p: Phases) -> float:
    """Everything in sequence."""
    return p.generate + p.reward + p.train + p.sync + p.overhead


def generator_loop(p: Phases) -> float:
    """The generator's period: a batch, its last group's scoring, the pause for a sync."""
    return p.generate + p.reward + p.sync


def trainer_loop(p: Phases) -> float:
    return p.train + p.sync


def async_step(p: Phases) -> float:
    """The slower loop plus the overhead neither overlaps."""
    return max(generator_loop(p), trainer_loop(p)) + p.overhead


def bottleneck(p: Phases) -> str:
    return "generator" if generator_loop(p) >= trainer_loop(p) else "trainer"
