"""The controller (rank 0 of the job): the warm-up's log, then the RL stage
(rl/controller/run.py), then every executor stopped."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rl.checkpoints import resume
from rl.controller import rollout_state
from rl.controller.run import RLRun
from rl.metrics import (
    RESUMED_PHASES,
    WARMUP_PHASES,
    MetricsLogger,
    WandbRun,
    drop_jsonl_after,
    plot_curves,
    plot_rl,
)
from rl.tasks import build_task

if TYPE_CHECKING:
    from rl.companion.service import CompanionHandle
    from rl.config.schema import RootConfig
    from rl.controller.model_reward import ModelReward
    from rl.generator.service import GeneratorHandle
    from rl.reward.service import RewardHandle
    from rl.runtime.job import Job


def controller(cfg: RootConfig, job: Job) -> dict[str, float | None]:
    """Rank 0: wait for the warm-up, run the RL loop, then stop every executor."""
    from rl.generator.service import GeneratorHandle
    from rl.reward.service import RewardHandle
    from rl.trainer.service import TrainerHandle

    out = Path(cfg.run.output_dir)
    point = resume.read(out) if cfg.rl.steps > 0 else None  # a restarted (requeued) job
    # What a lost attempt logged that this one logs again goes: after the checkpoint it
    # resumes from, or all of it for a job that starts over (killed before any RL
    # checkpoint, it runs its warm-up again too). So each step is in the files once.
    redo: tuple[str, ...] = RESUMED_PHASES
    after = point.step if point is not None else -1
    if point is None and cfg.sft.steps:
        redo = (*WARMUP_PHASES, *RESUMED_PHASES)
    drop_jsonl_after(out / rollout_state.TRAINED, after)  # metrics: the logger's
    if point is not None:
        print(f"resuming from RL step {point.step} ({point.checkpoint})", flush=True)
    log = MetricsLogger(out, totals={"warmup": cfg.sft.steps, "rl": cfg.rl.steps},
                        resume_step=after, wandb_run=WandbRun.from_config(cfg),
                        redo_phases=redo)  # fmt: skip
    trainer = TrainerHandle(job)
    handles: list[TrainerHandle | GeneratorHandle | RewardHandle | CompanionHandle] = [trainer]
    try:
        ready = trainer.wait_ready(log)  # the warm-up's lines are logged as it runs
        if cfg.rl.steps == 0:
            acc = ready.warmup_accuracy
            plot_curves(out / "metrics.jsonl", out / "curves.png", ("loss", "eval_accuracy"))
            shown = "n/a" if acc is None else f"{acc:.3f}"
            print(f"done: held-out accuracy {shown}; checkpoint {ready.checkpoint}")
            return {"warmup_accuracy": acc if acc is not None else float("nan")}
        gen, reward = GeneratorHandle(job), RewardHandle(job, cfg.reward)
        handles += [gen, reward]
        critic = _critic(cfg, job, ready.begin, point)
        if critic is not None:
            handles.append(critic)
        task = build_task(cfg)  # the controller's one task (the executors' are their own)
        model_reward = _reward_model(cfg, job, task.codec.pad_id)
        if model_reward is not None:
            handles.append(model_reward.handle)
        teacher = _frozen(cfg, job, "teacher")
        if teacher is not None:
            handles.append(teacher)
        run = RLRun(
            cfg,
            task,
            trainer,
            gen,
            reward=reward,
            critic=critic,
            model_reward=model_reward,
            teacher=teacher,
            log=log,
            warmup_accuracy=ready.warmup_accuracy,
            point=point,
        )
        result = run.run()
        plot_rl(out / "metrics.jsonl", out / "curves.png")
        print(
            f"done: held-out accuracy {result['start_accuracy']:.3f} -> "
            f"{result['final_accuracy']:.3f} after {cfg.rl.steps} RL steps; metrics, plot and "
            f"checkpoint in {out}"
        )
        return {"warmup_accuracy": ready.warmup_accuracy, **result}
    finally:  # also on error: every executor's ranks exit (and stop their servers)
        for handle in handles:
            handle.stop()
        log.close()


def _critic(
    cfg: RootConfig, job: Job, policy: str | None, point: resume.ResumePoint | None
) -> CompanionHandle | None:
    """The critic, started from the policy's starting weights (a fresh head) or from its HF
    checkpoint (``critic.init=hf``, converted once and cached), or from its own checkpoint
    of the resumed step; None without one."""
    if not cfg.critic.enabled:
        return None
    from rl.companion import critic as c
    from rl.companion.service import CompanionHandle, Init

    handle = CompanionHandle(job, c.ROLE)
    if point is not None:
        handle.init(Init(c.checkpoint_of(point.checkpoint), "resume"))
    elif cfg.critic.init == "hf":
        cache = str(Path(cfg.run.output_dir) / "hf_cache")
        handle.init(Init(cfg.critic.hf_checkpoint, "hf", cache))
    else:
        handle.init(Init(policy, "decoder"))
    return handle


def _frozen(cfg: RootConfig, job: Job, role: str) -> CompanionHandle | None:
    """The frozen model of ``role`` (a reward model, a teacher), loaded from its HF
    directory (converted once to its layout, cached under the run's ``hf_cache``); None
    when that role is not configured."""
    section = getattr(cfg, role)
    if not section.enabled:
        return None
    from rl.companion.service import CompanionHandle, Init

    handle = CompanionHandle(job, role)
    handle.init(Init(section.hf_checkpoint, "hf", str(Path(cfg.run.output_dir) / "hf_cache")))
    return handle


def _reward_model(cfg: RootConfig, job: Job, pad_id: int) -> ModelReward | None:
    """The reward model and the scorer that combines it with the rule; None without one."""
    r = cfg.reward_model
    if not r.enabled:
        return None
    from rl.companion import reward_model as rm
    from rl.controller.model_reward import ModelReward

    handle = _frozen(cfg, job, rm.ROLE)
    assert handle is not None
    t = r.trainer
    rows = t.dp if t.max_tokens_per_microbatch else t.micro_batch_size * t.dp
    norm, weights = rm.Normaliser.from_config(r), rm.weights(cfg.reward)
    pad = rm.pad_token_id(str(r.hf_checkpoint))
    if pad is None:
        print("reward model: its config.json has no pad_token_id: each sample is scored at "
              "its last token, as transformers scores one sequence alone", flush=True)  # fmt: skip
    return ModelReward(handle, norm, weights, pad_id=pad_id, pad_token_id=pad,
                       rows_multiple=rows)  # fmt: skip
