"""Start N ranks on this machine (or join ranks started by torchrun/srun) with gloo or NCCL.

Why our own spawner: configs are validated in the parent *before* any rank exists, each
rank must apply the Megatron CPU patches before importing Megatron, and a rank that dies
must fail the whole run with its traceback instead of leaving the others hung in a
collective. Under torchrun (RANK/WORLD_SIZE set) the same worker function runs in place.

How a run ends, in every case, with one message and no process left behind:

* a rank raises, exits without a result, is killed, or one of its threads dies: the
  launcher names it (``names``: e.g. "trainer rank 1"), shows its last lines and kills
  every process of the job (rl/runtime/tree.py finds them, orphans included);
* SIGTERM or SIGINT to the launcher: the same sweep, then :class:`Stopped`, whose
  message says what was stopped (and, through ``saved``, what is on disk);
* success: each rank's result, then a short wait for the ranks to exit and a sweep of
  whatever they left (a ``torch_shm_manager``, a Manager).

Each rank leads a process group of its own, so a terminal's Ctrl-C reaches the launcher
only, and each rank's output passes through the launcher (rl/runtime/rank_output.py).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Collection, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl.config.errors import ConfigError
from rl.runtime import lifeline, tree
from rl.runtime.channel import ProtocolError
from rl.runtime.net import free_port
from rl.runtime.rank_output import RankOutput, redirect_into
from rl.runtime.supervise import MARK_ENV, RankFailed, Supervisor

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.context import ForkServerContext, SpawnContext
    from types import FrameType, TracebackType

R = TypeVar("R")


# Warnings that Megatron-Core 0.16 / torch 2.14 print on every CPU run and that say nothing
# actionable: the optional fused kernels are absent by design on CPU, and the deprecations
# are Megatron's calls into newer torch. Matched by message so anything new still shows.
_KNOWN_NOISE = (
    r".*Apex is not installed.*",
    r".*Transformer Engine and Apex are not installed.*",
    r"The \.grad attribute of a Tensor that is not a leaf Tensor.*",
    r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` is deprecated.*",
    r"full scope is deprecated.*",
    r"`load_state_dict` is deprecated.*",
    r"Please use DTensor instead and we are deprecating ShardedTensor.*",
)


def quiet_known_warnings() -> None:
    for pattern in _KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)


def setup_rank(device: str, threads: int, timeout_s: float = 600.0) -> None:
    """Per-rank setup from the env:// variables: threads, patches, the default group."""
    quiet_known_warnings()
    # Megatron's recommended setting for async TP grad all-reduce (it warns without it).
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    torch.set_num_threads(threads)
    import megatron_patches

    megatron_patches.apply_all(device)
    if not dist.is_initialized():
        backend = "nccl" if device == "cuda" else "gloo"
        if device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s))


def die_with_parent(launcher: int) -> None:
    """SIGTERM this rank when the launching process dies, even by SIGKILL (Linux
    PR_SET_PDEATHSIG), so killing a run never leaves ranks (or their servers: a generator
    rank stops them on SIGTERM) behind.

    The signal comes when this process's parent dies: the launcher, or the fork server a
    CPU rank is forked from, which exits as soon as the launcher is gone."""
    import ctypes
    import signal

    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent or not psutil.pid_exists(launcher):  # died before the line above
        os._exit(1)


def under_launcher() -> bool:
    """True when torchrun/srun already started this process as one rank of a world."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class Stopped(RuntimeError):
    """SIGTERM or SIGINT reached the launcher; every process of the job is gone."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by this signal (130, 143)."""
        return 128 + self.signum


class _Signalled(BaseException):
    """Raised by the launcher's handler in its main thread, wherever that thread is."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def install_thread_hook(report: Callable[[str], None] | None = None) -> None:
    """End this rank when any of its threads dies of an exception, after ``report`` (by
    default: print to stderr). Why: a dead reply or listener thread otherwise leaves the
    job waiting for an answer that never comes, silently, until some timeout."""

    def hook(a: threading.ExceptHookArgs) -> None:
        if a.exc_type is SystemExit:
            return
        name = a.thread.name if a.thread is not None else "?"
        text = failure_text(a.exc_type, a.exc_value, a.exc_traceback)
        sep = "\n" if "\n" in text else " "  # a one-line error stays one line
        try:
            (report or _print_error)(f"thread {name!r} died:{sep}{text}")
        finally:
            os._exit(1)

    threading.excepthook = hook


def failure_text(
    exc_type: type[BaseException], exc: BaseException | None, tb: TracebackType | None
) -> str:
    """How a rank reports an exception: its traceback; one line for a
    :class:`~rl.runtime.channel.ProtocolError` or a :class:`~rl.config.errors.ConfigError`
    (a setting that cannot work, found while running), whose message is the whole story."""
    if isinstance(exc, (ProtocolError, ConfigError)):
        return f"{exc_type.__name__}: {exc}"
    return "".join(traceback.format_exception(exc_type, exc, tb))


def _print_error(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _context(device: str, fresh: bool) -> SpawnContext | ForkServerContext:
    """How ranks start: CPU ranks are forked from a server that imported torch and the
    patched Megatron-Core once (:mod:`rl.runtime.preload`: 0.05 s a rank instead of 4.5 s);
    CUDA ranks, for which no CPU patch may apply, are fresh interpreters."""
    if device != "cpu" or fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["rl.runtime.preload"])
    return ctx


def _leave_fork_server() -> None:
    """In a rank forked from the fork server: drop the server's "alive" pipe end that
    multiprocessing hands every child, so that the server lives exactly as long as the
    launcher (a rank holding it kept the server, and so itself, alive after a SIGKILLed
    launcher); and forget the server, so that a rank which forks servers starts its own."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    # Private fields, which typeshed does not declare: read and reset by name.
    alive: int | None = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
    for field in ("_forkserver_alive_fd", "_forkserver_address", "_forkserver_pid"):
        setattr(server, field, None)


def _title_settable() -> None:
    """Let setproctitle find, now, the memory it writes a process title into: it looks
    where the environment sits after argv, and once the environment is replaced (as
    :func:`_child` does next) it finds none, so a rank's title ("msrl:trainer:1") never
    showed. Optional: without setproctitle ranks keep their command line."""
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.getproctitle()


def _child(
    env: dict[str, str],  # the launcher's environment now, not the fork server's at its start
    rank: int,
    world_size: int,
    port: int,
    device: str,
    threads: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Connection,  # this rank's result pipe: (ok, its result or traceback), once
    setup: bool = True,
    parent: int = 0,
    out_w: Connection | None = None,
    err_w: Connection | None = None,
    mark: str = "",
) -> None:
    _leave_fork_server()
    _title_settable()
    os.environ.clear()
    os.environ.update(env)
    # A group of its own: a terminal's Ctrl-C goes to the launcher alone, which then ends
    # every rank at once instead of each rank printing its own KeyboardInterrupt.
    os.setpgid(0, 0)
    die_with_parent(parent)
    # What this rank starts through multiprocessing (Megatron's checkpoint Manager, reward
    # workers) dies with it: once the launcher is SIGKILLed, no subreaper sweeps them.
    lifeline.install()
    if out_w is not None and err_w is not None:
        redirect_into(out_w, err_w)

    result = _Result(results)
    install_thread_hook(lambda text: result.send(False, text))
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    os.environ[MARK_ENV] = mark  # what this rank starts is the job's (the final sweep)
    try:
        if setup:
            setup_rank(device, threads)
        else:  # fn joins process groups itself (rl.runtime.job)
            quiet_known_warnings()
            torch.set_num_threads(threads)
        out = fn(*args)
        buf = io.BytesIO()
        torch.save(out, buf)
        result.send(True, buf.getvalue())
        code = 0
    except BaseException as e:
        # The launcher prints this once, under the rank's name: no second copy from here.
        result.send(False, failure_text(type(e), e, e.__traceback__))
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Leave at once: the interpreter's and multiprocessing's exit work (finalizers, a
    # Manager's shutdown, freeing a GB of tensors and modules) took 3-5 s per rank after
    # its result was in, and whatever a rank leaves running the launcher sweeps anyway.
    # The result is in the pipe already: it outlives the rank until the launcher reads it.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def spawn(
    fn: Callable[..., R],
    world_size: int,
    *args: object,
    device: str = "cpu",
    threads: int = 1,
    timeout_s: float = 900.0,
    setup: bool = True,
    names: Callable[[int], str] | None = None,
    saved: Callable[[], str] | None = None,
    fresh: bool = False,
    fresh_ranks: Collection[int] = (),
) -> list[R]:
    """Run ``fn(*args)`` on ``world_size`` new local ranks; return each rank's result.

    ``fn`` must be importable (module level). If any rank raises, dies or loses a thread,
    every process of the job is killed and :class:`RankFailed` names the rank
    (``names(rank)``, default "rank N") with its error and last lines. SIGTERM/SIGINT
    kill them as well and raise :class:`Stopped`, whose message ends with ``saved()``.
    With ``setup`` every rank joins one default process group over all ranks first;
    without, ``fn`` sets up its own (e.g. one group per executor role). A CPU rank is
    forked with torch and the CPU-patched Megatron-Core imported; ``fresh`` starts each
    rank as a new interpreter instead, with nothing imported or patched (a CUDA rank
    always is), and ``fresh_ranks`` only those ranks: ranks that need no Megatron-Core
    then run while the fork server is still importing it.
    """
    name = names or (lambda r: f"rank {r}")
    _quiet_resource_tracker()
    ctx = _context(device, fresh)
    ctx_of = [_context(device, fresh or r in fresh_ranks) for r in range(world_size)]
    # A pipe per rank, not one multiprocessing Queue: a Queue is three named semaphores in
    # /dev/shm that only the resource tracker unlinks, and a job SIGKILLed as a whole,
    # tracker included, left them behind. A pipe leaves nothing.
    pipes = [ctx.Pipe(duplex=False) for _ in range(world_size)]
    port = free_port()
    tree.become_subreaper()
    outputs = [RankOutput(ctx) for _ in range(world_size)]
    common = (world_size, port, device, threads, fn, args)
    env = dict(os.environ)
    procs: list[Any] = []
    sup = Supervisor(procs, outputs, [r for r, _ in pipes], name)
    procs += [
        ctx_of[r].Process(
            target=_child,
            args=(
                env,
                r,
                *common,
                pipes[r][1],
                setup,
                os.getpid(),
                *outputs[r].write_ends,
                sup.mark,
            ),
            daemon=False,
        )
        for r in range(world_size)
    ]
    # Fresh ranks first: their interpreters import while the fork server (started with
    # the first rank forked from it, which waits for its imports) does.
    order = sorted(range(world_size), key=lambda r: ctx_of[r] is ctx)
    with _stop_signals() as stopping:
        try:
            for p, o, (_, w) in ((procs[r], outputs[r], pipes[r]) for r in order):
                p.start()
                w.close()  # the rank holds it now: end-of-file means the rank is gone
                o.start()
            payloads = sup.gather(timeout_s)
            sup.finish()
        except _Signalled as sig:
            stopping.set()
            t0 = time.monotonic()
            what = sup.kill_everything()
            sig_name = signal.Signals(sig.signum).name
            done = f"stopped by {sig_name} in {time.monotonic() - t0:.1f}s: {what}"
            raise Stopped(sig.signum, f"{done}; {saved()}" if saved else done) from None
        except RankFailed as e:
            stopping.set()
            sup.kill_everything()
            if saved is None:
                raise
            sep = "\n" if "\n" in str(e) else " "  # a one-line failure stays one line
            raise RankFailed(f"{e}{sep}(every rank stopped; {saved()})") from None
        except BaseException:
            stopping.set()
            sup.kill_everything()
            raise
        finally:
            tree.become_subreaper(False)
    return [torch.load(io.BytesIO(payloads[r]), weights_only=False) for r in range(world_size)]


class _Result:
    """A rank's end of its result pipe: one message, the first (a thread that died, or
    the rank's own result or error), whole before the rank exits."""

    def __init__(self, conn: Connection):
        self._conn, self._lock, self._sent = conn, threading.Lock(), False

    def send(self, ok: bool, payload: bytes | str) -> None:
        with self._lock:
            if self._sent:
                return
            self._sent = True
            with contextlib.suppress(OSError):  # the launcher is gone: nobody to tell
                self._conn.send((ok, payload))


def _quiet_resource_tracker() -> None:
    """The ranks share this process's multiprocessing resource tracker, which unlinks what
    a rank killed on purpose left registered (its queues' semaphores) and then warns about
    each "leak" after the job's last line. It takes its warning filters from this
    process's -W options when it starts (with the first queue), so give it one."""
    quiet = "ignore:resource_tracker:UserWarning"
    if quiet not in sys.warnoptions:
        sys.warnoptions.append(quiet)


@contextlib.contextmanager
def _stop_signals() -> Iterator[threading.Event]:
    """SIGTERM/SIGINT raise :class:`_Signalled` in the launcher's main thread until the
    yielded event is set (then they are ignored: the sweep under way must not be cut);
    the previous handlers come back on exit. Installed here, in the launching process
    only, and only while it supervises ranks."""
    stopping = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stopping
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        if not stopping.is_set():
            stopping.set()
            raise _Signalled(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stopping
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
