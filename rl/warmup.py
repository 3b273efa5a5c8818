"""Supervised warm-up: teach the policy the task's answer format before RL.

RL from a random policy on exact-match rewards gets almost no signal; a short supervised
phase on generated (prompt, answer) pairs gives a policy that is right sometimes, which is
where group-relative RL can take over. Every rank draws the same batches from the task's
seeded sampler, so no data needs to be broadcast.

Where a fixed number of steps leaves the policy is fragile: small models learn addition in
a sudden jump whose timing moves with float summation order (another micro-batch split or
CPU), and RL learns little from a policy that is rarely right. ``sft.stop_at_accuracy``
therefore ends the warm-up once greedy accuracy on fresh training problems (the task's
validation set, never the held-out one) reaches a target.
"""

from __future__ import annotations

from typing import Any

from rl.algorithms.losses import nll_loss
from rl.evaluate import greedy_accuracy
from rl.metrics import MetricsLogger


def supervised_warmup(
    trainer: Any,
    task: Any,
    sft: Any,
    log: MetricsLogger,
    save_dir: str | None = None,
    save_interval: int = 0,
) -> float:
    """Run ``sft.steps`` optimizer steps; return the final held-out greedy accuracy.

    With ``save_interval`` > 0 a checkpoint is written to ``save_dir`` every that many steps.
    """
    gbs, target = trainer.tcfg.global_batch_size, sft.stop_at_accuracy
    acc = greedy_accuracy(trainer, task)
    log.log(0, {"eval_accuracy": acc}, phase="warmup_eval")
    for step in range(1, sft.steps + 1):
        m = trainer.train_step(task.sft_batch(task.sample(gbs)), nll_loss)
        keep = ("loss", "grad_norm", "lr", "tokens_per_s", "step_seconds")
        stop = False
        if target is not None and step % sft.check_every == 0:
            val = greedy_accuracy(trainer, task, task.validation_set)
            m["val_accuracy"], keep = val, (*keep, "val_accuracy")
            stop = val >= target
        last = stop or step == sft.steps
        echo = step % sft.log_every == 0 or last
        log.log(step, {k: m[k] for k in keep}, phase="warmup", echo=echo)
        if step % sft.eval_every == 0 or last:
            acc = greedy_accuracy(trainer, task)
            log.log(step, {"eval_accuracy": acc}, phase="warmup_eval")
        if save_dir and save_interval and step % save_interval == 0:
            trainer.save(save_dir)
        if stop:
            break
    return acc
