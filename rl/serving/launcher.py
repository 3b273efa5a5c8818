"""Start, watch, restart and stop N SGLang servers as subprocesses.

Why one helper: every path that needs a server (the main job, tests, benchmarks, SLURM
jobs) starts it here, so readiness is always decided by polling ``/health`` against a
deadline (never a fixed sleep), a server that dies or never comes up always fails with its
own last log lines, and no exit path (return, exception, Ctrl-C, SIGTERM, a killed parent)
leaves an orphan holding memory and ports.

Orphan safety: each server runs behind ``server_guard.py``, the leader of the server's
process group, which stops the whole group when asked, when SGLang exits, or when the
thread that started it dies (even by SIGKILL); ``atexit`` and a SIGTERM handler stop every
live launcher; and ``stop`` SIGKILLs whatever is left of each group after a grace period.

Keys: every server requires an API key and an admin key (rl/serving/server_api.py). They
never appear on a command line (``ps`` shows every user's): SGLang takes them only as
flags, so the launcher writes them to a 0600 YAML file that SGLang reads through
``--config`` and deletes it once the server answers. The logs are 0600 as well.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import KW_ONLY, dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from rl.config.sglang import layout_problem
from rl.models.vision.images import blank_image
from rl.runtime.net import free_port
from rl.serving import server_api
from rl.serving import server_guard as guard
from rl.serving.cpu_shim import server_env
from rl.serving.server_api import ServerKeys

if TYPE_CHECKING:
    from rl.config.schema import RolloutConfig

LOG_TAIL_LINES = 40
GUARD = Path(__file__).with_name("server_guard.py")
# Read by SGLang's bootstrap (sglang/srt/distributed/bootstrap.py) in every rank.
INIT_METHOD_ENV = "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"
# How long a stopping server may drain before its process group is SIGKILLed.
STOP_GRACE_S = 20.0
# The longest wait between two /health polls of a starting server: a server is ready about
# a second after it says so, and a poll is one local request.
POLL_MAX_S = 0.5
# Starts of a server on fresh ports when its port was taken before it could bind.
PORT_ATTEMPTS = 3


class ServerError(RuntimeError):
    """A server that failed to start, died, or stopped answering."""


# A deterministic run's CPU server computes every request's whole prefix itself. A prefix
# found in the radix cache was computed by another forward (a longer sibling's prefill, the
# decode steps of the request's own earlier segment), and that changed the request's
# log-probs by 4.8e-7 against its own prefill (measured on the tiny model, batch-invariant
# products on); so did whether a group's samples met the cache, which is timing. A prompt
# split into chunked-prefill chunks is the same case, split where its batch's other
# requests put the boundary. The cost: every segment prefills its prompt and the tokens so
# far again (tools/bench/determinism.py measures the step time). Unchunked, SGLang sizes
# its activation reserve by --max-prefill-tokens (16384 by default, which leaves a CPU
# server no KV cache): 4096 reserves what its default 4096-token chunks did. It only
# limits how many prompt tokens one prefill batch takes; a longer prompt runs alone.
CPU_DETERMINISTIC_ARGS = ("--disable-radix-cache", "--chunked-prefill-size", "-1",
                          "--max-prefill-tokens", "4096")  # fmt: skip


@dataclass(frozen=True)
class ServerConfig:
    """How to start one SGLang server. Field names follow SGLang's flags where they exist."""

    model_path: str
    device: str = "cpu"
    dtype: str = "float32"
    tp: int = 1
    host: str = "127.0.0.1"  # the interface the server listens on
    # The host in the URLs handed to clients (other nodes reach a server listening on
    # 0.0.0.0 through its node's address); None: ``host``.
    advertise: str | None = None
    max_total_tokens: int | None = 8192
    max_running_requests: int | None = 64
    context_length: int | None = None
    weight_version: int = 0
    startup_timeout: float = 300.0
    # Intra-op threads of the server (OMP/MKL) on CPU; None: torch's default (all cores).
    threads: int | None = None
    extra_args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    # The keys the server requires (server_api.job_keys() in an RL job); None: the launcher
    # makes random ones.
    keys: ServerKeys | None = None
    # SGLang's --load-format; "dummy": random weights of the right layout, for a server
    # whose weights all come by DDMA before its first rollout (an FP8 server started from
    # a bf16 checkpoint: fp8_serving_dir).
    load_format: str | None = None
    # A request's tokens and log-probs the same whatever it is batched with (a
    # deterministic run): on CPU our padded products (rl/serving/cpu_batch_invariant.py,
    # measured bit-equal) and no prefix computed by another forward
    # (CPU_DETERMINISTIC_ARGS); on CUDA SGLang's own --enable-deterministic-inference.
    batch_invariant: bool = False
    # Routing replay: the server returns the experts it routed each token to when a
    # request asks (rl/generator/routing.py); on CPU through rl/serving/cpu_routed_experts.py.
    return_routed_experts: bool = False

    def validate(self) -> None:
        """Reject what can never start, before any process is spawned."""
        cfg = Path(self.model_path) / "config.json"
        if not cfg.is_file():
            raise ServerError(f"server.model_path={self.model_path!r} has no config.json")
        try:
            json.loads(cfg.read_text())
        except ValueError as e:
            raise ServerError(f"server.model_path={self.model_path!r}: bad config.json: {e}") from e
        problem = layout_problem(self.device, self.tp, self.dtype, "server")
        if problem:
            raise ServerError(problem)
        if self.startup_timeout <= 0:
            raise ServerError(f"server.startup_timeout={self.startup_timeout} must be > 0")
        if self.threads is not None and self.threads < 1:
            raise ServerError(f"server.threads={self.threads} must be >= 1 (or None)")

    @classmethod
    def from_rollout(cls, r: RolloutConfig, model_path: str) -> ServerConfig:
        """The server settings of a ``rollout`` config (rl.config.schema.RolloutConfig)."""
        return cls(
            model_path=str(model_path),
            device=r.device,
            dtype=r.dtype,
            tp=r.tp,
            threads=r.threads,
            max_total_tokens=r.max_total_tokens,
            max_running_requests=r.max_running_requests,
            context_length=r.context_length,
            startup_timeout=r.startup_timeout,
        )

    def url(self, port: int) -> str:
        return f"http://{self.advertise or self.host}:{port}"

    def key_config(self) -> str:
        """The YAML that ``--config`` hands SGLang: both keys, quoted (a hex key of digits
        and one ``e`` would otherwise read as a float)."""
        if self.keys is None:
            raise ServerError("server.keys=None: a server never starts without keys")
        k = self.keys
        return f"api-key: {json.dumps(k.api)}\nadmin-api-key: {json.dumps(k.admin)}\n"

    def argv(self, port: int, key_file: str | os.PathLike[str] | None = None) -> list[str]:
        """The SGLang server command (the launcher runs it behind ``server_guard.py``);
        ``key_file``: where the launcher wrote :meth:`key_config`."""
        args = [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path]
        if key_file is not None:
            args += ["--config", str(key_file)]
        args += ["--host", self.host, "--port", str(port), "--device", self.device]
        args += ["--dtype", self.dtype, "--tp-size", str(self.tp)]
        args += ["--weight-version", str(self.weight_version), "--skip-tokenizer-init"]
        # An idle scheduler otherwise spins a core at 100%: two idle servers saturate a
        # 2-core machine and starve the trainer. Sleeping blocks on the request sockets,
        # so a new request still wakes it at once. (In RL servers idle while training.)
        args.append("--sleep-on-idle")
        # DDMA weight sync: trainer ranks post buckets already in this server's layout
        # to our receiver, which stages them and swaps them in whole (rl/ddma).
        args += ["--custom-weight-loader", server_api.DDMA_LOAD_FORMAT]
        for flag, value in (
            ("--load-format", self.load_format),
            ("--max-total-tokens", self.max_total_tokens),
            ("--max-running-requests", self.max_running_requests),
            ("--context-length", self.context_length),
        ):
            if value is not None:
                args += [flag, str(value)]
        if self.return_routed_experts:
            args.append("--enable-return-routed-experts")
        if self.device == "cpu":
            # Warmup sends a text request, which needs the tokenizer we skip.
            args.append("--skip-server-warmup")
            if self.batch_invariant:
                args += list(CPU_DETERMINISTIC_ARGS)
        elif self.batch_invariant:
            args.append("--enable-deterministic-inference")
        return args + list(self.extra_args)


def fp8_serving_dir(src: str | Path, dst: Path, block: int) -> Path:
    """A directory that makes SGLang build blockwise-FP8 layers for the checkpoint ``src``:
    every file of ``src`` linked, and its config.json with the ``quantization_config`` of
    DeepSeek-V3 / Qwen3-FP8 checkpoints (rl/ddma/fp8.py). Why not SGLang's online
    ``--quantization fp8``: that keeps no weight loader, so no weight update can follow.
    The server starts with ``load_format="dummy"`` (the weights in ``src`` are not FP8) and
    gets its weights and scales by DDMA before its first rollout."""
    from rl.ddma.fp8 import quant_config

    src = Path(src)
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        if f.name != "config.json":
            (tmp / f.name).symlink_to(f.resolve())
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config(block)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


@dataclass
class Server:
    index: int
    url: str
    port: int
    log_path: Path
    _: KW_ONLY
    proc: subprocess.Popen | None = None
    log_start: int = 0  # where this start's lines begin in the (appended) log
    # SGLang logs its arguments, keys included: errors quote the log without them.
    redact: tuple[str, ...] = field(default=(), repr=False)

    @property
    def key_file(self) -> Path:
        return self.log_path.with_suffix(".keys.yaml")

    @property
    def store_file(self) -> Path:
        """Its scheduler's torch.distributed store (absolute: ``file://runs/x`` names host
        "runs", and the server would wait for its peers forever)."""
        return self.log_path.with_suffix(".store").absolute()

    def log_tail(self, n: int = LOG_TAIL_LINES) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        tail = "\n".join(lines[-n:])
        for secret in self.redact:
            tail = tail.replace(secret, "<redacted>")
        return tail

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def lost_port(self) -> bool:
        """Did this start of the server fail to bind its port?"""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_start)
            return b"address already in use" in f.read()

    def error(self, what: str) -> ServerError:
        """``what`` happened to this server, with the end of its log (the actual cause)."""
        return ServerError(
            f"generator server {self.index} ({self.url}) {what}; last lines of "
            f"{self.log_path}:\n{self.log_tail()}"
        )

    @property
    def exit_code(self) -> int | None:
        return self.proc.returncode if self.proc else None

    def healthy(self, timeout: float = 5.0) -> bool:
        return server_api.healthy(self.url, timeout)


_live: weakref.WeakSet[ServerLauncher] = weakref.WeakSet()
_hooks_installed = False


def _stop_all(*_: object) -> None:
    for launcher in list(_live):
        launcher.stop()


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_stop_all)
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum: int, frame: FrameType | None) -> None:
            _stop_all()
            if callable(previous):
                previous(signum, frame)
            else:
                raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_term)


class ServerLauncher:
    """``with ServerLauncher(cfg, n=2) as servers: urls = servers.urls``.

    Start it from a long-lived thread: PR_SET_PDEATHSIG fires when the *thread* that
    spawned the server exits, so spawning from a short-lived worker thread would kill it.
    """

    def __init__(self, config: ServerConfig, n: int = 1, log_dir: str | Path | None = None):
        if n < 1:
            raise ServerError(f"generator.num_servers={n} must be >= 1")
        # Outside an RL job (tests, benchmarks): keys of this launcher's own.
        keys = config.keys or ServerKeys.random()
        config = replace(config, keys=keys)
        config.validate()
        self.config = config
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="sglang-logs-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._shim = self.log_dir / "cpu_shim"
        self.servers: list[Server] = []
        hide = (keys.api, keys.admin)
        for i in range(n):
            port = free_port(config.host)
            log = self.log_dir / f"server{i}.log"
            self.servers.append(Server(i, config.url(port), port, log, redact=hide))

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def keys(self) -> ServerKeys:
        """The keys every server of this launcher requires (clients and DDMA targets)."""
        assert self.config.keys is not None  # set in __init__
        return self.config.keys

    def __enter__(self) -> ServerLauncher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def spawn(self) -> ServerLauncher:
        """Start every server not started yet, without waiting for any (:meth:`start`
        waits): the caller does other work while they import and load."""
        _install_hooks()
        _live.add(self)
        try:
            for s in self.servers:
                if s.proc is None:
                    self._spawn(s)
        except BaseException:
            self.stop()
            raise
        return self

    def start(self) -> ServerLauncher:
        """Spawn every server (unless :meth:`spawn` did), then wait for all of them
        (they load in parallel)."""
        self.spawn()
        try:
            for s in self.servers:
                for attempt in range(PORT_ATTEMPTS):
                    try:
                        self._wait_ready(s)
                        break
                    except ServerError:
                        # Another process bound the port between our pick and the server's
                        # bind (seconds later): no client has the URL yet, so move it.
                        if attempt + 1 == PORT_ATTEMPTS or not s.lost_port():
                            raise
                        self._kill([s])
                        taken, s.port = s.port, free_port(self.config.host)
                        s.url = self.config.url(s.port)
                        # Its start begins again: a run seconds late says why, in one line.
                        print(
                            f"SGLang server {s.index}: port {taken} was taken by another "
                            f"process; starting it again on port {s.port}",
                            flush=True,
                        )
                        self._spawn(s)
        except BaseException:
            self.stop()
            raise
        return self

    def env(self, s: Server) -> dict[str, str]:
        """The environment server ``s`` starts with."""
        env = {**os.environ, **self.config.env}
        env = server_env(self.config.device, self._shim, env, self.config.threads,
                         batch_invariant=self.config.batch_invariant,
                         model_path=self.config.model_path)  # fmt: skip
        # The scheduler's torch.distributed store for the server's own ranks, all on this
        # node: a file, fresh for each start, through SGLang's override of its init
        # method. SGLang's default, tcp://127.0.0.1:<port>, made torch's TCPStore listen
        # on every interface whatever the host (tests/servers/test_generator.py found
        # it on "::"), on CPU and GPU alike.
        env[INIT_METHOD_ENV] = f"file://{s.store_file}"
        return env

    def _spawn(self, s: Server) -> None:
        env = self.env(s)
        s.store_file.unlink(missing_ok=True)  # fresh for each start
        # -I: the guard imports nothing from here (its own folder would shadow "types").
        guard = [sys.executable, "-I", str(GUARD), "--owner", str(os.getpid())]
        guard += ["--grace", str(STOP_GRACE_S), "--listen", f"{self.config.host}:{s.port}", "--"]
        _write_private(s.key_file, self.config.key_config())
        with open(s.log_path, "ab", opener=_private) as log:
            os.fchmod(log.fileno(), 0o600)  # a log from before may have a wider mode
            s.log_start = log.tell()
            s.proc = subprocess.Popen(
                guard + self.config.argv(s.port, s.key_file),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # the guard leads a process group of its own
            )

    def _wait_ready(self, s: Server) -> None:
        deadline = time.monotonic() + self.config.startup_timeout
        delay = 0.2
        while time.monotonic() < deadline:
            if not s.alive():
                raise s.error(f"exited with code {s.exit_code} during startup")
            if s.healthy():  # it parsed its arguments long ago
                s.key_file.unlink(missing_ok=True)
                self._warm_images(s, deadline)
                return
            time.sleep(delay)
            delay = min(delay * 1.5, POLL_MAX_S)
        raise s.error(f"not healthy after server.startup_timeout={self.config.startup_timeout}s")

    def _warm_images(self, s: Server, deadline: float) -> None:
        """A vision-language server's first image pays for its image processor's and
        tower's first run: one image is sent at launch, so no rollout waits for it."""
        probe = image_probe(self.config.model_path)
        if probe is None:
            return
        ids, image = probe
        call = server_api.generate([ids], [{"max_new_tokens": 1, "temperature": 0.0}],
                                   images=[[image]])  # fmt: skip
        t0 = time.monotonic()
        try:
            server_api.call(s.url, call, self.keys, max(deadline - t0, 1.0))
        except server_api.CallError as e:
            raise s.error(f"its first image (the warm-up at launch) failed: {e}") from None
        print(f"SGLang server {s.index}: first image in {time.monotonic() - t0:.1f}s (warm-up)",
              flush=True)  # fmt: skip

    def restart(self, index: int) -> Server:
        """Stop server ``index`` (if anything is left of it) and start it on the same port,
        so clients that hold its URL keep working once it is healthy again."""
        s = self.servers[index]
        self._kill([s])
        self._spawn(s)
        self._wait_ready(s)
        return s

    @staticmethod
    def _kill(servers: list[Server], grace: float = STOP_GRACE_S) -> None:
        """SIGTERM each server's guard (SGLang then drains and stops its scheduler and
        detokenizer in order; signalling the whole group instead makes it run crash
        diagnostics), wait for all of them together, then SIGKILL whatever is left of
        each process group. ``grace=0``: SIGKILL at once (nothing left to drain)."""
        procs = [s.proc for s in servers if s.proc is not None]
        for proc in procs if grace > 0 else ():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace + 5.0
        for proc in procs if grace > 0 else ():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        for proc in procs:
            # What SGLang left in /dev/shm: its guard unlinks that when it outlives
            # SGLang, and the SIGKILL below ends the guard too (at once with grace=0).
            shm = guard.shm_names(guard.group_members(proc.pid))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5.0)
            guard.unlink(shm)
        for s in servers:  # a server that never came up leaves its key file behind
            s.key_file.unlink(missing_ok=True)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Stop every server; ``grace=0`` when nothing is in flight (the end of a run): a
        graceful SGLang stop takes 7-10 s on CPU and saves nothing then."""
        self._kill(self.servers, grace)
        _live.discard(self)


def image_probe(model_path: str) -> tuple[list[int], str] | None:
    """A vision-language checkpoint's warm-up request: ``<vision start><image pad><vision
    end>`` (the server expands the pad) and a blank 56x56 image; None for a text model."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    names = ("vision_start_token_id", "image_token_id", "vision_end_token_id")
    if "vision_config" not in cfg or any(not isinstance(cfg.get(n), int) for n in names):
        return None
    return [cfg[n] for n in names], blank_image(56)


def _private(path: str, flags: int) -> int:
    """``open`` opener: create the file readable by this user only."""
    return os.open(path, flags, 0o600)


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to a new 0600 file at ``path`` (never into an existing file, whose
    mode or owner might be wider)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
