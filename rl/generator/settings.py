"""What the generator executor is given of the job's config (split off at the entry point,
rl/train.py, by rl/generator/startup.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl.config.schema import RolloutConfig


@dataclass(frozen=True, kw_only=True)
class GeneratorSettings:
    """The generator ranks' part of the config: ``rollout`` (the servers, their restarts,
    the FP8 block of the weight sync), where their logs go, whether clients are on other
    nodes (``cluster.nodes`` > 1), ``rl.deterministic`` (batch-invariant serving), and
    ``algorithm.routing_replay`` (servers that return each token's routed experts)."""

    rollout: RolloutConfig
    output_dir: str
    multi_node: bool
    deterministic: bool
    routing_replay: bool = False
