"""``gspo``: GSPO's sequence-level clipped ratio ``-min(s A, clip(s, 1-low, 1+high) A)``,
``s = (pi/mu)^(1/|y|)`` the geometric mean of the response's token ratios
(rl/algorithms/losses.py: gspo_loss). Like ppo_clip, the clip is its own off-policy
correction, here on the sequence ratio; its loss aggregation is seq_mean_token_mean
unless algorithm.loss_agg says otherwise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl.algorithms.registry import LossParts, Objective
from rl.config.schema import ObjectiveConfig

if TYPE_CHECKING:
    from rl.algorithms.losses import LossFn


@dataclass
class GspoConfig(ObjectiveConfig):
    name: str = "gspo"
    # The paper's ranges (section 5.1): a sequence ratio is a mean of log-ratios, so it
    # moves far less than a token's, and the band is far narrower than PPO's 0.2.
    clip_low: float = 3e-4
    clip_high: float = 4e-4


def loss(o: GspoConfig, p: LossParts) -> LossFn:
    from rl.algorithms.losses import gspo_loss

    return gspo_loss(o.clip_low, o.clip_high, p.kl_coef, p.agg)


OBJECTIVE = Objective(GspoConfig, loss, own_correction=True, loss_agg="seq_mean_token_mean")
