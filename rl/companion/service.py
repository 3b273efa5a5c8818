"""The model executor: a model the algorithm brings besides the policy, on ranks of its own.

One executor serves every such model (a critic, a reward model, a teacher); the role
(:data:`rl.companion.ROLES`) names its ranks, its channels and its config. Every rank of a
role runs :func:`serve` on the role's own process group: it builds the model (the shared
Megatron engine, rl/engine, with the head its architecture names), loads its weights, then
obeys the controller:

* :class:`Forward`: the model's figure for every token of a batch (``[B, S]``, aligned
  with the log-probs): a scalar head's value, or an LM head's log-prob of the next token;
* :class:`Train` (a trained model only: ``settings.training``): one step of its loss on the
  batch; the controller sends it before the policy's step and collects it after, so the
  two train at once;
* :class:`Save`, :class:`Stop`.

Rank 0 of the role answers for every rank.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, TypeVar

import torch

from rl.batch import TrainBatch
from rl.companion.settings import CompanionSettings
from rl.runtime.channel import Failed

if TYPE_CHECKING:
    from rl.runtime.job import Job


@dataclass
class Init:
    """Load ``path`` as ``how``: ``decoder`` (all but the head: a critic from its policy),
    ``weights`` (a frozen model's), ``resume`` (a trained model's own checkpoint, optimizer
    included) or ``hf`` (an HF directory, converted once to this role's layout and cached
    under ``path``'s ``cache``); ``path=None``: the model's fresh initialisation."""

    path: str | None
    how: Literal["decoder", "weights", "resume", "hf"] = "weights"
    cache: str = ""


@dataclass
class Forward:
    batch: TrainBatch


@dataclass
class Train:
    step: int
    batch: TrainBatch  # with this model's Forward of it and what its loss needs


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
class Forwarded:
    out: torch.Tensor  # [B, S]


@dataclass
class Trained:
    metrics: dict[str, float]  # the step's figures, named after the role


@dataclass
class Saved:
    path: str


R = TypeVar("R", Ready, Forwarded, Trained, Saved)
COMMANDS = (Init, Forward, Train, Save, Stop)
REPLIES = (Ready, Forwarded, Trained, Saved)


def serve(settings: CompanionSettings, job: Job) -> None:
    """The main loop of each rank of ``settings.role``."""
    import megatron_patches

    t, role = settings.trainer, settings.role
    megatron_patches.apply_all(t.device)  # before anything imports Megatron
    torch.set_num_threads(t.threads_per_rank)
    from rl.engine.determinism import deterministic_kernels

    if settings.deterministic:
        deterministic_kernels(t.device)
    from rl.engine.trainer import build_trainer

    inbox = job.channel(f"{role}/in/{job.role_rank}", *COMMANDS)
    reply = job.channel(f"{role}/out", *REPLIES)
    answer = reply.put if job.role_rank == 0 else (lambda msg: None)
    try:
        init = inbox.wait()
        assert isinstance(init, Init), f"the {role}'s first command is Init, not {init}"
        frozen = settings.training is None
        tr = build_trainer(settings.model, t, total_steps=max(settings.steps, 1), frozen=frozen)  # type: ignore[arg-type]
        if init.path and init.how == "hf":
            from rl.weights.convert import cached_hf_to_mcore

            init.path = cached_hf_to_mcore(
                init.path, init.cache, settings.model, t.tp, t.pp, t.params_dtype, t.ep,  # type: ignore[arg-type]
            )  # fmt: skip
        if init.path and init.how == "decoder":
            tr.load_decoder(init.path)
        elif init.path:
            tr.load(init.path, load_optimizer=init.how == "resume")
        answer(Ready())
        tr.temperature = settings.temperature
        forward = tr.values if tr.score else tr.logprobs
        while not isinstance(msg := inbox.wait(), Stop):
            if isinstance(msg, Forward):
                answer(Forwarded(forward(msg.batch)))
            elif isinstance(msg, Train):
                assert settings.training is not None, f"the {role} is frozen: no Train"
                batch, loss = settings.training.prepare(msg.batch)
                stats = tr.train_batch(batch, loss, settings.training.reuse, msg.step)
                answer(Trained({f"{role}_{k}": v for k, v in stats.items()}))
            elif isinstance(msg, Save):
                tr.save(msg.path, keep_previous=True)
                answer(Saved(msg.path))
    except BaseException:
        reply.put(Failed(role, job.role_rank, traceback.format_exc()))
        raise


class CompanionHandle:
    """The controller's view of one role: each command goes to every rank of it; its rank 0
    answers. :meth:`train` only sends, :meth:`trained` collects: the policy's step runs in
    between. Thread-safe: one call at a time."""

    def __init__(self, job: Job, role: str):
        self.role = role
        n = job.role_size(role)
        self._to = [job.channel(f"{role}/in/{r}", *COMMANDS) for r in range(n)]
        self._from = job.channel(f"{role}/out", *REPLIES)
        self._lock = threading.Lock()

    def _send(self, msg: Init | Forward | Train | Save | Stop) -> None:
        for ch in self._to:
            ch.put(msg)

    def _call(self, msg: Init | Forward | Save, reply: type[R]) -> R:
        with self._lock:
            self._send(msg)
            return self._from.expect(reply)

    def init(self, init: Init) -> None:
        self._call(init, Ready)

    def forward(self, batch: TrainBatch) -> torch.Tensor:
        return self._call(Forward(_own(batch)), Forwarded).out

    def train(self, step: int, batch: TrainBatch) -> None:
        self._lock.acquire()  # released by trained(): nothing else in between
        self._send(Train(step, _own(batch)))

    def trained(self) -> dict[str, float]:
        try:
            return self._from.expect(Trained).metrics
        finally:
            self._lock.release()

    def save(self, path: str) -> str:
        return self._call(Save(path), Saved).path

    def stop(self) -> None:
        self._send(Stop())


def _own(batch: TrainBatch) -> TrainBatch:
    """``batch`` without the policy's routing: another model routes its own way."""
    return batch if batch.routing is None else replace(batch, routing=None)
