"""``ppo_clip``: GRPO/PPO's clipped ratio ``-min(r A, clip(r, 1-eps, 1+eps) A)``
(``algorithm=grpo``); the clip is its own off-policy correction."""

from __future__ import annotations

from rl.algorithms.losses import ppo_clip_loss
from rl.algorithms.registry import Objective

OBJECTIVE = Objective(
    "ppo_clip", lambda a, weight: ppo_clip_loss(a.clip_eps, a.kl_coef), own_correction=True
)
