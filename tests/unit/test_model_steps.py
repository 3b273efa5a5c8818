"""A teacher's log-probs and a critic's values taken as the batch is assembled ahead
(rl/controller/model_steps.py): the critic's values of step s always come after its step
s - 1, whichever thread gets there first."""

from __future__ import annotations

import threading
import time

import torch

from rl.batch import TrainBatch
from rl.controller.model_steps import ModelSteps


class FakeCritic:
    """Answers in the order of its commands, as the critic's ranks do; its value of every
    token is the number of steps it was trained on; holds its lock from train to trained,
    as CompanionHandle does."""

    def __init__(self, trained: int = 0) -> None:
        self.steps, self.log = trained, []
        self._lock = threading.Lock()

    def forward(self, batch: TrainBatch) -> torch.Tensor:
        with self._lock:
            self.log.append(("forward", self.steps))
            return torch.full(batch.tokens.shape, float(self.steps))

    def train(self, step: int, batch: TrainBatch) -> None:
        self._lock.acquire()
        self.log.append(("train", step))
        self.steps = step

    def trained(self) -> dict[str, float]:
        self._lock.release()
        return {"critic_loss": 0.5}


class FakeTeacher:
    def forward(self, batch: TrainBatch) -> torch.Tensor:
        return torch.full(batch.tokens.shape, -2.0)


def _batch() -> TrainBatch:
    return TrainBatch(torch.ones(2, 3, dtype=torch.long), loss_mask=torch.tensor([[0, 1, 1]] * 2))


def test_the_values_of_a_step_wait_for_the_critics_step_before_it():
    critic = FakeCritic()
    steps = ModelSteps(critic, FakeTeacher(), first=1)  # type: ignore[arg-type]
    m1: dict[str, float] = {}
    b1 = steps.annotate(1, _batch(), m1)  # the fresh critic: nothing to wait for
    assert b1.values is not None and b1.values.sum() == 0
    assert b1.teacher_logprobs is not None
    assert b1.teacher_logprobs.tolist() == [[0.0, -2.0, -2.0]] * 2  # masked
    assert m1["critic_lag"] == 1 and m1["critic_values_s"] >= 0 and m1["teacher_logprobs_s"] >= 0

    # Step 2's batch is assembled on another thread before step 1's critic step is sent.
    got: dict[str, TrainBatch] = {}
    m2: dict[str, float] = {}
    ahead = threading.Thread(target=lambda: got.setdefault("b", steps.annotate(2, _batch(), m2)))
    ahead.start()
    time.sleep(0.2)
    assert "b" not in got and critic.log == [("forward", 0)]  # waiting for step 1's
    steps.train(1, b1)
    time.sleep(0.2)
    assert "b" not in got  # sent, but the critic's step is not collected yet
    assert steps.trained() == {"critic_loss": 0.5}
    ahead.join(5)
    assert critic.log == [("forward", 0), ("train", 1), ("forward", 1)]
    assert got["b"].values is not None and got["b"].values[0, 1] == 1  # trained through 1
    assert m2["critic_lag"] == 1


def test_a_resumed_critic_starts_trained_through_the_step_before_the_first():
    critic = FakeCritic(trained=4)
    steps = ModelSteps(critic, None, first=5)  # type: ignore[arg-type]
    b = steps.annotate(5, _batch(), m := {})
    assert b.values is not None and b.values[0, 1] == 4 and b.teacher_logprobs is None
    assert m["critic_lag"] == 1 and "teacher_logprobs_s" not in m


def test_without_models_the_batch_is_untouched():
    steps = ModelSteps(None, None, first=1)
    b = _batch()
    assert steps.annotate(1, b, m := {}) is b and m == {}
    steps.train(1, b)
    assert steps.trained() == {}
