"""Greedy pass rate of the policy the trainer holds, scored by the run's reward function.

For decisions during the warm-up, before any server holds the policy. Prompts of one
length are decoded together: the trainer's greedy decoder has no attention mask, and a
padded prompt would move the positions of every token after the padding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from rl.reward.functions import ScoreItem, call
from rl.tasks.common import Example, Task


def greedy_accuracy(
    trainer: Any,
    task: Task,
    examples: Sequence[Example],
    score_fn: Callable[..., Any],
    max_new_tokens: int,
    threshold: float = 1.0,
) -> float:
    """Fraction of ``examples`` whose greedy response scores at least ``threshold``."""
    by_len: dict[int, list[Example]] = {}
    for e in examples:
        by_len.setdefault(len(e.prompt_ids), []).append(e)
    unit = trainer.tcfg.micro_batch_size * trainer.layout.dp
    passed = 0
    for group in by_len.values():
        prompts = torch.tensor([e.prompt_ids for e in group], dtype=torch.long)
        extra = (-len(group)) % unit  # whole micro-batches per DP rank: pad with copies
        if extra:
            prompts = torch.cat([prompts, prompts[:1].expand(extra, -1)], dim=0)
        out = trainer.greedy_generate(prompts, max_new_tokens)[: len(group)]
        for e, row in zip(group, out, strict=True):
            item = ScoreItem(e.prompt_text, task.codec.response_text(row.tolist()), e.label,
                             dict(e.metadata))  # fmt: skip
            passed += call(score_fn, item).score >= threshold
    return passed / len(examples)
