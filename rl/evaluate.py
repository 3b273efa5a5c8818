"""Held-out greedy accuracy of the policy held by the trainer (the task's exact-match reward)."""

from __future__ import annotations

from typing import Any

import torch


def greedy_accuracy(trainer: Any, task: Any, problems: list | None = None) -> float:
    """Fraction of ``problems`` (default: the task's held-out set) answered exactly,
    decoding greedily."""
    problems = task.eval_set if problems is None else problems
    prompts = torch.tensor([p.prompt(task.digits) for p in problems], dtype=torch.long)
    # Pad the rows up to a whole number of (micro batch x DP) with copies; drop them after.
    unit = trainer.tcfg.micro_batch_size * trainer.layout.dp
    extra = (-len(problems)) % unit
    if extra:
        prompts = torch.cat([prompts, prompts[:1].expand(extra, -1)], dim=0)
    out = trainer.greedy_generate(prompts, task.answer_len)[: len(problems)]
    correct = sum(task.reward(p, row.tolist()) for p, row in zip(problems, out, strict=True))
    return correct / len(problems)
