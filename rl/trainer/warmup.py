"""Supervised warm-up: teach the policy the task's answers before RL.

RL from a policy that is almost never right gets almost no signal (a group whose samples
all score 0 has no advantage); a short supervised phase on the task's labelled prompts
gives a policy that is right sometimes, which is where group-relative RL takes over. It is
SFT from any labelled task: the prompt as rendered for RL, the label's text (ending in the
stop token) as the target. Every rank draws the same batches from the task's seeded
stream, so no data is broadcast.

Where a fixed number of steps leaves the policy is fragile: small models learn addition in
a sudden jump whose timing moves with float summation order (another micro-batch split or
CPU), and RL learns little from a policy that is rarely right. ``sft.stop_at_accuracy``
therefore ends the warm-up once the greedy pass rate on the task's validation set (drawn
from training data, never the held-out one) reaches a target.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from rl.algorithms.losses import nll_loss
from rl.tasks.common import Example, Task, sft_batch, take
from rl.tasks.scoring import RewardFn, ScoreItem, call

if TYPE_CHECKING:
    from rl.config.schema import RewardConfig, SFTConfig
    from rl.engine.trainer import MegatronTrainer
    from rl.trainer.images import BatchImages


class MetricsSink(Protocol):
    """Where the warm-up's metrics go: an rl.metrics.MetricsLogger, or the trainer
    service's forwarder to the controller (rl/trainer/service.py)."""

    def log(self, step: int, metrics: dict[str, float], phase: str, echo: bool = True) -> None: ...


def supervised_warmup(
    trainer: MegatronTrainer,
    task: Task,
    sft: SFTConfig,
    log: MetricsSink,
    evaluate: Callable[[list], float],
    save_dir: str | None = None,
    save_interval: int = 0,
    images: BatchImages | None = None,
) -> float | None:
    """Run ``sft.steps`` optimizer steps; return the final held-out greedy pass rate
    (None without an eval set, or with ``sft.eval_every=0``). ``evaluate(examples)`` is
    the greedy pass rate on them.

    With ``save_interval`` > 0 a checkpoint is written to ``save_dir`` every that many steps.
    ``images``: adds a vision-language task's images to each batch.
    """
    gbs, target = trainer.tcfg.global_batch_size, sft.stop_at_accuracy
    # sft.eval_every=0: no held-out evaluation here (the RL stage's first one, on the
    # servers, measures where the warm-up ended, far faster than this greedy decoder).
    held = next(iter(task.eval_sets.values()), None) if sft.eval_every else None
    acc = evaluate(held) if held else None
    if acc is not None:
        log.log(0, {"eval_accuracy": acc}, phase="warmup_eval")
    stream = task.train_stream()
    for step in range(1, sft.steps + 1):
        examples = take(stream, gbs)
        batch = sft_batch(examples, task.codec.pad_id)
        if images is not None:
            batch = images(batch, [e.images for e in examples])
        m = trainer.train_step(batch, nll_loss)
        keep: tuple[str, ...] = ("loss", "grad_norm", "lr", "tokens_per_s", "step_seconds")
        keep += tuple(k for k in m if k.startswith("moe_"))  # MoE router health
        stop = False
        if target is not None and step % sft.check_every == 0:
            val = evaluate(task.validation_set)
            m["val_accuracy"], keep = val, (*keep, "val_accuracy")
            stop = val >= target
        last = stop or step == sft.steps
        echo = step % sft.log_every == 0 or last
        log.log(step, {k: m[k] for k in keep}, phase="warmup", echo=echo)
        if held and (step % sft.eval_every == 0 or last):
            acc = evaluate(held)
            log.log(step, {"eval_accuracy": acc}, phase="warmup_eval")
        if save_dir and save_interval and step % save_interval == 0:
            trainer.save(save_dir)
        if stop:
            break
    return acc


def evaluator(
    trainer: MegatronTrainer,
    task: Task,
    reward: RewardConfig,
    max_new_tokens: int,
    images: BatchImages | None = None,
) -> Callable[[list], float]:
    """The warm-up's greedy pass rate, scored by ``reward.fn`` in this process (loaded at
    the first evaluation: a warm-up that evaluates nothing needs no function here, as with
    the judge, which scores on the reward ranks only); responses of up to the task's answer
    length, else ``max_new_tokens``."""
    from rl.tasks.scoring import load, rule_fn

    new = task.answer_tokens or max_new_tokens
    return lambda examples: greedy_accuracy(
        trainer, task, examples, load(rule_fn(reward)), new, reward.pass_threshold, images
    )


# The greedy pass rate of the policy the trainer holds, for decisions during the warm-up,
# before any server holds the policy. Prompts of one length are decoded together: the
# trainer's greedy decoder has no attention mask, and padding inside a prompt would move
# the positions of every token after it.
def greedy_accuracy(
    trainer: MegatronTrainer,
    task: Task,
    examples: Sequence[Example],
    score_fn: RewardFn,
    max_new_tokens: int,
    threshold: float = 1.0,
    images: BatchImages | None = None,
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
        refs = [e.images for e in group] + [group[0].images] * extra
        add = None if images is None else (lambda b, refs=refs: images(b, refs))
        out = trainer.greedy_generate(prompts, max_new_tokens, add)[: len(group)]
        for e, row in zip(group, out, strict=True):
            item = ScoreItem(e.prompt_text, task.codec.response_text(row.tolist()), e.label,
                             dict(e.metadata))  # fmt: skip
            passed += call(score_fn, item).score >= threshold
    return passed / len(examples)
