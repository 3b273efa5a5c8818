"""The simulator's step rule on this machine: the CPU benchmark's async step, predicted.

tools/bench/async_vs_sync.py runs the real job (Megatron trainer, SGLang server, DDMA,
reward ranks) synchronously and asynchronously and commits the per-step means of its
phases (tools/bench/results/async_vs_sync.json). The CPU profile is built from that file:

* from the **sync** run: generating and scoring a batch from scratch (``wait_batch_s``:
  in sync mode the trainer waits for the whole batch), the train step, the weight sync,
  and the controller's overhead (what the step has beyond the three);
* from the async run, only how much slower the trainer's step gets when generator and
  trainer run at once on the 2 cores (``train_s`` async / sync): the same contention is
  assumed for the generator (each executor has one core; the controller, reward ranks and
  SGLang's tokenizer processes now take from both), and its measured weight sync
  (``sync_s``: DDMA into a server that is generating).

Then :func:`rl.simulate.step.async_step`, the rule the paper-scale prediction uses, gives
the async step; the sync step is the same phases summed (a consistency check: the
profile is built from it). ``contention_free`` is the prediction from the sync run alone.
Pure logic.
"""

from __future__ import annotations

import json
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any

from rl.simulate.step import Phases, async_step, sync_step

BENCH = Path(__file__).resolve().parents[2] / "tools/bench/results/async_vs_sync.json"


@dataclass(frozen=True)
class CpuProfile:
    """Per-step phase costs of the CPU benchmark, from its committed JSON."""

    generate: float  # a batch generated and scored, from scratch
    train: float
    sync: float
    overhead: float
    _: KW_ONLY
    contention: float  # async/sync train step: both executors busy on the 2 cores
    async_sync: float  # the weight sync measured in the async run

    @classmethod
    def from_bench(cls, bench: dict[str, Any], split: str = "split") -> CpuProfile:
        runs = bench["splits"][split]
        s, a = runs["sync"], runs["async"]
        phases = s["wait_batch_s"] + s["train_s"] + s["sync_s"]
        return cls(
            generate=s["wait_batch_s"],
            train=s["train_s"],
            sync=s["sync_s"],
            overhead=max(s["step_s"] - phases, 0.0),
            contention=a["train_s"] / s["train_s"],
            async_sync=a["sync_s"],
        )

    def sync_phases(self) -> Phases:
        # Scoring overlaps generation, so the wait holds both; reward is not counted again.
        return Phases(self.generate, 0.0, self.train, self.sync, overhead=self.overhead)

    def async_phases(self, contention: bool = True) -> Phases:
        k = self.contention if contention else 1.0
        sync = self.async_sync if contention else self.sync
        return Phases(self.generate * k, 0.0, self.train * k, sync, overhead=self.overhead)


@dataclass(frozen=True)
class Calibration:
    profile: CpuProfile
    measured_sync: float
    measured_async: float

    @property
    def predicted_sync(self) -> float:
        return sync_step(self.profile.sync_phases())

    @property
    def predicted_async(self) -> float:
        return async_step(self.profile.async_phases())

    @property
    def contention_free(self) -> float:
        return async_step(self.profile.async_phases(contention=False))

    def errors(self) -> dict[str, float]:
        return {
            "sync": self.predicted_sync / self.measured_sync - 1,
            "async": self.predicted_async / self.measured_async - 1,
            "async_contention_free": self.contention_free / self.measured_async - 1,
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile.__dict__,
            "measured": {"sync": self.measured_sync, "async": self.measured_async},
            "predicted": {
                "sync": self.predicted_sync,
                "async": self.predicted_async,
                "async_contention_free": self.contention_free,
            },
            "errors": self.errors(),
        }


def calibrate(bench: dict[str, Any] | None = None, split: str = "split") -> Calibration:
    """Predict the committed benchmark (or ``bench``) from its CPU profile."""
    bench = bench if bench is not None else json.loads(BENCH.read_text())
    runs = bench["splits"][split]
    return Calibration(
        CpuProfile.from_bench(bench, split), runs["sync"]["step_s"], runs["async"]["step_s"]
    )


if __name__ == "__main__":
    print(json.dumps(calibrate().as_dict(), indent=1))
