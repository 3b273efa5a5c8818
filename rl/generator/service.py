"""The generator executor in the RL job: ranks that own SGLang servers, and the handle.

Each generator rank starts its share of ``rollout.servers`` on its own host (through the
one launcher, which health-checks them against a deadline), tells the controller their
URLs, and then watches them until told to stop. Rollouts do not pass through these ranks:
the controller's client talks to the servers directly (token ids in, tokens with
log-probs and versions out), and trainer ranks push weights to them directly (DDMA).
A server that dies fails the job with the end of its own log.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from rl.dist.channel import Channel, Failed
from rl.dist.net import host_address

if TYPE_CHECKING:
    from rl.config.schema import RootConfig
    from rl.dist.job import Job


@dataclass
class Up:
    rank: int
    urls: list[str]
    model_path: str  # the HF directory the servers started from (limits, EOS ids)


@dataclass
class Stop:
    pass


WATCH_S = 2.0  # how often a generator rank checks its servers


def _model_path(cfg: RootConfig, out: Path) -> str:
    """The HF directory the servers start from: ``rollout.model_path``, else the policy's
    ``model.hf_checkpoint``, else a directory written from the model config with the
    task's token ids (the trainer pushes its weights before the first rollout)."""
    if cfg.rollout.model_path or cfg.model.hf_checkpoint:
        return str(cfg.rollout.model_path or cfg.model.hf_checkpoint)
    from rl.tasks import build_task
    from rl.weights.convert import init_hf_dir

    codec = build_task(cfg).codec
    ids = {"eos_token_id": codec.eos_ids[0], "pad_token_id": codec.pad_id}
    return str(init_hf_dir(cfg.model, str(out / "hf_init"), ids, cfg.rollout.dtype))


def serve(cfg: RootConfig, job: Job) -> None:
    from rl.generator.launcher import ServerConfig, ServerLauncher

    inbox = job.channel(f"generator/in/{job.role_rank}", Stop)
    reply = job.channel("generator/out", Up)
    try:
        out = Path(cfg.run.output_dir) / "generator" / f"rank{job.role_rank}"
        path = _model_path(cfg, out)
        n = cfg.rollout.servers // job.role_size()
        server = ServerConfig.from_rollout(cfg.rollout, path)
        if cfg.cluster.nodes > 1:  # the controller and the trainer may be on other nodes
            server = replace(server, host="0.0.0.0", advertise=host_address())
        with ServerLauncher(server, n=n, log_dir=out / "logs") as launcher:
            reply.put(Up(job.role_rank, launcher.urls, path))
            stop = threading.Event()
            lost: list[BaseException] = []
            listen = threading.Thread(target=_listen, args=(inbox, stop, lost), daemon=True)
            listen.start()
            # The main thread waits on an Event, not on the store, so a SIGTERM (e.g. the
            # launcher died) runs the launcher's handler, which stops the servers.
            while not stop.wait(WATCH_S):
                for s in launcher.servers:
                    if not s.alive():
                        raise s.error(f"died (exit code {s.exit_code})")
            if lost:  # the controller's channel broke: stop the servers and say why
                raise lost[0]
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
        self._from = job.channel("generator/out", Up)

    def wait_up(self) -> tuple[list[str], str]:
        """URLs of every server (in generator rank order) and the model path."""
        ups = sorted((self._from.expect(Up) for _ in self._to), key=lambda u: u.rank)
        return [u for up in ups for u in up.urls], ups[0].model_path

    def stop(self) -> None:
        for ch in self._to:
            ch.put(Stop())
