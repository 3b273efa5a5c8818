"""The trainer executor in the RL job: its ranks' command loop and the controller's handle.

Every trainer rank runs :func:`serve` with the trainer's part of the config
(:class:`~rl.trainer.settings.TrainerSettings`): it builds the Megatron trainer on the
trainer's own process group (rl/trainer/startup.py: resume, conversion, the warm-up, whose
progress goes to the controller's log), then obeys the controller: train a step on a
batch, push the weights (DDMA) as a version, save. Every rank receives every command and
acts on its own shards; rank 0 of the trainer answers for all of them. Both sides of the
protocol are here.

The entry point (rl/train.py) injects the rest: how the trainers are built (the startup,
bound to the job's config) and what the weights are pushed into (the factory of the
generator's DDMA target), so the trainer knows the DDMA sender (rl/ddma/sender.py) and
nothing of the generator.
"""

from __future__ import annotations

import os
import threading
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

from rl.batch import TrainBatch
from rl.engine.determinism import deterministic_kernels
from rl.runtime.channel import Failed
from rl.trainer.images import BatchImages
from rl.trainer.settings import TrainerSettings

if TYPE_CHECKING:
    from rl.ddma.sender import TargetFactory
    from rl.metrics import MetricsLogger
    from rl.runtime.channel import Channel
    from rl.runtime.job import Job
    from rl.trainer.startup import Start
    from rl.trainer.warmup import MetricsSink


@dataclass
class Train:
    step: int
    batch: TrainBatch
    # A vision-language batch's images, per row (references: rl/models/vision/images.py);
    # the trainer makes their patches itself. Empty: no images.
    images: list[tuple[str, ...]] = field(default_factory=list)


@dataclass
class Connect:
    """Prepare DDMA into these servers (p2p: then join their groups)."""

    urls: list[str]


@dataclass
class Join:
    """p2p: join DDMA group k at ``address``/``ports[k]`` with the servers ``groups[k]``
    (the controller has asked them to join too): at the start, every server; later, the
    restarted ones, whose old group died with them."""

    address: str
    ports: list[int]
    groups: list[list[int]]


@dataclass
class Reserve:
    """p2p: pick ``n`` free ports on trainer rank 0's host for new DDMA groups."""

    n: int


@dataclass
class Push:
    version: int
    servers: list[int] | None = None  # None: every server


@dataclass
class Save:
    path: str
    export_hf: bool = False  # also write an HF directory of this checkpoint
    step: int = 0


@dataclass
class Stop:
    pass


@dataclass
class Log:
    """Warm-up progress, logged by the controller (the one writer of metrics)."""

    step: int
    metrics: dict[str, float]
    phase: str
    echo: bool


@dataclass
class Ready:
    warmup_accuracy: float | None
    checkpoint: str | None  # where the warm-up was saved
    begin: str | None = None  # the checkpoint the RL stage's policy started from


@dataclass
class Trained:
    """A train step's metrics (loss, grad norm, timing; summed or averaged over ranks)."""

    metrics: dict[str, float]


@dataclass
class Rendezvous:
    """Where new DDMA groups meet: trainer rank 0's address and a free port per group
    (the answer to :class:`Connect` and :class:`Reserve`)."""

    address: str
    ports: list[int]


@dataclass
class Joined:
    """Every trainer rank joined the DDMA groups of a :class:`Join`."""


@dataclass
class Pushed:
    """A version sent by every trainer rank: payload and wire bytes summed over them, and
    the servers some rank lost."""

    payload_bytes: float
    wire_bytes: float
    lost: list[int] = field(default_factory=list)


@dataclass
class Saved:
    path: str
    hf: str | None = None  # the HF export (Save.export_hf), written by trainer rank 0


R = TypeVar("R", Trained, Rendezvous, Joined, Pushed, Saved)
COMMANDS = (Train, Connect, Join, Reserve, Push, Save, Stop)
REPLIES = (Log, Ready, Trained, Rendezvous, Joined, Pushed, Saved)


class _ChannelLog:
    """A MetricsLogger look-alike that forwards to the controller."""

    def __init__(self, reply: Channel):
        self.reply = reply

    def log(self, step: int, metrics: dict[str, float], phase: str, echo: bool = True) -> None:
        self.reply.put(Log(step, {k: float(v) for k, v in metrics.items()}, phase, echo))


# ---------------------------------------------------------------------- trainer ranks
class StartFn(Protocol):
    """Builds the RL stage's trainers on this rank (rl/trainer/startup.py, bound by the
    entry point to the job's config), its warm-up's progress going to ``log``."""

    def __call__(self, log: MetricsSink) -> Start: ...


def _export_hf(s: TrainerSettings, path: str, step: int) -> str:
    """An HF directory of the checkpoint at ``path`` (tokenizer files copied), for
    transformers and SGLang; written by trainer rank 0, atomically."""
    from rl.weights.convert import mcore_to_hf

    dst = Path(s.output_dir) / "hf" / f"step_{step:06d}"
    mcore_to_hf(path, str(dst), tokenizer_dir=s.export_tokenizer)
    return str(dst)


def serve(
    settings: TrainerSettings, job: Job, *, start: StartFn, make_target: TargetFactory
) -> None:
    """The trainer ranks' main loop (each rank of the trainer's process group): set the
    rank up, build the trainers with ``start``, then obey the controller. ``make_target``
    builds what each generator server is to the DDMA sender."""
    import torch.distributed as dist

    import megatron_patches

    t = settings.trainer
    megatron_patches.apply_all(t.device)  # before anything imports Megatron
    torch.set_num_threads(t.threads_per_rank)
    if settings.deterministic:
        deterministic_kernels(t.device)
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron's advice for TP
    from rl.algorithms.registry import loss_from_config, with_advantages
    from rl.algorithms.reuse import Reuse
    from rl.config.dtypes import torch_dtype
    from rl.ddma import transport
    from rl.ddma.plan import plan_for
    from rl.ddma.relay import Relaying
    from rl.ddma.sender import Sender
    from rl.metrics import MetricsLogger

    inbox = job.channel(f"trainer/in/{job.role_rank}", *COMMANDS)
    reply = job.channel("trainer/out", *REPLIES)
    lead = job.role_rank == 0
    answer = reply.put if lead else (lambda msg: None)
    try:
        log = _ChannelLog(reply) if lead else MetricsLogger("", enabled=False)
        tr, ref, acc, ckpt, begin = start(log)
        answer(Ready(acc, ckpt, begin))
        a, rollout = settings.algorithm, settings.rollout
        loss_fn = loss_from_config(a, rollout.sampling.max_new_tokens)
        reuse = Reuse(a.epochs, a.minibatches, t.seed)
        dtype = torch_dtype(t.params_dtype)
        sender = None
        images = BatchImages(settings.model)
        while not isinstance(msg := inbox.wait(), Stop):
            if isinstance(msg, Train):
                batch = msg.batch
                batch = images(batch, msg.images)  # on every rank: positions need them
                if ref is not None:  # log pi_ref of every token, for the KL penalty
                    batch = replace(batch, ref_logprobs=ref.logprobs(batch))
                batch, figures = with_advantages(a, batch)  # the whole batch's, then split
                answer(Trained({**tr.train_batch(batch, loss_fn, reuse, msg.step), **figures}))
            elif isinstance(msg, Connect):
                plan = plan_for(settings.model, t, rollout, dp=tr.layout.dp)
                w = rollout.weight_sync
                device = transport.get(w.transport).bucket_device(t.device, rollout.device)
                sender = Sender(tr.model.module, tr.layout, plan=plan, dtype=dtype, urls=msg.urls,
                                make_target=make_target, timeout=w.timeout,
                                transport=w.transport, relaying=Relaying.of(w),
                                device=device)  # fmt: skip
                answer(Rendezvous(_address(), _ports(len(msg.urls))))
            elif isinstance(msg, Join):
                assert sender is not None, "Join before Connect"
                sender.join(msg.address, msg.ports, msg.groups)
                answer(Joined())
            elif isinstance(msg, Reserve):
                answer(Rendezvous(_address(), _ports(msg.n)))
            elif isinstance(msg, Push):
                assert sender is not None, "Push before Connect"
                s, lost = sender.push(msg.version, msg.servers)
                # Sum over ranks; the all-reduce is also the barrier that makes every
                # rank's buckets land before the controller commits. A server any rank
                # lost is lost for the version.
                v = torch.tensor([s.payload_bytes, s.wire_bytes], dtype=torch.float64)
                dist.all_reduce(v)
                gone = torch.zeros(len(sender.targets), dtype=torch.float64)
                gone[lost] = 1.0
                dist.all_reduce(gone, op=dist.ReduceOp.MAX)
                lost_all = [i for i, x in enumerate(gone.tolist()) if x > 0]
                answer(Pushed(v[0].item(), v[1].item(), lost_all))
            elif isinstance(msg, Save):
                # The checkpoint it replaces stays until the resume state names this one.
                tr.save(msg.path, keep_previous=True)
                hf = _export_hf(settings, msg.path, msg.step) if msg.export_hf and lead else None
                answer(Saved(msg.path, hf))
    except BaseException:
        reply.put(Failed("trainer", job.role_rank, traceback.format_exc()))
        raise


def _address() -> str:
    """This host's address as the generator servers reach it (the DDMA group's master)."""
    from rl.runtime.net import host_address

    return host_address()


def _ports(n: int) -> list[int]:
    from rl.runtime.net import free_port

    return [free_port("0.0.0.0") for _ in range(n)]


# ---------------------------------------------------------------------- the controller
class TrainerHandle:
    """The controller's view of the trainer: each call sends a command to every trainer
    rank and returns trainer rank 0's answer."""

    def __init__(self, job: Job):
        n = job.role_size("trainer")
        self._to = [job.channel(f"trainer/in/{r}", *COMMANDS) for r in range(n)]
        self._from = job.channel("trainer/out", *REPLIES)
        self._lock = threading.Lock()

    def _call(self, msg: Train | Connect | Join | Reserve | Push | Save, reply: type[R]) -> R:
        with self._lock:  # one command and its answer at a time, from any thread
            for ch in self._to:
                ch.put(msg)
            return self._from.expect(reply)

    def wait_ready(self, log: MetricsLogger) -> Ready:
        """Wait for the trainer to be built (and warmed up), logging the warm-up's lines."""
        while isinstance(msg := self._from.get(), Log):
            log.log(msg.step, msg.metrics, phase=msg.phase, echo=msg.echo)
        if not isinstance(msg, Ready):
            raise RuntimeError(f"trainer answered {type(msg).__name__} before it was ready")
        return msg

    def train(
        self, step: int, batch: TrainBatch, images: list[tuple[str, ...]] | None = None
    ) -> dict[str, float]:
        return self._call(Train(step, batch, images or []), Trained).metrics

    def connect(self, urls: list[str]) -> Rendezvous:
        return self._call(Connect(urls), Rendezvous)

    def join(self, address: str, ports: list[int], groups: list[list[int]]) -> None:
        self._call(Join(address, ports, groups), Joined)

    def reserve(self, n: int) -> Rendezvous:
        """Where ``n`` new DDMA groups can rendezvous."""
        return self._call(Reserve(n), Rendezvous)

    def push(self, version: int, servers: list[int] | None = None) -> Pushed:
        """DDMA ``version`` into ``servers`` (default all); ``lost``: servers that did not
        answer on some rank."""
        return self._call(Push(version, servers), Pushed)

    def save(self, path: str, export_hf: bool = False, step: int = 0) -> Saved:
        """Checkpoint to ``path`` (and, with ``export_hf``, an HF directory of it)."""
        return self._call(Save(path, export_hf, step), Saved)

    def stop(self) -> None:
        for ch in self._to:
            ch.put(Stop())
