"""Group-normalised advantages: each prompt's samples are scored against each other.

Why groups: with several samples per prompt, the mean reward of the group is a baseline
that needs no value network (GRPO's choice, which AIPO uses too). Dividing by the
group's standard deviation makes the step size independent of the reward scale; groups
whose samples all scored the same carry no signal and get advantage 0. Pure logic.
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """``rewards[g, k]`` (group g, sample k) -> advantages of the same shape."""
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(
            f"rewards must be [groups, samples>=2] for a group baseline, got {list(rewards.shape)}"
        )
    r = rewards.double()
    adv = r - r.mean(dim=1, keepdim=True)
    if normalize_std:
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def token_advantages(seq_adv: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Broadcast one advantage per sequence over its response tokens ``[b, s]``."""
    return seq_adv.to(loss_mask.dtype)[:, None] * loss_mask
