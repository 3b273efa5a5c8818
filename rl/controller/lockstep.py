"""The rollout stream of a deterministic run (``rl.deterministic``): what each batch holds,
and the weight version every token of it is sampled with, follow from the step number
alone, never from timing. Async mode stays a pipeline that overlaps generation with
training; it only stops choosing by arrival.

Rounds: round ``v`` is the time the servers hold weight version ``v`` (from the push that
publishes it to the next). With lag ``k`` the groups of step ``s`` start in round
``max(first, s - k)``: round ``first`` starts steps ``first..first+k``, every later round
``v`` step ``v + k``, each with ``per_step`` prompts drawn in order. Without partial
rollouts a group runs to its end in the round it starts in. With
``rollout.segment_tokens`` a sample gets one segment per round, and runs to its end in
round ``s``: each token's version is set by the segment it falls in. The push that ends
a round waits for every segment of the round (:meth:`LockstepStream.finish_round`): the
price of determinism, which the free-running stream never pays.

A step settles once each of its groups is scored, in the round it is due (``s`` with
partial rollouts, its start round without): its groups with a signal are kept in group
order, and each uniform one (``algorithm.drop_uniform_groups``) is replaced by a newly
drawn group that runs to its end in that round, until ``per_step`` are kept. Steps settle
in step order, so prompts are drawn in one order whatever finishes first. The sampling
seeds (rl/generator/types.py) and the servers' batch-invariant products
(rl/serving/cpu_batch_invariant.py) make a group's samples a function of its prompt,
its place and the weights; so the batches, and the run, repeat bit for bit.

The cut: what a step's ledger record and a save hold is the stream as the round after the
step opened (its prompts drawn, before any step due in it settles), not what a settle has
changed by the time the controller looks (a uniform group skipped, its replacement drawn
from the prompt stream): :meth:`LockstepStream.snapshot` holds such a group again and not
its replacement, with the prompt stream's position of the cut, and
:meth:`LockstepStream.take_set_aside` leaves its skip to the next record. So two runs
write the same ledger (rl/controller/rollout_state.py), whatever the timing.

Resume: a snapshot is taken after the push of a save step, so round ``first`` of the
resumed job has begun already. Its groups keep their step; a sample cut back to the
tokens it had when its segment was sent runs that segment again, one whose last token is
of the current version waits for the next round, as it would have. A group held again is
skipped again, and its replacement drawn from the same place. Ids: a group's is its place
in the prompt stream (which its samples' seeds are made from), its samples' are
:func:`~rl.controller.rollouts.rollout_stem`'s, and a resumed stream marks none as its own:
the samples at a place are the same in every attempt, so are their ids.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rl.controller.rollouts import Group, RolloutStream, StreamState, rollout_stem
from rl.generator.types import Rollout

if TYPE_CHECKING:
    import concurrent.futures as cf
    from collections.abc import Callable

    from rl.config.sampling import SamplingParams
    from rl.controller.staleness import StalenessGate
    from rl.generator.client import GeneratorClient
    from rl.tasks.common import Example
    from rl.tasks.scoring import ScoreResult


class LockstepStream(RolloutStream):
    """A :class:`RolloutStream` scheduled by rounds; ``last`` is the run's last step."""

    def __init__(
        self,
        client: GeneratorClient,
        score: Callable[[Group], cf.Future[list[ScoreResult]]],
        next_item: Callable[[], Example],
        sampling: SamplingParams,
        *,
        gate: StalenessGate,
        version: int,
        last: int,
        segment_tokens: int | None = None,
        drop_uniform: Callable[[Group], bool] | None = None,
        position: Callable[[], dict] = dict,
    ) -> None:
        super().__init__(client, score, next_item, sampling, gate=gate, version=version,
                         segment_tokens=segment_tokens, eager_resume=False,
                         drop_uniform=drop_uniform, position=position)  # fmt: skip
        self.last, self.lag = last, gate.max_lag
        self._steps: dict[int, list[Group]] = {}  # drawn for a step not settled yet
        self._settled: dict[int, list[Group]] = {}  # kept, not yet taken by the trainer
        self._next_settle = version  # steps settle in this order
        self._restored_round = False
        # The round's cut (see the module's docstring): the prompts drawn and the prompt
        # stream's position as it opened, and how many groups set aside then are untaken.
        self._cut_drawn, self._cut_position, self._cut_aside = 0, position(), 0

    # ------------------------------------------------------------------ the schedule
    def _due(self, step: int) -> int:
        """The round a step's groups must be finished and settled in."""
        return step if self.segment_tokens else max(self.first, step - self.lag)

    def _budget(self, group: Group) -> int | None:
        """The segment a sample of ``group`` runs in the current round: to its end in the
        round its step is due in, else one ``segment_tokens`` segment."""
        return None if self._due(group.step) <= self.committed else self.segment_tokens

    def _open_round(self) -> None:
        """Round ``committed`` begins: its new steps' prompts are drawn, in step order,
        and every parked sample runs its next segment."""
        v = self.committed
        if self._restored_round:  # begun by the saved run: drawn, parked ones done
            return
        for step in range(v if v == self.first else v + self.lag, min(v + self.lag, self.last) + 1):
            self._steps[step] = [self._draw(step) for _ in range(self.gate.per_step)]
        self._resume_parked()

    def _mark_cut(self) -> None:
        """The round has opened (its prompts drawn): this is its cut."""
        self._cut_drawn, self._cut_position = self.drawn, self.position()
        self._cut_aside = len(self._aside)

    def _draw(self, step: int) -> Group:
        """The next prompt's group, for ``step``; its id is its place in the prompt stream."""
        item = self.next_item()
        group = Group(self.drawn, item, self.committed, index=self.drawn, step=step)
        self.drawn += 1
        self.started += 1
        futures = self.client.submit(list(item.prompt_ids), self.sampling, group=group.gid,
                                     segment_tokens=self._budget(group),
                                     rid=rollout_stem(group.index),
                                     images=item.images)  # fmt: skip
        for f in futures:
            group.rollouts.append(f.rollout)
            self._gen[f] = (group, 0)
        return group

    def _settle(self) -> None:
        """Settle every due step whose groups are all scored, in step order, drawing
        replacements for the uniform ones."""
        while self._next_settle <= self.last and self._due(self._next_settle) <= self.committed:
            step = self._next_settle
            groups = self._steps.get(step, [])
            if any(g.results is None for g in groups):
                return
            kept = []
            for g in sorted(groups, key=lambda g: g.gid):
                if self.drop_uniform is not None and self.drop_uniform(g):
                    self._skip(g)
                else:
                    self._uniform_run = 0
                    kept.append(g)
            if len(kept) < self.gate.per_step:
                self._steps[step] = kept + [
                    self._draw(step) for _ in range(self.gate.per_step - len(kept))
                ]
                return
            self._settled[step] = kept
            del self._steps[step]
            self._next_settle += 1
            self._cv.notify_all()

    # ------------------------------------------------------------------ RolloutStream hooks
    def start(self) -> LockstepStream:
        with self._cv:
            self._open_round()
            self._mark_cut()
        super().start()
        return self

    def commit(self, version: int) -> None:
        with self._cv:
            if version == self.committed:  # a restarted server's re-push: no new round
                return
            if version != self.committed + 1:
                raise RuntimeError(
                    f"lockstep rounds go one version at a time: {self.committed} -> {version}"
                )
            self.committed, self._restored_round = version, False
            self._open_round()
            self._mark_cut()
            self._poke()

    def _start_groups(self) -> None:  # called by the thread, under the lock, each wake-up
        self._settle()

    def _on_scored(self, group: Group) -> None:
        self._settle()

    def _on_segment(self, f: cf.Future) -> None:
        group, before = self._gen.pop(f)
        r: Rollout = f.result()
        self._tokens += len(r.output_ids) - before
        self._cv.notify_all()  # finish_round waits for the last segment of its round
        if not r.finished:
            self._parked.append((group, r))  # its next segment is the next round's
            return
        group.done += 1
        if group.done == len(group.rollouts):
            group.generated_at = time.perf_counter()
            self._scoring[self.score(group)] = group

    def finish_round(self) -> float:
        """Wait until every segment of this round is back and every step due in it is
        settled (the push that ends the round may then go); seconds waited."""
        t0 = time.perf_counter()
        with self._cv:
            while self._gen or (
                self._next_settle <= self.last and self._due(self._next_settle) <= self.committed
            ):
                self._wait_check()
                self._cv.wait()
        return time.perf_counter() - t0

    def next_batch(self, trainer_version: int) -> tuple[list[Group], dict[str, float]]:
        """The groups of step ``trainer_version`` (a step trains on the version of its
        number), once settled."""
        t0, dropped = time.perf_counter(), self.gate.dropped
        with self._cv:
            while trainer_version not in self._settled:
                self._wait_check()
                self._cv.wait()
            batch = self._settled.pop(trainer_version)
            for g in batch:
                if not self.gate.admit(g.versions, trainer_version):
                    raise RuntimeError(f"group {g.gid} of step {g.step} is past the lag bound")
            self.consumed += len(batch)
            return batch, self._window(batch, trainer_version, t0, dropped)

    def take_set_aside(self) -> list[tuple[str, Group]]:
        """The groups skipped by the round's cut and not taken yet: those of the steps due
        in earlier rounds. A group skipped since is the snapshot's, and the next call's."""
        with self._cv:
            n, self._cut_aside = self._cut_aside, 0
            taken, self._aside = self._aside[:n], self._aside[n:]
            return taken

    def _cut_point(self) -> tuple[int, dict]:
        return self._cut_drawn, self._cut_position

    def _held(self) -> list[Group]:
        """Every group drawn and not trained on by the round's cut, in step and draw order:
        a group skipped since is held, a replacement drawn since is not."""
        since = [g for _, g in self._aside[self._cut_aside :]]
        held = [*(g for s in self._settled.values() for g in s),
                *(g for s in self._steps.values() for g in s), *since]  # fmt: skip
        held = [g for g in held if g.index < self._cut_drawn]
        return sorted(held, key=lambda g: (g.step, g.index))

    def restore(self, state: StreamState) -> dict[str, float]:
        """Before :meth:`start`: the snapshot of a save step's end, taken in round
        ``state.version`` (the round this stream begins in)."""
        if state.version != self.committed:
            raise RuntimeError(
                f"a lockstep rollout state of round {state.version} cannot resume in round "
                f"{self.committed}"
            )
        resumed = 0
        with self._cv:
            for g in sorted(state.groups, key=lambda g: (g.step, g.gid)):
                g.restored_at = state.step
                g.done = sum(r.finished for r in g.rollouts)
                self._steps.setdefault(g.step, []).append(g)
                if g.results is None and g.done == len(g.rollouts):
                    g.generated_at = time.perf_counter()
                    self._scoring[self.score(g)] = g
                for r in g.rollouts:
                    if r.finished:
                        continue
                    if r.versions and r.versions[-1] == self.committed:
                        self._parked.append((g, r))  # this round's segment is done
                    else:  # its segment of this round was on a server: again
                        self._resume(g, [r])
                        resumed += 1
            self.started += len(state.groups)
            self.drawn = state.drawn
            self._next_settle = min(self._steps, default=self.committed)
            self._restored_round = True
            self._restored = {"resume_groups": float(len(state.groups)),
                              "resume_rollouts": float(resumed)}  # fmt: skip
        return dict(self._restored)
