"""The controller (rank 0 of the job): the warm-up's log, then the RL loop.

Each step takes the next scored groups from the rollout stream (generated up to
``algorithm.max_policy_lag`` versions ahead in async mode), builds the trainer's batch,
trains, pushes the new weights into every server (DDMA) and logs. Only training and the
push sit on the critical path: the next batch is taken and built while the trainer
trains, and a step's records are written while the next one runs
(rl/controller/prefetch.py). Everything the loop touches is a handle to an executor
(trainer, generator, reward) or the task protocol; it knows no concrete task, model or
transport.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from rl.config.sampling import SamplingParams
from rl.controller import rollout_state
from rl.controller.batch import build_batch, no_signal
from rl.controller.evaluate import Evaluator, score_items
from rl.controller.prefetch import Background, BatchPrefetch
from rl.controller.recovery import ServerRecovery
from rl.controller.rollouts import Group, RolloutStream
from rl.controller.staleness import StalenessGate
from rl.dist import resume
from rl.dist.channel import rejected_total
from rl.metrics import MetricsLogger, drop_jsonl_after, plot_curves, plot_rl
from rl.tasks import Task, build_task

if TYPE_CHECKING:  # the executors' handles, imported where they are used
    from concurrent.futures import Future

    import torch

    from rl.config.schema import RootConfig
    from rl.controller.weight_sync import WeightSync
    from rl.dist.job import Job
    from rl.generator.client import GeneratorClient
    from rl.generator.service import GeneratorHandle
    from rl.reward.service import RewardHandle
    from rl.tasks.scoring import ScoreResult
    from rl.trainer.service import TrainerHandle

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


def controller(cfg: RootConfig, job: Job) -> dict[str, float | None]:
    """Rank 0: wait for the warm-up, run the RL loop, then stop every executor."""
    from rl.generator.service import GeneratorHandle
    from rl.reward.service import RewardHandle
    from rl.trainer.service import TrainerHandle

    out = Path(cfg.run.output_dir)
    point = resume.read(out) if cfg.rl.steps > 0 else None  # a restarted (requeued) job
    if point is not None:  # what the lost attempt logged after its checkpoint goes
        drop_jsonl_after(out / rollout_state.TRAINED, point.step)  # metrics: the logger's
        print(f"resuming from RL step {point.step} ({point.checkpoint})", flush=True)
    log = MetricsLogger(out, totals={"warmup": cfg.sft.steps, "rl": cfg.rl.steps},
                        resume_step=point.step if point is not None else None)  # fmt: skip
    trainer = TrainerHandle(job)
    handles: list[TrainerHandle | GeneratorHandle | RewardHandle] = [trainer]
    try:
        ready = trainer.wait_ready(log)  # the warm-up's lines are logged as it runs
        if cfg.rl.steps == 0:
            acc = ready.warmup_accuracy
            plot_curves(out / "metrics.jsonl", out / "curves.png", ("loss", "eval_accuracy"))
            shown = "n/a" if acc is None else f"{acc:.3f}"
            print(f"done: held-out accuracy {shown}; checkpoint {ready.checkpoint}")
            return {"warmup_accuracy": acc if acc is not None else float("nan")}
        gen, reward = GeneratorHandle(job), RewardHandle(job)
        handles += [gen, reward]
        result = rl_loop(cfg, trainer, gen, reward, log, ready.warmup_accuracy, point)
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


def rollout_sampling(cfg: RootConfig, task: Task) -> SamplingParams:
    """The rollouts' sampling: ``group_size`` samples, ending on every EOS id of the task's
    tokenizer as well as the model's."""
    s = SamplingParams.from_config(cfg.rollout.sampling, n=cfg.algorithm.group_size)
    stops = tuple(dict.fromkeys((*s.stop_token_ids, *task.codec.eos_ids)))
    return replace(s, stop_token_ids=stops)


def rl_loop(
    cfg: RootConfig,
    trainer: TrainerHandle,
    gen: GeneratorHandle,
    reward: RewardHandle,
    log: MetricsLogger,
    warmup_accuracy: float | None,
    point: resume.ResumePoint | None = None,
) -> dict[str, float]:
    """RL steps ``first``..``rl.steps`` (``first`` > 1 when resuming ``point``)."""
    from rl.controller.weight_sync import WeightSync
    from rl.generator.client import GeneratorClient
    from rl.generator.server_api import job_keys

    steps, r, a = cfg.rl.steps, cfg.rollout, cfg.algorithm
    task = build_task(cfg)
    print(task.describe(), flush=True)
    sampling = rollout_sampling(cfg, task)
    out, first = Path(cfg.run.output_dir), point.step + 1 if point else 1
    # A resumed job takes up its checkpoint's rollouts and continues the prompt stream.
    saved = rollout_state.load(out, point)
    prompts = task.train_stream(saved.position if saved else None)
    urls, model_path = gen.wait_up()
    client = GeneratorClient.for_urls(urls, model_path, r, job_keys())
    evaluator = Evaluator(client, task, reward, replace(sampling, n=1), cfg.rl.eval_k,
                          cfg.reward.pass_threshold, out / "eval")  # fmt: skip
    # The trainer's weights as they are now (after step first - 1) become version first.
    sync = WeightSync.connect(cfg, trainer, urls, weight_version=first - 1)
    push(sync, client)
    version = sync.weight_version
    recovery = ServerRecovery(gen, sync, client).start()  # restarted servers come back
    if point is None:
        start_eval = evaluator.run()
        log.log(0, start_eval, phase="rl_eval")
        start = start_eval["eval_accuracy"]
    else:
        start = point.start_accuracy

    if first > steps:  # the lost attempt had finished all its steps (and saved them)
        final = evaluator.run(steps)["eval_accuracy"]
        recovery.close()
        client.close()
        return {"start_accuracy": start, "final_accuracy": final}

    def save(step: int, path: str) -> None:
        trainer.save(path, export_hf=cfg.rl.save_hf, step=step)
        state = rollout_state.save(out, step, stream.snapshot())
        resume.write(out, resume.ResumePoint(step, path, start, warmup_accuracy, state))
        rollout_state.prune(out, keep=state)

    def score(g: Group) -> Future[list[ScoreResult]]:
        return reward.score(score_items(task, [g.item] * len(g.rollouts), g.rollouts))

    gate = StalenessGate(
        0 if cfg.rl.mode == "sync" else a.max_policy_lag, a.stale, per_step=cfg.rl.prompts_per_step
    )

    def uniform(g: Group) -> bool:
        return no_signal(g.rollouts, g.rewards, a.overlong, a.overlong_penalty)

    drop = uniform if a.drop_uniform_groups else None
    stream = RolloutStream(client, score, lambda: next(prompts), sampling, gate, version,
                           r.segment_tokens, drop_uniform=drop,
                           position=prompts.position)  # fmt: skip
    if saved is not None:
        print(f"rollout state of step {saved.step}: {stream.restore(saved)}", flush=True)
    stream.start()

    def assemble(groups: list[Group]) -> dict[str, torch.Tensor]:
        return build_batch([g.rollouts for g in groups], [g.rewards for g in groups],
                           a.normalize_std, task.codec.pad_id, None, a.overlong,
                           a.overlong_penalty)  # fmt: skip

    def saves(step: int) -> bool:
        return bool(cfg.rl.save_interval) and step % cfg.rl.save_interval == 0 and step < steps

    def record(
        step: int,
        groups: list[Group],
        batch: dict[str, torch.Tensor],
        m: dict[str, float],
        ev: dict[str, float] | None,
        requeued: list[str],
    ) -> None:
        rollout_state.log_trained(out, step, groups, requeued)
        if ev is not None:
            log.log(step, ev, phase="rl_eval", echo=False)
        echo = step % cfg.rl.log_every == 0 or step == steps
        m = {**m, **batch_metrics(groups, batch, cfg.reward.pass_threshold)}
        log.log(step, m, phase="rl", echo=echo, show=SHOW)

    fetch = BatchPrefetch(stream, assemble)
    books = Background("step-log")  # a step's records are written while the next one runs
    t_last = time.perf_counter()
    m: dict[str, float] = {}
    try:
        for step in range(first, steps + 1):
            # Waits only if nothing is fresh enough; usually taken during the last step.
            groups, batch, m = fetch.take(version)
            with sync.lock:  # no server re-push between a step and the push of its weights
                t_train = time.perf_counter()
                if step < steps and not saves(step):  # a save snapshots the stream: not then
                    fetch.request(version + 1)  # the version this step's push publishes
                m.update(trainer.train(step, batch))
                t_push = time.perf_counter()
                m.update(push(sync, client))
            m["train_call_s"], m["push_call_s"] = t_push - t_train, time.perf_counter() - t_push
            m["train_s"], m["train_tokens_per_s"] = m.pop("step_seconds"), m.pop("tokens_per_s")
            version = sync.weight_version
            stream.commit(version)
            m.update(recovery.stats(), channel_rejected=float(rejected_total()))
            m.update(reward_failures=reward.failures, reward_timeouts=reward.timeouts)
            requeued, ev = client.take_requeued(), None
            if step % (cfg.rl.eval_every or steps) == 0 or step == steps:
                ev = evaluator.run(step)
                m["eval_accuracy"] = ev["eval_accuracy"]
            now = time.perf_counter()
            m["step_s"], t_last = now - t_last, now
            m["trainer_idle_frac"] = 1 - min((m["train_s"] + m["sync_s"]) / m["step_s"], 1.0)
            # The step's time outside training, the sync and the wait for its batch: the
            # batch's transfer to the trainer, routing by the new version, bookkeeping.
            m["overhead_s"] = max(m["step_s"] - m["train_s"] - m["sync_s"] - m["wait_batch_s"], 0.0)
            books.submit(record, step, groups, batch, m, ev, requeued)
            if saves(step):  # a resume point follows every record up to its step
                books.drain()
                save(step, str(out / "checkpoint"))
    finally:
        books.close()
        recovery.close()
        stream.close()
        client.close()
    save(steps, cfg.trainer.save_dir or str(out / "checkpoint"))
    return {"start_accuracy": start, "final_accuracy": m["eval_accuracy"]}


def batch_metrics(
    groups: list[Group], batch: dict[str, torch.Tensor], threshold: float
) -> dict[str, float]:
    """Reward, pass rate, response lengths and the reward function's own metrics."""
    rewards = batch["rewards"]
    lengths = [len(r.output_ids) for g in groups for r in g.rollouts]
    out = {
        "reward_mean": rewards.mean().item(),
        "accuracy": (rewards >= threshold).float().mean().item(),
        "response_len_mean": sum(lengths) / len(lengths),
        "response_len_max": float(max(lengths)),
        "overlong_frac": batch["overlong"].mean().item(),
    }
    extra: dict[str, list[float]] = {}
    for g in groups:
        for res in g.results or ():
            for k, v in res.metrics.items():
                extra.setdefault(k, []).append(v)
    out.update({f"reward_{k}": sum(v) / len(v) for k, v in extra.items()})
    return out


def push(sync: WeightSync, client: GeneratorClient) -> dict[str, float]:
    """DDMA the trainer's weights into every server as the next version; route rollouts
    by it (a server lost meanwhile gets none until it is restarted and re-pushed)."""
    skip = client.dead()
    stats = sync.push(skip=skip)
    lost = stats.pop("lost")
    missed = set(skip) | set(lost if isinstance(lost, list) else ())
    # Every server not lost confirmed its commit: no need to ask them for their version.
    client.adopt_version(sync.weight_version, [i for i in range(len(sync.targets))
                                               if i not in missed])  # fmt: skip
    out = {k: float(v) for k, v in stats.items() if isinstance(v, (int, float))}
    return {**out, "sync_lost_servers": float(len(lost) if isinstance(lost, list) else 0)}
