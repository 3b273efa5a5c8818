"""The RL stage as one object: :meth:`RLRun.setup` once, :meth:`RLRun.step` per step,
:meth:`RLRun.save` at every save point and at the end.

A step, in order (:meth:`RLRun.step` is these calls):

1. take the step's batch: scored groups the rollout stream generated (up to
   ``algorithm.max_policy_lag`` versions ahead in async mode), assembled by the prefetch
   thread while the last step trained;
2. ask the prefetch thread for the next step's batch (not across a save: a save snapshots
   the stream);
3. train on the batch (the trainer computes the advantages and the loss); with a critic,
   it trains on the batch while the policy does (a teacher's log-probs and a critic's
   values of the batch were taken as it was assembled: rl/controller/model_steps.py);
4. in lockstep (``rl.deterministic``), wait for the round's last segments;
5. push the new weights into every live server (DDMA) as the next version; the weight
   sync's listeners hear of it (see :data:`LISTENERS`);
6. gather the step's counters: server restarts, reward failures, rejected messages;
7. note what was not trained on (re-queued, set aside, and at a save or the end, held);
8. evaluate on the held-out set every ``rl.eval_every`` steps and at the last;
9. hand the step's records to the step-log thread (written while the next step runs);
10. at a save point, wait for the records, then save checkpoint, stream state and resume
    point.

Only training and the push sit on the critical path (a teacher's log-probs and a
critic's values of a batch are taken while it is assembled ahead; a reward model scores
each group as it is generated). What
runs beside the steps is started in :meth:`RLRun.setup`, each thread named in
:data:`rl.threads.THREADS`;
nothing else acts during a step. Everything the run touches is a handle
to an executor (trainer, generator, reward, the model executors: a critic, a reward model,
a teacher) or the task protocol; it knows no concrete task, model or transport.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from rl.batch import TrainBatch
from rl.checkpoints import resume
from rl.companion.critic import checkpoint_of
from rl.config.sampling import SamplingParams
from rl.controller import rollout_state
from rl.controller.batch import build_batch, no_signal
from rl.controller.episodes import EpisodeDriver, episode_metrics
from rl.controller.evaluate import Evaluator, score_items
from rl.controller.lockstep import LockstepStream
from rl.controller.model_steps import ModelSteps
from rl.controller.prefetch import Background, BatchPrefetch
from rl.controller.recovery import ServerRecovery
from rl.controller.rollouts import Group, RolloutStream, StreamState
from rl.controller.staleness import StalenessGate
from rl.controller.stall import StallWatch
from rl.controller.weight_sync import SyncResult, WeightSync
from rl.models.vision.tokens import special_ids
from rl.runtime.channel import rejected_total
from rl.tasks import Task

if TYPE_CHECKING:
    from concurrent.futures import Future

    from rl.companion.service import CompanionHandle
    from rl.config.schema import RootConfig
    from rl.controller.model_reward import ModelReward
    from rl.generator.client import GeneratorClient
    from rl.generator.service import GeneratorHandle
    from rl.metrics import MetricsLogger
    from rl.reward.service import RewardHandle
    from rl.tasks.scoring import ScoreResult
    from rl.trainer.service import TrainerHandle

# Told of every version the weight sync commits (in step 5 and at setup's first push).
LISTENERS = {
    "route": "the client routes each server by the version it now serves",
    "stream": "the rollout stream's lag bound moves to the new version",
}

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


class Ledger(NamedTuple):
    """A step's record of the rollouts not trained on (rollout_state.log_trained): ids
    re-queued from a lost server, groups set aside (dropped, skipped), and at a save or the
    run's end the groups still held."""

    requeued: list[str]
    aside: list[tuple[str, Group]]
    held: StreamState | None


def rollout_sampling(cfg: RootConfig, task: Task) -> SamplingParams:
    """The rollouts' sampling: ``group_size`` samples, ending on every EOS id of the task's
    tokenizer as well as the model's."""
    s = SamplingParams.from_config(cfg.rollout.sampling, n=cfg.algorithm.group_size)
    stops = tuple(dict.fromkeys((*s.stop_token_ids, *task.codec.eos_ids)))
    seed = cfg.trainer.seed if s.seed is None and cfg.rl.deterministic else s.seed
    v = cfg.model.vision
    return replace(s, stop_token_ids=stops, seed=seed,
                   banned_ids=special_ids(v) if v is not None else ())  # fmt: skip


class RLRun:
    """RL steps ``first``..``rl.steps`` of a job (``first`` > 1 when resuming ``point``),
    on ``task``, over the executors' handles."""

    def __init__(
        self,
        cfg: RootConfig,
        task: Task,
        trainer: TrainerHandle,
        gen: GeneratorHandle,
        *,
        reward: RewardHandle,
        log: MetricsLogger,
        warmup_accuracy: float | None,
        point: resume.ResumePoint | None = None,
        critic: CompanionHandle | None = None,
        model_reward: ModelReward | None = None,
        teacher: CompanionHandle | None = None,
    ) -> None:
        self.cfg, self.task, self.trainer, self.gen, self.reward = cfg, task, trainer, gen, reward
        self.critic, self.model_reward, self.teacher = critic, model_reward, teacher
        self.log, self.warmup_accuracy, self.point = log, warmup_accuracy, point
        self.out, self.steps = Path(cfg.run.output_dir), cfg.rl.steps
        self.first = point.step + 1 if point else 1
        self.models = ModelSteps(critic, teacher, self.first)
        self.start_accuracy = float("nan")
        self.final_accuracy = float("nan")
        self._t_last = time.perf_counter()
        # What close() shuts down, once set up.
        self.client: GeneratorClient | None = None
        self.recovery: ServerRecovery | None = None
        self.stream: RolloutStream | None = None
        self.books: Background | None = None
        self.stall = StallWatch(cfg.rl.stall_warn_s, [reward.waiting])
        self.left: StreamState | None = None  # the stream's last snapshot (a save's, the end's)
        self.episodes = EpisodeDriver.from_setup(task.episodes) if task.episodes else None

    def run(self) -> dict[str, float]:
        """Every step, the final evaluation and the final save."""
        self.setup()
        try:
            for step in range(self.first, self.steps + 1):
                self.step(step)
        finally:
            self.close()
        if self.first <= self.steps:  # else the lost attempt finished and saved them all
            self.save(
                self.steps, self.cfg.trainer.save_dir or str(self.out / "checkpoint"), self.left
            )
        return {"start_accuracy": self.start_accuracy, "final_accuracy": self.final_accuracy}

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        """Servers up, the trainer's weights in them as version ``first``, the held-out
        start (or the resumed one's), and every thread beside the steps
        (:data:`rl.threads.THREADS`) and every one of :data:`LISTENERS` started or
        registered."""
        from rl.generator.client import GeneratorClient
        from rl.serving.server_api import job_keys

        cfg, task = self.cfg, self.task
        print(task.describe(), flush=True)
        self.stall.start()  # stall-watch
        sampling = rollout_sampling(cfg, task)
        saved = rollout_state.load(self.out, self.point)  # a resumed job's rollouts
        self.prompts = task.train_stream(saved.position if saved else None)
        urls, model_path = self.gen.wait_up()
        self.client = client = GeneratorClient.for_urls(
            urls, model_path, cfg.rollout, job_keys(), routing=cfg.algorithm.routing_replay
        )
        self.evaluator = Evaluator(
            client,
            task,
            self.reward,
            replace(sampling, n=1),
            k=cfg.rl.eval_k,
            threshold=cfg.reward.pass_threshold,
            samples_dir=self.out / "eval",
            episodes=self.episodes,
        )
        # The trainer's weights as they are now (after step first - 1) become version first.
        self.sync = WeightSync.connect(cfg, self.trainer, urls, weight_version=self.first - 1)
        self.sync.listeners.append(self._route)  # listener: route
        self.push()
        self.recovery = ServerRecovery(self.gen, self.sync, client).start()  # server-recovery
        if self.point is None:
            self.stall.at("the held-out evaluation before RL")
            start = self.evaluator.run()
            self.log.log(0, start, phase="rl_eval")
            self.start_accuracy = start["eval_accuracy"]
        else:
            self.start_accuracy = self.point.start_accuracy
        if self.first > self.steps:  # the lost attempt had finished all its steps
            self.final_accuracy = self.evaluator.run(self.steps)["eval_accuracy"]
            return
        self.stream = stream = self._stream(client, sampling, saved)  # rollout stream
        self.sync.listeners.append(lambda r: stream.commit(r.version))  # listener: stream
        self.fetch = BatchPrefetch(stream, self._assemble)  # batch-prefetch, on request
        self.books = Background("step-log")
        self._t_last = time.perf_counter()

    def _stream(
        self, client: GeneratorClient, sampling: SamplingParams, saved: StreamState | None
    ) -> RolloutStream:
        cfg, a = self.cfg, self.cfg.algorithm
        lag = 0 if cfg.rl.mode == "sync" else a.max_policy_lag
        gate = StalenessGate(lag, a.stale, per_step=cfg.rl.prompts_per_step)

        def score(g: Group) -> Future[list[ScoreResult]]:
            items = score_items(self.task, [g.item] * len(g.rollouts), g.rollouts)
            rule = self.reward.score(items)
            return self.model_reward.score(g.rollouts, rule) if self.model_reward else rule

        def uniform(g: Group) -> bool:
            return no_signal(g.rollouts, g.rewards, a.overlong, a.overlong_penalty)

        drop = uniform if a.drop_uniform_groups else None
        seg, where = cfg.rollout.segment_tokens, self.prompts.position
        draw, version = self.prompts.__next__, self.sync.weight_version
        if cfg.rl.deterministic:  # batches and versions set by the step number
            stream: RolloutStream = LockstepStream(
                client, score, draw, sampling, gate=gate, version=version, last=self.steps,
                segment_tokens=seg, drop_uniform=drop, position=where,
            )  # fmt: skip
        else:
            stream = RolloutStream(
                client, score, draw, sampling, gate=gate, version=version, segment_tokens=seg,
                drop_uniform=drop, position=where, episodes=self.episodes,
            )  # fmt: skip
        if saved is not None:
            print(f"rollout state of step {saved.step}: {stream.restore(saved)}", flush=True)
        return stream.start()

    def _assemble(self, groups: list[Group], step: int, m: dict[str, float]) -> TrainBatch:
        """Step ``step``'s batch (the trainer's version at a step is the step's number:
        setup's push makes it ``first``), with what the model executors add to it."""
        a = self.cfg.algorithm
        batch = build_batch([g.rollouts for g in groups], [g.rewards for g in groups],
                            pad_id=self.task.codec.pad_id, overlong=a.overlong,
                            overlong_penalty=a.overlong_penalty)  # fmt: skip
        return self.models.annotate(step, batch, m)

    # ------------------------------------------------------------------ one step
    def step(self, step: int) -> None:
        """One RL step, in the order of the module's docstring."""
        assert self.client and self.recovery and self.books and self.stream, "step before setup"
        version, at = self.sync.weight_version, self.stall.at
        at(f"the batch of RL step {step}")
        groups, batch, m = self.fetch.take(version)  # 1. usually taken during the last step
        with self.sync.lock:  # no server re-push between a step and the push of its weights
            t_train = time.perf_counter()
            if step < self.steps and not self._saves(step):  # 2.
                self.fetch.request(version + 1)  # the version this step's push publishes
            at(f"the trainer's RL step {step}")
            self.models.train(step, batch)  # 3. a critic's step, beside the policy's
            images = [r.images for g in groups for r in g.rollouts]
            m.update(self.trainer.train(step, batch, images if any(images) else []))
            m.update(self.models.trained())
            at(f"the last segments of RL step {step}'s round")
            m["round_wait_s"] = self.stream.finish_round()  # 4. (0 outside lockstep)
            t_push = time.perf_counter()
            at(f"the push of weight version {version + 1}")
            m.update(self.push().metrics())  # 5. listeners: route, stream
        m["train_call_s"], m["push_call_s"] = t_push - t_train, time.perf_counter() - t_push
        m.update(self._counters())  # 6.
        ledger = self._ledger(step, m)  # 7.
        at(f"the held-out evaluation after RL step {step}")
        ev = self._evaluate(step, m)  # 8.
        self._times(m)
        self.books.submit(self._record, step, groups, batch, m, ev, ledger)  # 9.
        if self._saves(step):  # 10. a resume point follows every record up to its step
            self.books.drain()
            self.save(step, str(self.out / "checkpoint"), ledger.held)

    def _counters(self) -> dict[str, float]:
        """The run's totals at this step: server restarts, reward failures and timeouts,
        score requests sent again, given up and answered late, rejected messages; with a
        reward model, the samples it scored 0 as pad ids only."""
        assert self.recovery is not None
        r = self.reward
        out = {
            **self.recovery.stats(), "channel_rejected": float(rejected_total()),
            "reward_failures": r.failures, "reward_timeouts": r.timeouts,
            "reward_resent": r.resent, "reward_lost": r.lost, "reward_late": r.late,
        }  # fmt: skip
        if self.model_reward is not None:  # samples of the reward model's pad id only
            out["reward_model_all_pad"] = float(self.model_reward.all_pad)
        return out

    def _evaluate(self, step: int, m: dict[str, float]) -> dict[str, float] | None:
        """The held-out evaluation, every ``rl.eval_every`` steps and at the last."""
        if step % (self.cfg.rl.eval_every or self.steps) and step != self.steps:
            return None
        ev = self.evaluator.run(step)
        m["eval_accuracy"] = self.final_accuracy = ev["eval_accuracy"]
        return ev

    def _ledger(self, step: int, m: dict[str, float]) -> Ledger:
        """What the step leaves untrained: re-queued ids, groups set aside and, at a save
        or the last step (after which the stream stops), the groups the stream holds."""
        assert self.client and self.stream, "step before setup"
        if step == self.steps:
            self.stream.close()
        held = None
        if step == self.steps or self._saves(step):
            self.left = held = self.stream.snapshot()
            m["leftover_groups"] = float(len(held.groups))
            m["leftover_rollouts"] = float(sum(len(g.rollouts) for g in held.groups))
        return Ledger(self.client.take_requeued(), self.stream.take_set_aside(), held)

    def push(self) -> SyncResult:
        """DDMA the trainer's weights into every server as the next version (a server
        lost meanwhile gets none until it is restarted and re-pushed)."""
        assert self.client is not None, "push before setup"
        return self.sync.push(skip=self.client.dead())

    def _route(self, r: SyncResult) -> None:
        # Every server that committed confirmed it: no need to ask them for their version.
        assert self.client is not None
        self.client.adopt_version(r.version, r.committed)

    def _times(self, m: dict[str, float]) -> None:
        """The step's wall time and where it went."""
        m["train_s"], m["train_tokens_per_s"] = m.pop("step_seconds"), m.pop("tokens_per_s")
        now = time.perf_counter()
        m["step_s"], self._t_last = now - self._t_last, now
        m["trainer_idle_frac"] = 1 - min((m["train_s"] + m["sync_s"]) / m["step_s"], 1.0)
        # The step's time outside training, the sync and the wait for its batch: the
        # batch's transfer to the trainer, routing by the new version, bookkeeping.
        m["overhead_s"] = max(m["step_s"] - m["train_s"] - m["sync_s"] - m["wait_batch_s"], 0.0)

    def _record(
        self, step: int, groups: list[Group], batch: TrainBatch,
        m: dict[str, float], ev: dict[str, float] | None, ledger: Ledger,
    ) -> None:  # fmt: skip
        left = ledger.held.groups if ledger.held is not None else None
        rollout_state.log_trained(self.out, step, groups, ledger.requeued, ledger.aside, left)
        if ev is not None:
            self.log.log(step, ev, phase="rl_eval", echo=False)
        echo = step % self.cfg.rl.log_every == 0 or step == self.steps
        if self.cfg.rl.save_batches:
            save_batch(self.out / "batches" / f"step_{step:06d}.pt", batch)
        m = {**m, **batch_metrics(groups, batch, self.cfg.reward.pass_threshold)}
        self.log.log(step, m, phase="rl", echo=echo, show=SHOW)

    # ------------------------------------------------------------------ saving, closing
    def _saves(self, step: int) -> bool:
        every = self.cfg.rl.save_interval
        return bool(every) and step % every == 0 and step < self.steps

    def save(self, step: int, path: str, held: StreamState | None = None) -> None:
        """The trainer's checkpoint, the stream's state (``held``: as snapshot already),
        then the resume point naming both."""
        assert self.stream is not None, "save before setup"
        self.trainer.save(path, export_hf=self.cfg.rl.save_hf, step=step)
        companions = (self.critic.save(checkpoint_of(path)),) if self.critic is not None else ()
        state = rollout_state.save(self.out, step, held or self.stream.snapshot())
        point = resume.ResumePoint(
            step, path, self.start_accuracy, self.warmup_accuracy, rollouts=state,
            companions=companions,
        )  # fmt: skip
        resume.write(self.out, point)
        rollout_state.prune(self.out, keep=state)

    def close(self) -> None:
        """Stop what setup started (the stream's state stays readable for the final save)."""
        parts = (self.stall, self.books, self.recovery, self.stream, self.model_reward,
                 self.episodes, self.client)  # fmt: skip
        for part in parts:
            if part is not None:
                part.close()


def batch_metrics(groups: list[Group], batch: TrainBatch, threshold: float) -> dict[str, float]:
    """Reward, pass rate, response lengths, the reward function's own metrics and, for
    multi-turn samples, their episodes'."""
    assert batch.rewards is not None and batch.overlong is not None  # an RL batch
    lengths = [len(r.output_ids) for g in groups for r in g.rollouts]
    out = {
        "reward_mean": batch.rewards.mean().item(),
        "accuracy": (batch.rewards >= threshold).float().mean().item(),
        "response_len_mean": sum(lengths) / len(lengths),
        "response_len_max": float(max(lengths)),
        "overlong_frac": batch.overlong.mean().item(),
    }
    extra: dict[str, list[float]] = {}
    for g in groups:
        for res in g.results or ():
            for k, v in res.metrics.items():
                extra.setdefault(k, []).append(v)
    if rule := extra.get("rule"):  # a reward model's run: the accuracy is the rule's
        out["accuracy"] = sum(x >= threshold for x in rule) / len(rule)
    if model := extra.pop("model", None):
        t = torch.tensor(model, dtype=torch.float64)
        out["reward_model_mean"] = t.mean().item()
        out["reward_model_std"] = t.std(correction=0).item()
    out.update({f"reward_{k}": sum(v) / len(v) for k, v in extra.items()})
    out.update(episode_metrics([r for g in groups for r in g.rollouts]))
    return out


def save_batch(path: Path, batch: TrainBatch) -> None:
    """``rl.save_batches``: the batch's tensors by field name, written atomically."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(batch.tensors(), tmp)
    tmp.replace(path)
