"""The generator executor in the RL job: ranks that own SGLang servers, and the handle.

Each generator rank starts its share of ``rollout.servers`` on its own host (through the
one launcher, which health-checks them against a deadline), tells the controller their
URLs, and then watches them until told to stop. Rollouts do not pass through these ranks:
the controller's client talks to the servers directly (token ids in, tokens with
log-probs and versions out), and trainer ranks push weights to them directly (DDMA).
A server that dies or stops answering is restarted on the same port
(:mod:`rl.serving.watchdog`) and reported as :class:`Restarted`; the controller brings
it to the current weights before routing to it again. One that cannot stay up fails the
job with the end of its own log.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import KW_ONLY, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

from rl.runtime.channel import Channel, ChannelTimeout, Failed
from rl.runtime.net import host_address

if TYPE_CHECKING:
    from rl.generator.settings import GeneratorSettings
    from rl.runtime.job import Job
    from rl.serving.launcher import ServerLauncher


@dataclass
class Up:
    rank: int
    urls: list[str]
    model_path: str  # the HF directory the servers started from (limits, EOS ids)


@dataclass
class Down:
    """Server ``index`` (in the job's URL order) was found dead or unresponsive and is
    being restarted: route nothing to it and push no weights into it."""

    rank: int
    index: int
    url: str
    why: str


@dataclass
class Restarted:
    """Server ``index`` (in the job's URL order) was restarted: it serves its start-up
    weights until the controller pushes the current version into it."""

    rank: int
    index: int
    url: str
    why: str
    _: KW_ONLY
    seconds: float


@dataclass
class Stop:
    pass


WATCH_S = 2.0  # how often a generator rank checks its servers


class ModelPath(Protocol):
    """The HF directory the servers start from, written under ``out`` if it must be
    (rl/generator/startup.py, bound by the entry point to the job's config)."""

    def __call__(self, out: Path) -> str: ...


class Launched(NamedTuple):
    """A generator rank's servers, spawned (:func:`launch`) and not yet waited for (not a
    message: it never leaves the rank)."""

    launcher: ServerLauncher
    model_path: str  # the HF directory they start from


def launch(
    settings: GeneratorSettings, role_rank: int, role_size: int, *, model_path: ModelPath
) -> Launched:
    """Spawn generator rank ``role_rank``'s share of the servers from ``model_path``,
    without waiting for them: called before the rank joins the job, so that SGLang's
    imports (most of a server's start on CPU) run while the other ranks start."""
    from rl.serving.launcher import ServerConfig, ServerLauncher, fp8_serving_dir
    from rl.serving.server_api import job_keys

    r = settings.rollout
    out = Path(settings.output_dir) / "generator" / f"rank{role_rank}"
    path = model_path(out)
    server = ServerConfig.from_rollout(r, path)
    block = r.weight_sync.fp8_block
    if block is not None:  # FP8 layers, their weights and scales by DDMA
        fp8_dir = fp8_serving_dir(path, out / "hf_fp8", block)
        server = replace(server, model_path=str(fp8_dir), load_format="dummy")
    # The servers' clients are the controller and the trainer's ranks. On one node they
    # reach 127.0.0.1. With cluster.nodes > 1 the nodes are always split between
    # training (the controller on node 0) and generation (rl/plan/placement.py), so
    # every client is remote: listen on the one address they are given, not on all.
    host = host_address() if settings.multi_node else "127.0.0.1"
    server = replace(server, host=host, keys=job_keys(), batch_invariant=settings.deterministic,
                     return_routed_experts=settings.routing_replay)  # fmt: skip
    n = r.servers // role_size
    return Launched(ServerLauncher(server, n=n, log_dir=out / "logs").spawn(), path)


def serve(settings: GeneratorSettings, job: Job, launched: Launched) -> None:
    """A generator rank's main loop: wait for its servers (:func:`launch`), report them
    up, and restart any that dies until told to stop."""
    from rl.serving.watchdog import Watchdog

    inbox = job.channel(f"generator/in/{job.role_rank}", Stop)
    reply = job.channel("generator/out", Up, Down, Restarted)
    try:
        r, path, n = settings.rollout, launched.model_path, len(launched.launcher.servers)
        with launched.launcher as launcher:  # waits for them (ServerLauncher.start)
            reply.put(Up(job.role_rank, launcher.urls, path))
            stop = threading.Event()
            lost: list[BaseException] = []
            listen = threading.Thread(target=_listen, args=(inbox, stop, lost), daemon=True)
            listen.start()

            def down(i: int, why: str) -> None:
                index = job.role_rank * n + i  # wait_up's URL order
                reply.put(Down(job.role_rank, index, launcher.servers[i].url, why))

            watch = Watchdog(launcher, r.max_restarts, r.restart_window_s, r.health_timeout_s,
                             health_failures=r.health_failures, on_down=down)  # fmt: skip
            # The main thread waits on an Event, not on the store, so a SIGTERM (e.g. the
            # launcher died) runs the launcher's handler, which stops the servers.
            while not stop.wait(WATCH_S):
                for done in watch.check():
                    s = launcher.servers[done.index]
                    index = job.role_rank * n + done.index  # wait_up's URL order
                    reply.put(
                        Restarted(job.role_rank, index, s.url, done.why, seconds=done.seconds)
                    )
            if lost:  # the controller's channel broke: stop the servers and say why
                raise lost[0]
            launcher.stop(grace=0)  # told to stop: the run is over, nothing to drain
    except BaseException:
        reply.put(Failed("generator", job.role_rank, traceback.format_exc()))
        raise


def _listen(inbox: Channel, stop: threading.Event, lost: list[BaseException]) -> None:
    """Wait for Stop for as long as the run lasts (a quiet inbox is what an idle generator
    rank sees for the whole run; a run longer than ``rl.channel_timeout`` once left this
    rank and its servers running after the job was done). Any error ends the wait and is
    raised by the main thread."""
    try:
        inbox.wait()
    except BaseException as e:
        lost.append(e)
    stop.set()


class GeneratorHandle:
    """The controller's view of the generator ranks: their servers' URLs, and stop."""

    def __init__(self, job: Job):
        n = job.role_size("generator")
        self._to = [job.channel(f"generator/in/{r}", Stop) for r in range(n)]
        self._from = job.channel("generator/out", Up, Down, Restarted)

    def wait_up(self) -> tuple[list[str], str]:
        """URLs of every server (in generator rank order) and the model path."""
        ups = sorted((self._from.expect(Up) for _ in self._to), key=lambda u: u.rank)
        return [u for up in ups for u in up.urls], ups[0].model_path

    def next_event(self, wait: float) -> Down | Restarted | None:
        """The next server loss or restart, if one is reported within ``wait`` seconds
        (raises if a generator rank failed)."""
        try:
            msg = self._from.get(timeout=wait)
        except ChannelTimeout:
            return None
        if not isinstance(msg, (Down, Restarted)):
            raise RuntimeError(f"generator rank sent {type(msg).__name__} after start-up")
        return msg

    def stop(self) -> None:
        for ch in self._to:
            ch.put(Stop())
