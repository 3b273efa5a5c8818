"""On-policy distillation: a teacher's log-prob of every sampled token as a dense reward.

Each sampled token's advantage gains ``coef * (log pi_teacher(x_t) - log mu(x_t))``: the
negative of the per-token reverse KL ``log pi - log pi_teacher``, estimated on the tokens
the policy sampled (``mu``: the behaviour policy's log-prob, as the generator sampled it,
which is the policy of at most ``algorithm.max_policy_lag`` versions ago). A token the
teacher finds likelier than the student did is pushed up, and one it finds unlikely down,
whatever the task's reward. With ``only`` the task's advantages are dropped: the teacher
alone teaches.

Pure logic: torch only.
"""

from __future__ import annotations

import torch

from rl.batch import TrainBatch


def distill_advantages(
    adv: torch.Tensor, batch: TrainBatch, coef: float, only: bool = False
) -> tuple[torch.Tensor, dict[str, float]]:
    """``adv`` with the teacher's dense term added (or replaced by it, ``only``), and the
    step's mean reverse KL over the loss-mask tokens (``distill_kl``)."""
    batch.require("teacher_logprobs", "behaviour_logprobs", "loss_mask")
    assert batch.teacher_logprobs is not None and batch.behaviour_logprobs is not None
    assert batch.loss_mask is not None
    mask = batch.loss_mask
    kl = (batch.behaviour_logprobs - batch.teacher_logprobs) * mask
    dense = -coef * kl
    out = dense if only else adv + dense
    return out, {"distill_kl": (kl.sum() / mask.sum().clamp(min=1)).item()}
