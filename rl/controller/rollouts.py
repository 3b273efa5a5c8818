"""The controller's generation side: keep the servers busy within the staleness bound.

A background thread starts groups (one prompt x ``group_size`` samples) whenever the
:class:`~rl.controller.staleness.StalenessGate` allows, hands every finished group to the
reward executor, and queues scored groups for the trainer in the order they finish. The
trainer's side, :meth:`RolloutStream.next_batch`, takes the next ``per_step`` groups that
are fresh enough; it blocks only when none are ready, which is exactly when the staleness
bound (or a slow generator) requires it.

Dynamic sampling: ``drop_uniform(group)`` tells a scored group that carries no advantage
signal (rewards all equal after the overlong rule: every sample right, every one wrong, or
every one cut by length); it is skipped, counted and replaced by a new group, so a batch
holds only groups that teach something. A run of such groups with no group kept between
them is said once at ``UNIFORM_WARN`` (with why and what to change) and ends the run at
``UNIFORM_FAIL``: a task whose every group is uniform would otherwise resample forever.

Partial rollouts: with ``segment_tokens`` a response is cut after that many new tokens
and parked; it resumes (prompt + tokens so far) once a newer policy version is committed,
or at once if the generator would otherwise sit idle. Every token keeps the behaviour
log-prob and the version it was sampled with, so one response can span versions.

Resume: :meth:`RolloutStream.snapshot` is what an RL checkpoint saves of the stream (every
group drawn and not trained on, and the prompt stream's position; the file format is in
rl/controller/rollout_state.py), and :meth:`RolloutStream.restore` takes it up in a
resumed job before the thread starts.

Rollout ids (the ledger's, rl/controller/rollout_state.py): what a sample is, never when it
arrived. Sample ``i`` of the group drawn ``index``-th from the run's prompt stream is
``g<index>.<i>`` (:func:`rollout_stem`), so runs that draw the same prompts name their
samples alike. A resumed free-running attempt samples a place of the run otherwise than
the lost attempt did (timing sets the versions), and that one may have written its samples
into the ledger under those ids before it was lost: so the resumed attempt marks what it
samples, ``s<step>.`` before a new group's ids and ``@<step>`` after those of a carried-over
sample it goes on with (``step``: the checkpoint it resumed from). A deterministic run's
samples at a place are the same in every attempt; its stream marks nothing
(rl/controller/lockstep.py).
"""

from __future__ import annotations

import concurrent.futures as cf
import copy
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from rl.config.errors import ConfigError
from rl.config.sampling import SamplingParams
from rl.controller.staleness import StalenessGate
from rl.generator.types import Rollout
from rl.tasks.common import Example
from rl.tasks.scoring import ScoreResult
from rl.threads import named_thread

if TYPE_CHECKING:
    from rl.controller.episodes import EpisodeDriver
    from rl.generator.client import GeneratorClient, RolloutFuture


def rollout_stem(index: int, resumed_from: int | None = None) -> str:
    """The stem of the ids of the group drawn ``index``-th from the run's prompt stream (its
    samples are ``<stem>.<i>``); ``resumed_from``: the checkpoint step of a free-running
    attempt that samples it, which marks it as its own."""
    return f"g{index}" if resumed_from is None else f"s{resumed_from}.g{index}"


def carried_rid(rid: str, resumed_from: int) -> str:
    """The id of a sample cut mid-response by a free-running attempt's loss, which the
    attempt resumed from checkpoint step ``resumed_from`` goes on with."""
    return f"{rid}@{resumed_from}"


class StreamClosed(RuntimeError):
    """:meth:`RolloutStream.next_batch` on a stream closed meanwhile."""


@dataclass
class Group:
    gid: int
    item: Example  # the prompt; its label scores the group
    start_version: int
    rollouts: list[Rollout] = field(default_factory=list)
    _: KW_ONLY
    results: list[ScoreResult] | None = None
    done: int = 0
    index: int = 0  # its prompt's place in the prompt stream (0: the run's first)
    restored_at: int | None = None  # the checkpoint step it was carried over from
    generated_at: float = 0.0  # when its last sample finished (perf_counter)
    step: int = 0  # the RL step it is drawn for (lockstep streams: rl/controller/lockstep.py)

    @property
    def rewards(self) -> list[float]:
        return [r.score for r in self.results or ()]

    @property
    def versions(self) -> list[int]:
        return [v for r in self.rollouts for v in r.versions]


@dataclass
class StreamState:
    """A consistent cut of the stream (:meth:`RolloutStream.snapshot`): with it, nothing
    drawn from the prompt stream is lost or counted twice. Its file: rollout_state.py."""

    step: int  # the RL step of the checkpoint it goes with (0 until saved)
    version: int  # the newest weight version the generator held
    drawn: int  # prompts drawn from the prompt stream since the run began
    position: dict[str, Any]  # the prompt stream's: task.train_stream(position) goes on
    _: KW_ONLY
    groups: list[Group]  # drawn, not trained on; the scored queue first, in its order


# Uniform groups in a row (none kept between them) before a warning, and before the stream
# gives up: a real task yields a group with signal long before either.
UNIFORM_WARN = 64
UNIFORM_FAIL = 1024


class UniformStall(ConfigError):
    """Dynamic sampling found no group with signal in ``UNIFORM_FAIL`` tries in a row."""


def _why_uniform(g: Group) -> str:
    """What the last uniform group looked like, and what to change."""
    cap = g.rollouts[0].sampling.max_new_tokens if g.rollouts else 0
    if g.rollouts and all(r.finish_reason == "length" for r in g.rollouts):
        seen = f"every response was cut at rollout.sampling.max_new_tokens={cap}"
    else:
        seen = f"every sample scored {g.rewards[0] if g.rewards else '?'}"
    return (f"{seen}; raise max_new_tokens if responses are cut, change the task's "
            "difficulty, or set algorithm.drop_uniform_groups=false")  # fmt: skip


class RolloutStream:
    def __init__(
        self,
        client: GeneratorClient,
        score: Callable[[Group], cf.Future[list[ScoreResult]]],
        next_item: Callable[[], Example],
        sampling: SamplingParams,
        *,
        gate: StalenessGate,
        version: int,
        segment_tokens: int | None = None,
        eager_resume: bool = True,
        drop_uniform: Callable[[Group], bool] | None = None,
        position: Callable[[], dict[str, Any]] = dict,
        episodes: EpisodeDriver | None = None,
    ) -> None:
        """``score(group)`` returns a future of the group's ``ScoreResult`` list.
        ``episodes``: samples are multi-turn; each ended turn goes to the environment.
        ``eager_resume=False``: parked rollouts wait for a newer version even when the
        generator has nothing else to do (each segment then runs on a newer policy).
        ``position()``: the prompt stream's position (``next_item``'s), for snapshots."""
        self.client, self.score, self.gate = client, score, gate
        self.eager_resume, self.drop_uniform = eager_resume, drop_uniform
        self.next_item, self.position = next_item, position
        self.episodes = episodes
        self.sampling, self.segment_tokens = sampling, segment_tokens
        self.first = self.committed = version
        self.started = self.consumed = self.drawn = 0
        self._ids = itertools.count()
        self._resumed_from: int | None = None  # a free-running resumed attempt's marks
        self._uniform_run = 0  # uniform groups since the last group kept
        self.uniform_warn, self.uniform_fail = UNIFORM_WARN, UNIFORM_FAIL
        self._gen: dict[cf.Future, tuple[Group, int]] = {}  # segment -> (group, tokens before)
        self._scoring: dict[cf.Future, Group] = {}
        self._env: dict[cf.Future, tuple[Group, Rollout]] = {}  # turns the env answers
        self._parked: list[tuple[Group, Rollout]] = []
        self._ready: deque[Group] = deque()
        # Groups finished and never to be trained on, with why ("dropped": too old for the
        # trainer; "skipped": no signal), until the run's ledger takes them.
        self._aside: list[tuple[str, Group]] = []
        self._cv = threading.Condition()
        self._wake: cf.Future = cf.Future()
        self._error: BaseException | None = None
        self._closed = False
        # Per-window counters (reset by each next_batch).
        self._tokens = self._resumed = self._scored = 0
        self._idle_s = self._reward_s = 0.0
        self._restored: dict[str, float] = {}  # what restore() carried over, for one window
        self._idle_since: float | None = time.perf_counter()
        self._window_start = time.perf_counter()
        self._thread = named_thread("rollout-stream", self._run)

    def start(self) -> RolloutStream:
        self._thread.start()
        return self

    # ------------------------------------------------------------------ trainer side
    def commit(self, version: int) -> None:
        """The servers now serve ``version``: parked rollouts resume under it, and the
        throttle may let more groups start."""
        with self._cv:
            self.committed = version
            self._resume_parked()
            self._poke()

    def next_batch(self, trainer_version: int) -> tuple[list[Group], dict[str, float]]:
        """The next ``gate.per_step`` groups fresh enough for ``trainer_version`` (older
        ones are dropped and counted), and the generation stats since the last call."""
        t0 = time.perf_counter()
        batch: list[Group] = []
        dropped = self.gate.dropped
        with self._cv:
            while len(batch) < self.gate.per_step:
                self._wait_check()
                if not self._ready:
                    self._cv.wait()
                    continue
                group = self._ready.popleft()
                self.consumed += 1
                if self.gate.admit(group.versions, trainer_version):
                    batch.append(group)
                else:
                    self._aside.append(("dropped", group))
                self._poke()  # room for more groups
            return batch, self._window(batch, trainer_version, t0, dropped)

    def _wait_check(self) -> None:
        """Raise, instead of waiting on, a stream that failed or was closed."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise StreamClosed("the rollout stream was closed while a batch was awaited")

    def _window(
        self, batch: list[Group], trainer_version: int, t0: float, dropped: int
    ) -> dict[str, float]:
        """The generation stats since the last batch (under the lock), and a new window."""
        now = time.perf_counter()
        since = self._idle_since
        idle = self._idle_s + (now - since if since is not None else 0.0)
        span = now - self._window_start
        lags = Counter(trainer_version - min(g.versions) for g in batch)
        stats = {
            "wait_batch_s": now - t0,
            "gen_tokens_per_s": self._tokens / max(span, 1e-9),
            "gen_idle_frac": min(idle / max(span, 1e-9), 1.0),
            # Seconds the servers had work since the last batch (paused ones included):
            # per batch, what generation costs; and a group's wait for its rewards.
            "gen_busy_s": max(span - idle, 0.0),
            "reward_s": self._reward_s / max(self._scored, 1),
            "dropped": float(self.gate.dropped - dropped),
            "dropped_total": float(self.gate.dropped),
            "uniform_skipped_total": float(self.gate.skipped),
            "resumed_segments": float(self._resumed),
            "lag_mean": sum(k * n for k, n in lags.items()) / len(batch),
            "lag_max": float(max(lags)),
            **{f"lag_{k}": float(n) for k, n in sorted(lags.items())},
            **self._restored,
        }
        self._restored = {}
        self._tokens = self._resumed = self._scored = 0
        self._idle_s, self._reward_s, self._window_start = 0.0, 0.0, now
        if since is not None:
            self._idle_since = now
        return stats

    def take_set_aside(self) -> list[tuple[str, Group]]:
        """The groups dropped or skipped since the last call, with why: with the groups
        trained on and those :meth:`snapshot` still holds, every group the stream drew."""
        with self._cv:
            taken, self._aside = self._aside, []
            return taken

    @property
    def parked(self) -> int:
        with self._cv:
            return len(self._parked)

    def _cut_point(self) -> tuple[int, dict[str, Any]]:
        """The prompts drawn and the prompt stream's position a snapshot holds with the
        groups of :meth:`_held` (under the lock): now's."""
        return self.drawn, self.position()

    def _held(self) -> list[Group]:
        """Every group drawn and not trained on: the scored queue first, in its order."""
        pending = [g for g, _ in [*self._gen.values(), *self._parked, *self._env.values()]]
        return [*self._ready, *pending, *self._scoring.values()]

    def finish_round(self) -> float:
        """Before a weight push: nothing to wait for in a free-running stream (a segment
        on a server continues under the new version). Seconds waited."""
        return 0.0

    def snapshot(self) -> StreamState:
        """Everything drawn from the prompt stream and not yet trained on, with the
        stream's position, taken under the lock (the thread draws prompts under it too):
        scored groups in queue order, then groups being scored or generating. A sample
        on a server is cut back to the tokens it had when its segment was sent (the
        client may be appending to it right now). Copies: the stream runs on."""
        with self._cv:
            sent = {id(cast("RolloutFuture", f).rollout): n for f, (_, n) in self._gen.items()}
            groups = {g.gid: g for g in self._held()}  # the first place of each

            def cut(r: Rollout) -> Rollout:
                n = sent.get(id(r))
                if n is None:  # finished or parked: nothing changes it
                    return replace(r, output_ids=list(r.output_ids), logprobs=list(r.logprobs),
                                   versions=list(r.versions),
                                   observed=[list(o) for o in r.observed],
                                   episode=copy.deepcopy(r.episode))  # fmt: skip
                held = r.rows_at(n)  # the routing rows it had: the others came with the cut
                rows = r.routing[:held] if r.routing is not None and held else None
                return replace(r, output_ids=r.output_ids[:n], logprobs=r.logprobs[:n],
                               versions=r.versions[:n], finish_reason=None,
                               observed=[list(o) for o in r.observed],
                               episode=copy.deepcopy(r.episode), routing=rows)  # fmt: skip

            copies = [replace(g, rollouts=[cut(r) for r in g.rollouts],
                              results=None if g.results is None else list(g.results))
                      for g in groups.values()]  # fmt: skip
            drawn, position = self._cut_point()
            return StreamState(0, self.committed, drawn, position, groups=copies)

    def restore(self, state: StreamState) -> dict[str, float]:
        """Before :meth:`start`: take up a snapshot's groups under the version the
        stream was built with. A group whose oldest token is already more than the
        gate's lag behind can never be trained on: it is dropped and counted. Scored
        groups go to the front of the queue, finished ones to the reward executor, and
        unfinished samples resume at once from their tokens. Ids: this attempt's marks,
        see the module's docstring."""
        carried = dropped = resumed = 0
        with self._cv:
            for g in state.groups:
                v = g.versions
                if v and self.committed - min(v) > self.gate.max_lag:
                    dropped += 1
                    self._aside.append(("dropped", g))
                    continue
                carried += 1
                g.restored_at = state.step
                asked = [r for r in g.rollouts if self._awaiting(r)]
                for r in asked:  # a turn the environment had not answered: ask again
                    self._ask(g, r)
                g.done = sum(r.finished for r in g.rollouts) - len(asked)
                if g.results is not None:
                    self._ready.append(g)
                elif g.done == len(g.rollouts) and not asked:
                    g.generated_at = time.perf_counter()
                    self._scoring[self.score(g)] = g
                for r in g.rollouts:
                    if not r.finished:
                        r.rid = carried_rid(r.rid, state.step)
                        self._parked.append((g, r))
                        resumed += 1
            self.started += carried
            self.drawn = state.drawn
            self._ids = itertools.count(max((g.gid for g in state.groups), default=-1) + 1)
            self._resumed_from = state.step
            self._resume_parked()
            self._restored = {"resume_groups": float(carried), "resume_rollouts": float(resumed),
                              "resume_dropped_groups": float(dropped)}  # fmt: skip
        return dict(self._restored)

    def _skip(self, group: Group) -> None:
        """Set a scored group without signal aside (dynamic sampling)."""
        self.gate.skip()
        self._aside.append(("skipped", group))
        self._uniform_in_a_row(group)

    def _uniform_in_a_row(self, group: Group) -> None:
        self._uniform_run += 1
        n = self._uniform_run
        if n >= self.uniform_fail:
            raise UniformStall(f"{n} groups in a row carried no signal: {_why_uniform(group)}")
        if n == self.uniform_warn:
            print(f"[rollouts] warning: {n} groups in a row carried no signal, none trained "
                  f"on ({_why_uniform(group)})", flush=True)  # fmt: skip

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._poke()
            self._cv.notify_all()  # a next_batch waiting (on another thread) raises
        self._thread.join(timeout=30)
        if self._gen:
            self.client.abort_all()

    # ------------------------------------------------------------------ the thread
    def _poke(self) -> None:
        if not self._wake.done():
            self._wake.set_result(None)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    if self._closed:
                        return
                    if self._wake.done():
                        self._wake = cf.Future()
                    self._start_groups()
                    if self.eager_resume and not self._gen and self._parked:  # else idle
                        self._resume_parked()
                    self._mark_idle(not self._gen)
                    waiting = [*self._gen, *self._scoring, *self._env, self._wake]
                done, _ = cf.wait(waiting, return_when=cf.FIRST_COMPLETED)
                with self._cv:
                    for f in done:
                        if f in self._gen:
                            self._on_segment(f)
                        elif f in self._env:
                            self._on_answer(f)
                        elif f in self._scoring:
                            group = self._scoring.pop(f)
                            group.results = list(f.result())
                            self._reward_s += time.perf_counter() - group.generated_at
                            self._scored += 1
                            self._on_scored(group)
        except BaseException as e:
            with self._cv:
                self._error = e
                self._cv.notify_all()

    def _on_scored(self, group: Group) -> None:
        if self.drop_uniform is not None and self.drop_uniform(group):
            self.consumed += 1
            self._skip(group)
            return
        self._uniform_run = 0
        self._ready.append(group)
        self._cv.notify_all()

    def _start_groups(self) -> None:
        while self.gate.may_start(self.started, self.consumed, self.committed, self.first):
            item = self.next_item()
            group = Group(next(self._ids), item, self.committed, index=self.drawn)
            self.drawn += 1
            futures = self.client.submit(
                list(item.prompt_ids),
                self.sampling,
                group=group.gid,
                segment_tokens=self.segment_tokens,
                rid=rollout_stem(group.index, self._resumed_from),
                images=item.images,
            )
            for f in futures:
                group.rollouts.append(f.rollout)
                self._gen[f] = (group, 0)
            self.started += 1

    def _budget(self, group: Group) -> int | None:
        """The new tokens a sample of ``group`` may take in its next segment."""
        return self.segment_tokens

    def _resume(self, group: Group, rollouts: list[Rollout]) -> None:
        """One request per group: its parked samples continue together."""
        self._resumed += len(rollouts)
        futures = self.client.resume_many(rollouts, self._budget(group))
        for f, r in zip(futures, rollouts, strict=True):
            self._gen[f] = (group, len(r.output_ids))

    def _resume_parked(self) -> None:
        by_group: dict[int, tuple[Group, list[Rollout]]] = {}
        for group, r in self._parked:
            by_group.setdefault(group.gid, (group, []))[1].append(r)
        self._parked = []
        for group, rollouts in by_group.values():
            self._resume(group, rollouts)

    def _on_segment(self, f: cf.Future) -> None:
        group, before = self._gen.pop(f)
        r: Rollout = f.result()
        self._tokens += len(r.output_ids) - before
        if not r.finished:  # cut at a segment boundary
            if r.versions and r.versions[-1] < self.committed:
                self._resume(group, [r])  # a newer policy is already there
            else:
                self._parked.append((group, r))
            return
        if self._awaiting(r):
            self._ask(group, r)
            return
        self._sample_done(group)

    def _sample_done(self, group: Group) -> None:
        group.done += 1
        if group.done == len(group.rollouts):
            group.generated_at = time.perf_counter()
            self._scoring[self.score(group)] = group

    # ------------------------------------------------------------------ multi-turn
    def _awaiting(self, r: Rollout) -> bool:
        return self.episodes is not None and self.episodes.awaiting(r)

    def _ask(self, group: Group, r: Rollout) -> None:
        assert self.episodes is not None
        self._env[self.episodes.answer(group.item, r)] = (group, r)

    def _on_answer(self, f: cf.Future) -> None:
        """Apply the environment's answer: the next turn goes to a server at once, as a
        sample's first segment does (a turn's end is not a segment boundary), or the
        sample is finished."""
        group, r = self._env.pop(f)
        assert self.episodes is not None
        # An environment that raises fails the run (a tool's failure never does).
        if self.episodes.apply(r, f.result()):
            self._resume(group, [r])
        else:
            self._sample_done(group)

    def _mark_idle(self, idle: bool) -> None:
        now = time.perf_counter()
        if idle and self._idle_since is None:
            self._idle_since = now
        elif not idle and self._idle_since is not None:
            self._idle_s += now - self._idle_since
            self._idle_since = None
