"""Where the trainer's RL stage starts from, and the trainer's part of the job's config.

The one module of the trainer that reads the whole job's config (``RootConfig``):
:func:`settings` splits off what the trainer's command loop reads (rl/trainer/service.py),
and :func:`start` builds the RL stage's starting policy, which may need the task and its
reward function (the supervised warm-up). The entry point (rl/train.py) calls the first
and hands the second, bound to the config, to the command loop, which runs it on every
trainer rank once the rank is set up.

The policy starts from, in order: a restarted job's last RL checkpoint (optimizer, LR
schedule and step count included: rl/checkpoints/resume.py), ``trainer.load_dir``, or
``model.hf_checkpoint`` converted once to this trainer's TP/PP/EP and cached under the
output dir by the checkpoint's content; then the warm-up if ``sft.steps`` > 0.
"""

from __future__ import annotations

import copy
import gc
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from rl.trainer.settings import TrainerSettings

if TYPE_CHECKING:
    from rl.config.schema import RootConfig
    from rl.engine.trainer import MegatronTrainer
    from rl.trainer.warmup import MetricsSink


class Start(NamedTuple):
    """The RL stage's trainer, its frozen KL reference (None without a KL penalty), the
    warm-up's final accuracy and checkpoint (None without one), and the checkpoint the RL
    stage's policy started from (None: a fresh initialisation)."""

    policy: MegatronTrainer
    reference: MegatronTrainer | None
    warmup_accuracy: float | None
    checkpoint: str | None
    begin: str | None = None


def settings(cfg: RootConfig) -> TrainerSettings:
    """The trainer's part of ``cfg``."""
    # A task of text files may name its own tokenizer (task=dataset: task.tokenizer).
    tokenizer = getattr(cfg.task, "tokenizer", None) or cfg.model.hf_checkpoint
    return TrainerSettings(
        model=cfg.model, trainer=cfg.trainer, algorithm=cfg.algorithm, rollout=cfg.rollout,
        steps=cfg.rl.steps, deterministic=cfg.rl.deterministic,
        output_dir=cfg.run.output_dir, export_tokenizer=tokenizer,
    )  # fmt: skip


def start(cfg: RootConfig, log: MetricsSink) -> Start:
    """Build the trainer; run the warm-up first if ``sft.steps`` > 0. The RL stage gets a
    fresh trainer (optimizer state and LR schedule of its own) loaded from the warm-up,
    and, with a KL penalty, a frozen copy of that starting policy as the reference."""
    from rl.checkpoints import resume
    from rl.engine.trainer import build_trainer
    from rl.tasks import build_task
    from rl.trainer.images import BatchImages
    from rl.trainer.warmup import evaluator, supervised_warmup

    s = settings(cfg)
    t, sft, out = s.trainer, cfg.sft, Path(s.output_dir)
    begin, acc, ckpt = t.load_dir, None, None  # begin: the RL stage's starting policy
    point = resume.read(out) if s.steps > 0 else None
    if not begin and point is None and s.model.hf_checkpoint:
        begin = _from_hf(s)
    if point is None and sft.steps > 0:
        wt = copy.deepcopy(t)
        if sft.optim is not None:
            wt.optim = sft.optim
        tr = build_trainer(s.model, wt, total_steps=sft.steps)
        if begin:
            tr.load(begin, t.load_optimizer and begin == t.load_dir)
        task = build_task(cfg)
        warm_only = s.steps == 0
        ckpt = t.save_dir or str(out / "checkpoint") if warm_only else str(out / "warmup")
        images = BatchImages(s.model) if s.model.vision is not None else None
        score = evaluator(tr, task, cfg.reward, s.rollout.sampling.max_new_tokens, images)
        acc = supervised_warmup(tr, task, sft, log, score, ckpt, t.save_interval, images)
        # Before RL, weights only: the RL stage starts an optimizer of its own (and a job
        # killed before its first RL checkpoint warms up again), so the warm-up's Adam
        # state, twice the weights' size, was written for nothing.
        tr.save(ckpt, weights_only=not warm_only)
        if warm_only:
            return Start(tr, None, acc, ckpt, ckpt)
        del tr
        gc.collect()
        begin = ckpt
    elif point is not None and sft.steps > 0:
        begin, acc, ckpt = str(out / "warmup"), point.warmup_accuracy, point.checkpoint
    elif point is not None and begin is None and s.model.hf_checkpoint:
        begin = _from_hf(s)  # the KL reference's starting weights
    temperature = float(s.rollout.sampling.temperature)
    tr = build_trainer(s.model, t, total_steps=s.optimizer_steps)
    ref = None
    if s.algorithm.kl_coef > 0:  # same seed: without a checkpoint it is the same init
        ref = build_trainer(s.model, t, total_steps=1, frozen=True)
        ref.temperature = temperature
        if begin:
            ref.load(begin, load_optimizer=False)
    if point is not None:
        tr.load(point.checkpoint, load_optimizer=True)
    elif begin:  # the warm-up's optimizer state is not RL's (t.load_optimizer: a load_dir's)
        tr.load(begin, t.load_optimizer and begin == t.load_dir)
    tr.temperature = temperature
    return Start(tr, ref, acc, ckpt, begin)


def _from_hf(s: TrainerSettings) -> str:
    """``model.hf_checkpoint`` as a Megatron checkpoint at this trainer's TP/PP/EP (cached)."""
    from rl.weights.convert import cached_hf_to_mcore

    t, hf = s.trainer, s.model.hf_checkpoint
    assert hf, "only called with model.hf_checkpoint set"
    out = Path(s.output_dir) / "hf_cache"
    return cached_hf_to_mcore(hf, out, s.model, t.tp, t.pp, t.params_dtype, t.ep)
