"""The critic executor in the RL job: its ranks' command loop and the controller's handle.

Every critic rank runs :func:`serve` on the critic's own process group: it builds the
critic (the shared Megatron engine, rl/engine, with a scalar head), starts it from the
policy's weights with a fresh head, or from its own checkpoint on a resume, then obeys the
controller:

* :class:`Values`: its value of every token of a batch (``[B, S]``, aligned with the
  log-probs), which GAE's advantages and the value loss's clip use;
* :class:`Train`: one step of the clipped value loss (rl/algorithms/value_loss.py) on the
  batch, its targets GAE's returns from the batch's rewards and those values (the same
  estimator the policy's advantages come from: rl/algorithms/registry.py); the controller
  sends it before the policy's step and collects it after, so the two train at once;
* :class:`Save`, :class:`Stop`.

The values of a batch come from the critic trained on the batches before it: one version
behind the batch, always. Rank 0 of the critic answers for every rank.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

import torch

from rl.batch import TrainBatch
from rl.critic.settings import CriticSettings
from rl.runtime.channel import Failed

if TYPE_CHECKING:
    from rl.runtime.job import Job


@dataclass
class Init:
    """Start from the policy's weights at ``policy`` (head fresh), or resume the critic's
    own checkpoint at ``resume`` (optimizer included); neither: a fresh critic."""

    policy: str | None
    resume: str | None


@dataclass
class Values:
    batch: TrainBatch


@dataclass
class Train:
    step: int
    batch: TrainBatch  # with the critic's values of it (Values' answer) and the rewards


@dataclass
class Save:
    path: str


@dataclass
class Stop:
    pass


@dataclass
class Ready:
    pass


@dataclass
class Valued:
    values: torch.Tensor  # [B, S]


@dataclass
class Trained:
    metrics: dict[str, float]  # critic_* figures of the step


@dataclass
class Saved:
    path: str


R = TypeVar("R", Ready, Valued, Trained, Saved)
COMMANDS = (Init, Values, Train, Save, Stop)
REPLIES = (Ready, Valued, Trained, Saved)


def serve(settings: CriticSettings, job: Job) -> None:
    """The critic ranks' main loop (each rank of the critic's process group)."""
    import megatron_patches

    t = settings.critic.trainer
    megatron_patches.apply_all(t.device)  # before anything imports Megatron
    torch.set_num_threads(t.threads_per_rank)
    from rl.engine.determinism import deterministic_kernels

    if settings.deterministic:
        deterministic_kernels(t.device)
    from rl.algorithms.registry import with_advantages
    from rl.algorithms.value_loss import clipped_value_loss
    from rl.engine.trainer import build_trainer

    inbox = job.channel(f"critic/in/{job.role_rank}", *COMMANDS)
    reply = job.channel("critic/out", *REPLIES)
    answer = reply.put if job.role_rank == 0 else (lambda msg: None)
    try:
        init = inbox.wait()
        assert isinstance(init, Init), f"the critic's first command is Init, not {init}"
        tr = build_trainer(settings.model, t, total_steps=max(settings.steps, 1))  # type: ignore[arg-type]
        if init.resume:
            tr.load(init.resume, load_optimizer=True)
        elif init.policy:
            tr.load_decoder(init.policy)
        answer(Ready())
        loss = clipped_value_loss(settings.critic.clip)
        while not isinstance(msg := inbox.wait(), Stop):
            if isinstance(msg, Values):
                answer(Valued(tr.values(msg.batch)))
            elif isinstance(msg, Train):
                batch, _ = with_advantages(settings.algorithm, msg.batch)  # sets the returns
                m = tr.train_step(batch, loss)
                answer(Trained({f"critic_{k}": v for k, v in m.items()}))
            elif isinstance(msg, Save):
                tr.save(msg.path, keep_previous=True)
                answer(Saved(msg.path))
    except BaseException:
        reply.put(Failed("critic", job.role_rank, traceback.format_exc()))
        raise


class CriticHandle:
    """The controller's view of the critic: each command goes to every critic rank; critic
    rank 0 answers. :meth:`train` only sends, :meth:`trained` collects: the policy's step
    runs in between."""

    def __init__(self, job: Job):
        n = job.role_size("critic")
        self._to = [job.channel(f"critic/in/{r}", *COMMANDS) for r in range(n)]
        self._from = job.channel("critic/out", *REPLIES)
        self._lock = threading.Lock()

    def _send(self, msg: Init | Values | Train | Save | Stop) -> None:
        for ch in self._to:
            ch.put(msg)

    def _call(self, msg: Init | Values | Save, reply: type[R]) -> R:
        with self._lock:
            self._send(msg)
            return self._from.expect(reply)

    def init(self, policy: str | None, resume: str | None) -> None:
        self._call(Init(policy, resume), Ready)

    def values(self, batch: TrainBatch) -> torch.Tensor:
        return self._call(Values(batch), Valued).values

    def train(self, step: int, batch: TrainBatch) -> None:
        self._lock.acquire()  # released by trained(): nothing else in between
        self._send(Train(step, batch))

    def trained(self) -> dict[str, float]:
        try:
            return self._from.expect(Trained).metrics
        finally:
            self._lock.release()

    def save(self, path: str) -> str:
        return self._call(Save(path), Saved).path

    def stop(self) -> None:
        self._send(Stop())


def with_values(batch: TrainBatch, values: torch.Tensor) -> TrainBatch:
    """``batch`` with the critic's values, 0 off the loss mask."""
    mask = batch.loss_mask
    return replace(batch, values=values * mask if mask is not None else values)
