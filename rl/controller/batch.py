"""Finished rollouts -> the trainer's batch: tokens, masks, behaviour log-probs, rewards.

Alignment follows the trainer's contract (rl/algorithms/losses.py): index ``t`` of every
per-token tensor scores token ``t+1``. A response of R tokens after a prompt of P tokens
therefore occupies indices ``[P-1, P-1+R)``. Sequences are right-padded: with causal
attention the padding comes after every real token, so no real position moves.

Only sampled tokens are trained on: the tokens an environment wrote into a multi-turn
trajectory (``Rollout.observed``) are in the sequence and out of the loss.

A response cut by ``max_new_tokens`` (finish reason "length") is overlong: ``keep`` trains
on it like any other, ``mask`` takes its tokens out of the loss (its reward still counts
in its group's baseline), ``penalise`` replaces its reward with ``overlong_penalty`` before
the advantages are computed (by the trainer, which holds the reference's log-probs and a
critic's values that some estimators need: rl/algorithms/registry.py:with_advantages).

Pure logic: torch tensors only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from rl.batch import TrainBatch

if TYPE_CHECKING:
    from rl.generator.types import Rollout

OVERLONG = ("keep", "mask", "penalise")


def trained_rewards(
    group: Sequence[Rollout], rewards: Sequence[float], overlong: str, penalty: float
) -> list[float]:
    """The rewards the advantages are computed from: ``penalise`` replaces an overlong
    sample's reward with ``penalty``."""
    if overlong != "penalise":
        return [float(x) for x in rewards]
    return [
        penalty if r.finish_reason == "length" else float(x)
        for r, x in zip(group, rewards, strict=True)
    ]


def no_signal(
    group: Sequence[Rollout], rewards: Sequence[float], overlong: str, penalty: float
) -> bool:
    """True for a group without signal: its rewards, after the overlong rule, are all
    equal (a group baseline gives every sample advantage 0; a batch-wide one, as
    reinforce_pp's, does not, and dropping it is then a filter of the user's choosing), or
    ``mask`` takes every sample out of the loss."""
    if overlong == "mask" and all(r.finish_reason == "length" for r in group):
        return True
    return len(set(trained_rewards(group, rewards, overlong, penalty))) <= 1


def build_batch(
    groups: Sequence[Sequence[Rollout]],
    rewards: Sequence[Sequence[float]],
    *,
    pad_id: int = 0,
    seq_len: int | None = None,
    overlong: str = "keep",
    overlong_penalty: float = -1.0,
) -> TrainBatch:
    """``groups[g][k]`` is sample k of prompt g (objects with ``prompt_ids``,
    ``output_ids``, ``logprobs``, ``versions``), ``rewards[g][k]`` its reward.

    Returns ``tokens`` [B, S] (int64), ``loss_mask`` and ``behaviour_logprobs`` [B, S]
    (float32), ``versions`` [B, S] (int64, -1 off the response),
    ``rewards`` [B] (after the overlong rule) and ``overlong`` [B] (1.0: cut by length)."""
    if overlong not in OVERLONG:
        raise ValueError(f"algorithm.overlong={overlong!r} must be one of {OVERLONG}")
    sizes = {len(g) for g in groups}
    if len(sizes) != 1 or [len(r) for r in rewards] != [len(g) for g in groups]:
        raise ValueError(
            f"every group needs the same number of samples and rewards: "
            f"samples {[len(g) for g in groups]}, rewards {[len(r) for r in rewards]}"
        )
    rows = [r for g in groups for r in g]
    for r in rows:
        if not (len(r.output_ids) == len(r.logprobs) == len(r.versions)) or not r.output_ids:
            raise ValueError(
                f"rollout {getattr(r, 'rid', '?')}: {len(r.output_ids)} tokens, "
                f"{len(r.logprobs)} log-probs, {len(r.versions)} versions (need equal, > 0)"
            )
    need = max(len(r.prompt_ids) + len(r.output_ids) for r in rows)
    seq = need if seq_len is None else seq_len
    if seq < need:
        raise ValueError(f"seq_len={seq_len} is shorter than the longest sequence ({need})")
    # Rows as padded Python lists, then one tensor each: a few small tensors per row cost
    # more than the whole batch (this runs once per step, on the controller).
    tok_rows, mask_rows, mu_rows, ver_rows = [], [], [], []
    for r in rows:
        p, n = len(r.prompt_ids), len(r.output_ids)
        before, after = p - 1, seq - (p - 1 + n)
        tok_rows.append([*r.prompt_ids, *r.output_ids] + [pad_id] * (seq - p - n))
        mask_rows.append([0.0] * before + [float(x) for x in r.sampled()] + [0.0] * after)
        mu_rows.append([0.0] * before + [float(x) for x in r.logprobs] + [0.0] * after)
        ver_rows.append([-1] * before + [int(v) for v in r.versions] + [-1] * after)
    tokens = torch.tensor(tok_rows, dtype=torch.int64)
    mask = torch.tensor(mask_rows, dtype=torch.float32)
    mu = torch.tensor(mu_rows, dtype=torch.float32)
    versions = torch.tensor(ver_rows, dtype=torch.int64)
    cut = torch.tensor([float(r.finish_reason == "length") for r in rows])
    reward = torch.tensor(
        [
            trained_rewards(g, x, overlong, overlong_penalty)
            for g, x in zip(groups, rewards, strict=True)
        ],
        dtype=torch.float32,
    )
    if overlong == "mask":
        mask = mask * (1 - cut).unsqueeze(1)
    return TrainBatch(tokens, mask, behaviour_logprobs=mu, versions=versions,
                      rewards=reward.reshape(-1), overlong=cut,
                      routing=routing_rows(rows, seq))  # fmt: skip


def routing_rows(rows: Sequence[Rollout], seq: int) -> torch.Tensor | None:
    """The rollouts' routing as ``[B, seq, layers, topk]`` (-1 past each one's rows: its
    last token, the padding); None when they carry none. A rollout holds one row per
    input token, every position but the last."""
    held = [getattr(r, "routing", None) for r in rows]
    if all(h is None for h in held):
        return None
    first = next(h for h in held if h is not None)
    out = torch.full((len(rows), seq, *first.shape[1:]), -1, dtype=first.dtype)
    for i, (r, h) in enumerate(zip(rows, held, strict=True)):
        want = (len(r.prompt_ids) + len(r.output_ids) - 1, *first.shape[1:])
        if h is None or tuple(h.shape) != want:
            shape = None if h is None else tuple(h.shape)
            raise ValueError(f"rollout {getattr(r, 'rid', '?')}: routing {shape}, expected {want}")
        out[i, : want[0]] = h
    return out
