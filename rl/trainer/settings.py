"""What the trainer executor is given of the job's config.

The job's config (``RootConfig``) is split at the entry point (rl/train.py): each executor
gets the sections it reads and nothing else, so following the trainer's config never
climbs back up to the task, the reward or the controller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl.config.schema import AlgorithmConfig, ModelConfig, RolloutConfig, TrainerConfig


@dataclass(frozen=True, kw_only=True)
class TrainerSettings:
    """The trainer ranks' part of the config.

    ``rollout`` is the other side of the DDMA plan (the servers' TP and device, the
    transport) and the sampling the log-probs must match (temperature, response length).
    ``steps`` and ``deterministic`` are ``rl.steps`` and ``rl.deterministic``;
    ``export_tokenizer``: the directory whose tokenizer files go into an HF export.
    """

    model: ModelConfig
    trainer: TrainerConfig
    algorithm: AlgorithmConfig
    rollout: RolloutConfig
    steps: int
    deterministic: bool
    output_dir: str
    export_tokenizer: str | None = None

    @property
    def optimizer_steps(self) -> int:
        """The RL stage's optimizer steps (its LR schedule's length)."""
        a = self.algorithm
        return max(self.steps * a.epochs * a.minibatches, 1)
