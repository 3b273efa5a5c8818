"""A critic's loss: PPO's clipped value regression onto GAE's returns.

``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)`` per loss-mask token, ``V``
the critic's value now, ``V_old`` the value it gave when the batch was scored (the batch's
``values``) and ``R`` the returns (the batch's ``returns``, rl/algorithms/advantages/gae.py).

Why the clip: a critic that moves its values far from those the advantages were computed
with, in one batch's several updates, makes those advantages stale; the clip keeps each
update's regression within ``c`` of them (the pessimistic max, as the policy's surrogate).
``clip=None`` regresses without it. The contract is the trainer's loss contract
(rl/algorithms/losses.py), with the critic's values in place of log-probs.
"""

from __future__ import annotations

import torch

from rl.algorithms.losses import LossFn, LossOutput
from rl.batch import TrainBatch


def clipped_value_loss(clip: float | None) -> LossFn:
    """The critic's :data:`LossFn` for ``critic.clip`` (``None``: unclipped)."""
    if clip is not None and not clip > 0:
        raise ValueError(f"critic.clip={clip} must be > 0 (or null: no clip)")

    def loss(values: torch.Tensor, mb: TrainBatch) -> LossOutput:
        mb.require("loss_mask", "values", "returns")
        assert mb.loss_mask is not None and mb.values is not None and mb.returns is not None
        mask = mb.loss_mask.to(values.dtype)
        old, target = mb.values.to(values.dtype), mb.returns.to(values.dtype)
        err = (values - target) ** 2
        stats = {"value_mean": values.detach() * mask, "value_error": err.detach() * mask}
        if clip is not None:
            clipped = old + (values - old).clamp(-clip, clip)
            err_clipped = (clipped - target) ** 2
            stats["vf_clipfrac"] = (err_clipped > err).to(values.dtype).detach() * mask
            err = torch.maximum(err, err_clipped)
        return LossOutput(
            loss_sum=0.5 * (err * mask).sum(),
            num_tokens=mask.sum().to(torch.int),
            stats={k: v.sum() for k, v in stats.items()},
        )

    return loss
