"""What the model executors add to a step's batch: a teacher's log-probs and a critic's
values, taken while the batch is assembled ahead (rl/controller/prefetch.py), and the
critic's training on it beside the policy's.

Why ahead: the teacher is frozen, so its log-probs of the next batch can be taken while
the policy trains on this one. The critic is not: a batch's values come from the critic
trained on the batch before it (one critic step behind, always, as in a sequential
loop). So the values of step ``s``'s batch are asked for only once the critic's step
``s - 1`` was sent, and the critic's handle answers them after that step (its ranks take
commands in order, and the handle holds its lock from ``train`` to ``trained``). They are
then taken while the policy's step ``s - 1`` pushes its weights and evaluates, not after,
and a deterministic run's numbers do not depend on which thread got there first.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

from rl.batch import TrainBatch
from rl.companion.critic import with_values

if TYPE_CHECKING:
    from rl.companion.service import CompanionHandle


class ModelSteps:
    """The teacher's and the critic's part of each step; ``first`` is the run's first step
    (the critic resumed, if at all, as trained through ``first - 1``)."""

    def __init__(
        self, critic: CompanionHandle | None, teacher: CompanionHandle | None, first: int
    ) -> None:
        self.critic, self.teacher = critic, teacher
        self._sent = first - 1  # the last step whose batch the critic was sent to train on
        self._sent_cond = threading.Condition()

    def annotate(self, step: int, batch: TrainBatch, m: dict[str, float]) -> TrainBatch:
        """Step ``step``'s batch with the teacher's log-probs and the critic's values (the
        prefetch thread, while step ``step - 1`` runs); their times go into ``m``."""
        if self.teacher is not None:
            t0 = time.perf_counter()
            lp = self.teacher.forward(TrainBatch(batch.tokens))
            m["teacher_logprobs_s"] = time.perf_counter() - t0
            mask = batch.loss_mask
            batch = replace(batch, teacher_logprobs=lp * mask if mask is not None else lp)
        if self.critic is not None:
            with self._sent_cond:  # the critic's step before this one goes first
                self._sent_cond.wait_for(lambda: self._sent >= step - 1)
                trained_through = self._sent
            t0 = time.perf_counter()
            batch = with_values(batch, self.critic.forward(batch))
            m["critic_values_s"] = time.perf_counter() - t0
            m["critic_lag"] = float(step - trained_through)
        return batch

    def train(self, step: int, batch: TrainBatch) -> None:
        """Send the critic its step on ``batch`` (it trains while the policy does)."""
        if self.critic is None:
            return
        self.critic.train(step, batch)
        with self._sent_cond:
            self._sent = step
            self._sent_cond.notify_all()

    def trained(self) -> dict[str, float]:
        """The critic's step's metrics, once it is done (none without a critic)."""
        return self.critic.trained() if self.critic is not None else {}
