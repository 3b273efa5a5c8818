"""The main job: one controller driving the trainer, generator and reward executors.

Launch from the repo root (the README's ``make run`` runs the first line):

    python -m rl.train                                  # embedded default: tiny_arithmetic
    python -m rl.train rl.mode=sync                     # the synchronous baseline
    python -m rl.train experiment=tiny_sft              # supervised warm-up only
    torchrun --nproc-per-node 5 -m rl.train ...         # ranks started by torchrun / srun

The config is composed and validated here before any rank starts. One launch starts every
rank; the role map (rl/controller/roles.py) makes rank 0 the controller, then come the
trainer ranks (Megatron, tp*pp*dp), the generator ranks (SGLang servers) and the reward
ranks, each executor on a process group of its own. The trainer warms the policy up on
the task, then the controller runs the loop in :func:`controller`: rollouts stream from
the generator (up to ``algorithm.max_policy_lag`` versions ahead in async mode), are
scored by the reward ranks, trained on with AIPO, and the new weights go from trainer
shards straight into the servers (DDMA) after every step.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from rl.config import ConfigError, register, validate
from rl.controller.roles import RoleMap
from rl.dist.launch import quiet_known_warnings, spawn, under_launcher

SHOW = (
    "reward_mean",
    "accuracy",
    "eval_accuracy",
    "lag_mean",
    "gen_tokens_per_s",
    "train_tokens_per_s",
    "sync_s",
    "step_s",
)


def controller(cfg: DictConfig, job: Any) -> dict[str, float]:
    """Rank 0: wait for the warm-up, run the RL loop, then stop every executor."""
    from rl.controller import resume
    from rl.generator.service import GeneratorHandle
    from rl.metrics import MetricsLogger, plot_curves, plot_rl
    from rl.reward.service import RewardHandle
    from rl.trainer.service import TrainerHandle

    out = Path(cfg.run.output_dir)
    point = resume.read(out) if cfg.rl.steps > 0 else None  # a restarted (requeued) job
    if point is not None:  # what the lost attempt logged after its checkpoint goes
        resume.truncate_metrics(out / "metrics.jsonl", point.step)
        print(f"resuming from RL step {point.step} ({point.checkpoint})", flush=True)
    log = MetricsLogger(out, totals={"warmup": cfg.sft.steps, "rl": cfg.rl.steps})
    trainer = TrainerHandle(job)
    handles = [trainer]
    try:
        ready = trainer.wait_ready(log)  # the warm-up's lines are logged as it runs
        if cfg.rl.steps == 0:
            acc = ready.warmup_accuracy
            plot_curves(out / "metrics.jsonl", out / "curves.png", ("loss", "eval_accuracy"))
            print(f"done: held-out accuracy {acc:.3f}; checkpoint {ready.checkpoint}")
            return {"warmup_accuracy": acc}
        handles += [GeneratorHandle(job), RewardHandle(job)]
        result = rl_loop(cfg, *handles, log, ready.warmup_accuracy, point)
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


def rl_loop(
    cfg: DictConfig,
    trainer: Any,
    gen: Any,
    reward: Any,
    log: Any,
    warmup_accuracy: float | None,
    point: Any = None,
) -> dict[str, float]:
    """RL steps ``first``..``rl.steps`` (``first`` > 1 when resuming ``point``)."""
    from rl.controller import resume
    from rl.controller.batch import build_batch
    from rl.controller.rollouts import RolloutStream
    from rl.controller.staleness import StalenessGate
    from rl.ddma.live import connect
    from rl.generator.client import GeneratorClient
    from rl.generator.types import SamplingParams
    from rl.tasks.arithmetic import PAD, AdditionTask

    steps, r, a = cfg.rl.steps, cfg.rollout, cfg.algorithm
    task = AdditionTask(cfg.task.digits, cfg.task.seed, cfg.task.eval_size)
    sampling = SamplingParams.from_dict({**r.sampling, "n": a.group_size})
    out, first = Path(cfg.run.output_dir), point.step + 1 if point else 1
    if point is not None:  # fresh problems, the same on every attempt resumed here
        task.reseed(first)
    urls, model_path = gen.wait_up()
    client = GeneratorClient.for_urls(urls, model_path, r)
    sync = connect(cfg, trainer, urls)
    version = first  # the trainer's weights as they are now (after step first - 1)
    push(sync, trainer, client, version)
    if point is None:
        start = evaluate(client, task)
        log.log(0, {"eval_accuracy": start}, phase="rl_eval")
    else:
        start = point.start_accuracy

    if first > steps:  # the lost attempt had finished all its steps (and saved them)
        final = evaluate(client, task)
        client.close()
        return {"start_accuracy": start, "final_accuracy": final}

    def save(step: int, path: str) -> None:
        trainer.save(path)
        resume.write(out, resume.ResumePoint(step, path, start, warmup_accuracy))

    def score(g):
        pairs = [(task.response_text(x.output_ids), task.answer_text(g.item)) for x in g.rollouts]
        return reward.score(pairs)

    gate = StalenessGate(
        0 if cfg.rl.mode == "sync" else a.max_policy_lag, a.stale, per_step=cfg.rl.prompts_per_step
    )
    stream = RolloutStream(
        client,
        score,
        lambda: task.sample(1)[0],
        lambda p: p.prompt(task.digits),
        sampling,
        gate,
        version,
        r.segment_tokens,
    ).start()
    seq_len = task.prompt_len + sampling.max_new_tokens
    t_last = time.perf_counter()
    try:
        for step in range(first, steps + 1):
            groups, m = stream.next_batch(version)  # waits only if nothing is fresh enough
            batch = build_batch(
                [g.rollouts for g in groups],
                [g.rewards for g in groups],
                a.normalize_std,
                PAD,
                seq_len,
            )
            m.update(trainer.train(step, batch))
            m["train_s"], m["train_tokens_per_s"] = m.pop("step_seconds"), m.pop("tokens_per_s")
            version += 1
            m.update(push(sync, trainer, client, version))
            stream.commit(version)
            m["reward_mean"] = batch["rewards"].mean().item()
            m["accuracy"] = (batch["rewards"] == 1).float().mean().item()  # fully right
            m.update(reward_failures=reward.failures, reward_timeouts=reward.timeouts)
            if step % (cfg.rl.eval_every or steps) == 0 or step == steps:
                m["eval_accuracy"] = evaluate(client, task)
                log.log(step, {"eval_accuracy": m["eval_accuracy"]}, phase="rl_eval", echo=False)
            now = time.perf_counter()
            m["step_s"], t_last = now - t_last, now
            m["trainer_idle_frac"] = 1 - min((m["train_s"] + m["sync_s"]) / m["step_s"], 1.0)
            echo = step % cfg.rl.log_every == 0 or step == steps
            log.log(step, m, phase="rl", echo=echo, show=SHOW)
            if cfg.rl.save_interval and step % cfg.rl.save_interval == 0 and step < steps:
                save(step, str(out / "checkpoint"))
    finally:
        stream.close()
        client.close()
    save(steps, cfg.trainer.save_dir or str(out / "checkpoint"))
    return {"start_accuracy": start, "final_accuracy": m["eval_accuracy"]}


def push(sync: Any, trainer: Any, client: Any, version: int) -> dict[str, float]:
    """DDMA the trainer's weights into every server as ``version``; route rollouts by it."""
    stats = sync.push(version, lambda: trainer.push(version))
    client.adopt_version(version)
    return stats


def evaluate(client: Any, task: Any) -> float:
    """Held-out greedy accuracy of the policy the servers hold."""
    from rl.generator.types import SamplingParams

    greedy = SamplingParams(temperature=0, max_new_tokens=task.answer_len)
    problems = task.eval_set
    outs = client.generate([p.prompt(task.digits) for p in problems], greedy)
    return sum(task.reward(p, o.output_ids) for p, o in zip(problems, outs, strict=True)) / len(
        problems
    )


def run(cfg: DictConfig) -> dict[str, float]:
    """One rank of the job: join it, then act as the role the role map gives this rank."""
    from rl.controller.job import join

    quiet_known_warnings()
    job = join(cfg, cfg.trainer.device)
    _title(f"msrl:{job.role}:{job.role_rank}")
    if node := os.environ.get("SLURMD_NODENAME"):  # where each rank runs, for operators
        print(f"[job] {job.role} {job.role_rank} on {node} (rank {job.rank})", flush=True)
    try:
        if job.role == "controller":
            return controller(cfg, job)
        if job.role == "trainer":
            from rl.trainer.service import serve
        elif job.role == "generator":
            from rl.generator.service import serve
        else:
            from rl.reward.service import serve
        serve(cfg, job)
        return {}
    finally:
        job.finish()


def _title(title: str) -> None:
    """Name this rank's process after its role, for ps and top (best effort)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from rl.controller import resume

    try:  # under a launcher, its world must be exactly the role map's
        validate(cfg, world_size=int(os.environ["WORLD_SIZE"]) if under_launcher() else None)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    try:  # a restarted job's state, checked before any rank starts
        if cfg.rl.steps > 0:
            resume.read(cfg.run.output_dir)
    except resume.ResumeError as e:
        sys.exit(f"resume error: {e}")
    if under_launcher():
        run(cfg)
        return
    roles, t = RoleMap.from_config(cfg), cfg.trainer
    print(f"starting {roles.describe()}: trainer tp={t.tp} pp={t.pp} dp={t.dp} on {t.device}")
    print(OmegaConf.to_yaml(cfg), flush=True)
    spawn(run, roles.world_size, cfg, device=t.device, timeout_s=24 * 3600, setup=False)


if __name__ == "__main__":
    register()
    main()
