"""The reward model (``reward_model=``): a frozen HF ``*ForSequenceClassification``
checkpoint with one label, scoring each sample (prompt + response) where the checkpoint's
own class pools it (:func:`scored_positions`): at its rightmost token that is not the
checkpoint's ``pad_token_id``.

It runs on the model executor (rl/companion/service.py), on ranks and a layout of its own
(``reward_model.trainer``), converted once from HF to that layout and cached. Its scores
reach the trainer as rewards (``reward.fn=model``, or weighted with the rule's:
``reward.combine``), after :func:`normalise`; the held-out evaluation stays the rule's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rl.companion.settings import (
    CompanionSettings,
    check_hf_model,
    check_layout,
    frozen,
    hf_model,
)
from rl.config.errors import ConfigError
from rl.tasks.scoring import MODEL

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from rl.config.schema import ModelConfig, RewardConfig, RewardModelConfig, RootConfig

ROLE = "reward_model"
NORMALIZE = ("none", "standard", "sigmoid")
STATS = "reward_stats.json"  # the scores' mean and std, beside the checkpoint


def model(cfg: RootConfig) -> ModelConfig:
    """The reward model's architecture, from its checkpoint's config.json."""
    return hf_model(cfg.reward_model.hf_checkpoint, ROLE)


def settings(cfg: RootConfig) -> CompanionSettings:
    return frozen(cfg, ROLE)


def weights(r: RewardConfig) -> dict[str, float]:
    """The trained reward as a weighted sum of ``rule`` and ``model`` scores."""
    c = r.combine
    if c.rule or c.model:
        return {"rule": float(c.rule), MODEL: float(c.model)}
    return {MODEL: 1.0} if r.fn.strip() == MODEL else {"rule": 1.0}


@dataclass(frozen=True)
class Normaliser:
    """``reward_model.normalize`` with its mean and std."""

    mode: str = "none"
    mean: float = 0.0
    std: float = 1.0

    @classmethod
    def from_config(cls, r: RewardModelConfig) -> Normaliser:
        stats = {}
        path = Path(r.hf_checkpoint or "") / STATS
        if r.hf_checkpoint and path.is_file():
            stats = json.loads(path.read_text())
        mean = r.mean if r.mean is not None else float(stats.get("mean", 0.0))
        std = r.std if r.std is not None else float(stats.get("std", 1.0))
        return cls(r.normalize, mean, std)

    def __call__(self, score: float) -> float:
        if self.mode == "none":
            return score
        z = (score - self.mean) / self.std
        return z if self.mode == "standard" else 1.0 / (1.0 + math.exp(-z))


def pad_token_id(path: str) -> int | None:
    """The checkpoint's ``pad_token_id`` (its config.json's; a config with a
    ``text_config``: that one's, as transformers reads it), None where it has none."""
    hf = json.loads((Path(path) / "config.json").read_text())
    pad = hf.get("text_config", hf).get("pad_token_id")
    return None if pad is None else int(pad)


def scored_positions(seqs: Sequence[Sequence[int]], pad_id: int | None) -> list[int | None]:
    """The position a ``*ForSequenceClassification`` scores in each sequence fed to it
    alone (transformers 5: ``GenericForSequenceClassification``): its rightmost token that
    is not ``pad_id``, so a sequence that ends in pad ids is scored before them and pad ids
    inside it change nothing. Without a pad id, its last token (transformers' rule for one
    unpadded row). None: nothing to score (empty, or every token a pad id, where
    transformers would take position 0)."""
    out: list[int | None] = []
    for s in seqs:
        at = len(s) - 1
        if pad_id is not None:
            while at >= 0 and s[at] == pad_id:
                at -= 1
        out.append(at if at >= 0 else None)
    return out


def sequence_scores(values: torch.Tensor, positions: Sequence[int | None]) -> list[float]:
    """Each row's score: its value at ``positions[i]`` (0 where that is None)."""
    return [0.0 if t is None else float(values[i, t]) for i, t in enumerate(positions)]


def check(cfg: RootConfig) -> None:
    """The reward model's fields, its checkpoint's head and vocabulary against the
    policy's, its layout, and the reward's use of it, each in one line."""
    r, rw = cfg.reward_model, cfg.reward
    uses = {k: w for k, w in weights(rw).items() if w}
    if rw.combine.rule and rw.fn.strip() == MODEL:
        raise ConfigError(
            f"reward.combine.rule={rw.combine.rule} with reward.fn=model: there is no rule "
            "to weigh (set reward.fn to the rule, e.g. exact)"
        )
    if not r.enabled:
        if MODEL in uses:
            why = "reward.fn=model" if rw.fn.strip() == MODEL else (
                f"reward.combine.model={rw.combine.model}")  # fmt: skip
            raise ConfigError(
                f"{why} needs a reward model: set reward_model=cpu reward_model.hf_checkpoint=DIR"
            )
        return
    if MODEL not in uses:
        raise ConfigError(
            "reward_model.enabled=true but the reward does not use it: set reward.fn=model or "
            "reward.combine.model"
        )
    if r.normalize not in NORMALIZE:
        raise ConfigError(
            f"reward_model.normalize={r.normalize!r} is not one of {', '.join(NORMALIZE)}"
        )
    if r.std is not None and not r.std > 0:
        raise ConfigError(f"reward_model.std={r.std} must be > 0")
    m = model(cfg)
    needs = "a reward model needs a classification head (*ForSequenceClassification, num_labels=1)"
    check_hf_model(cfg, m, ROLE, score=True, needs=needs, what="scores")
    check_layout(ROLE, r.trainer, m, "the reward model's ")
