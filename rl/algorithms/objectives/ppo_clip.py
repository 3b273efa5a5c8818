"""``ppo_clip``: GRPO/PPO's clipped ratio ``-min(r A, clip(r, 1-eps, 1+eps) A)``
(``algorithm=grpo``); the clip is its own off-policy correction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl.algorithms.registry import LossParts, Objective
from rl.config.schema import ObjectiveConfig

if TYPE_CHECKING:
    from rl.algorithms.losses import LossFn


@dataclass
class PpoClipConfig(ObjectiveConfig):
    name: str = "ppo_clip"
    clip_eps: float = 0.2  # the clip range of the ratio pi/mu


def loss(o: PpoClipConfig, p: LossParts) -> LossFn:
    from rl.algorithms.losses import ppo_clip_loss

    return ppo_clip_loss(o.clip_eps, p.kl_coef, p.agg)


OBJECTIVE = Objective(PpoClipConfig, loss, own_correction=True)
