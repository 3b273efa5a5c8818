"""The trainer's batch: the one list of its fields, from the controller (rl/controller/batch.py
builds RL batches, rl/tasks/common.py supervised ones) to the losses (rl/algorithms).

One row per sample. Per-token tensors are ``[B, S]`` and follow the trainer's log-prob
convention: index t scores token t+1 (so the last column is never scored). Per-row
tensors are ``[B]``. It crosses processes on a channel as it is (rl/runtime/codec.py
rebuilds it from these type hints), and a microbatch is a :class:`TrainBatch` too.

Pure logic: torch only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass

import torch


@dataclass
class TrainBatch:
    tokens: torch.Tensor  # [B, S] int64: prompt, response, right padding
    loss_mask: torch.Tensor | None = None  # [B, S] 1 on the scored positions (None: none)
    behaviour_logprobs: torch.Tensor | None = None  # [B, S] log mu, as the generator sampled
    advantages: torch.Tensor | None = None  # [B, S] each token's (its sequence's) advantage
    _: KW_ONLY
    versions: torch.Tensor | None = None  # [B, S] the policy version of each token (-1: none)
    rewards: torch.Tensor | None = None  # [B] each sample's trained reward
    overlong: torch.Tensor | None = None  # [B] 1: the response was cut by max_new_tokens
    ref_logprobs: torch.Tensor | None = None  # [B, S] log pi_ref (the KL penalty's reference)
    # [B, S] log pi_old: the trainer's own, before a batch's first update (sample reuse:
    # rl/algorithms/reuse.py); None with one update per batch, where pi_old is pi.
    old_logprobs: torch.Tensor | None = None
    values: torch.Tensor | None = None  # [B, S] a critic's value of each token (GAE)
    returns: torch.Tensor | None = None  # [B, S] the critic's regression targets (GAE)
    # [B, S] a teacher's log-prob of each sampled token (on-policy distillation)
    teacher_logprobs: torch.Tensor | None = None
    # [B, S, layers, topk] int8/int16: the experts the generator routed input token t to
    # in each layer (-1: unknown, the router's own then), replayed by an MoE trainer
    routing: torch.Tensor | None = None
    # A vision-language model's rows (rl/models/vision/inputs.py): [B, S, 3] the
    # multimodal RoPE positions; [B, K, 3] each row's image grids (t, h, w in patches,
    # all-zero: no image) and [B, P, D] their patches, image after image, zero-padded.
    positions: torch.Tensor | None = None
    image_grids: torch.Tensor | None = None
    pixel_values: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq(self) -> int:
        return self.tokens.shape[1]

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields that are set, by name."""
        fields = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        return {name: t for name, t in fields if t is not None}

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TrainBatch:
        """``fn`` applied to every field that is set (a row selection, a device move)."""
        return TrainBatch(**{k: fn(v) for k, v in self.tensors().items()})

    def per_token(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TrainBatch:
        """``fn`` applied to the ``[B, S]`` fields only (a cut or pad of the columns)."""
        return TrainBatch(**{k: v if k in PER_ROW else fn(v) for k, v in self.tensors().items()})

    def pad_columns(self, n: int) -> TrainBatch:
        """``n`` columns more on every per-token field: zeros, -1 in ``routing`` (unknown)."""

        def pad(name: str, v: torch.Tensor) -> torch.Tensor:
            if name in PER_ROW:
                return v
            more = v.new_full((v.shape[0], n, *v.shape[2:]), -1 if name == "routing" else 0)
            return torch.cat([v, more], 1)

        return TrainBatch(**{k: pad(k, v) for k, v in self.tensors().items()})

    def require(self, *names: str) -> None:
        """Raise ValueError naming the first of ``names`` that is not set (a loss's
        inputs)."""
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"the batch has no {missing[0]} (a field of rl.batch.TrainBatch)")


# The fields that are per row, not per token: column cuts and pads leave them alone.
PER_ROW = frozenset({"rewards", "overlong", "image_grids", "pixel_values"})
