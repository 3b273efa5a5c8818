"""Start N ranks on this machine (or join ranks started by torchrun/srun) with gloo or NCCL.

Why our own spawner: configs are validated in the parent *before* any rank exists, each
rank must apply the Megatron CPU patches before importing Megatron, and a rank that dies
must fail the whole run with its traceback instead of leaving the others hung in a
collective. Under torchrun (RANK/WORLD_SIZE set) the same worker function runs in place.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import time
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl.dist.net import free_port

if TYPE_CHECKING:
    from multiprocessing.queues import Queue

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


def die_with_parent(parent: int) -> None:
    """SIGTERM this rank when the launching process dies, even by SIGKILL (Linux
    PR_SET_PDEATHSIG), so killing a run never leaves ranks (or their servers: a generator
    rank stops them on SIGTERM) behind."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before the line above
        os._exit(1)


def under_launcher() -> bool:
    """True when torchrun/srun already started this process as one rank of a world."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _child(
    rank: int,
    world_size: int,
    port: int,
    device: str,
    threads: int,
    fn: Callable[..., Any],
    args: tuple,
    results: Queue[tuple[int, bool, bytes | str]],  # (rank, ok, its result or traceback)
    setup: bool = True,
    parent: int = 0,
) -> None:
    die_with_parent(parent)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    try:
        if setup:
            setup_rank(device, threads)
        else:  # fn joins process groups itself (rl.dist.job)
            quiet_known_warnings()
            torch.set_num_threads(threads)
        out = fn(*args)
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., R],
    world_size: int,
    *args: object,
    device: str = "cpu",
    threads: int = 1,
    timeout_s: float = 900.0,
    setup: bool = True,
) -> list[R]:
    """Run ``fn(*args)`` on ``world_size`` fresh local ranks; return each rank's result.

    ``fn`` must be importable (module level). If any rank raises, the others are killed and
    a RuntimeError carries the first failing rank's traceback. With ``setup`` every rank
    joins one default process group over all ranks first; without, ``fn`` sets up its own
    (e.g. one group per executor role).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, port, device, threads, fn, args, results, setup, os.getpid()),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, R] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except Exception:  # queue.Empty: check for ranks that died without a word
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and not any(r in out for r in dead):
                    raise RuntimeError(
                        f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                        "without reporting a result"
                    ) from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks did not finish within {timeout_s:.0f}s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            out[rank] = torch.load(io.BytesIO(payload), weights_only=False)
        # Poll the exit status (waitpid) instead of join(), which waits for EOF on the
        # rank's sentinel pipe: a daemon the rank started (torch_shm_manager, kept alive
        # while a server still maps the rank's shared memory) inherits that pipe and held
        # join() for its full 60 s after the rank had exited.
        end = time.monotonic() + 60
        for p in procs:
            while p.exitcode is None and time.monotonic() < end:
                time.sleep(0.05)
    finally:
        for p in procs:
            if p.pid is not None and p.is_alive():
                _kill_tree(p.pid)
                p.join()
    return [out[r] for r in range(world_size)]


def _kill_tree(pid: int) -> None:
    """Kill a rank and whatever it started (e.g. the multiprocessing Manager that Megatron's
    checkpoint saving starts), which would otherwise outlive it as an orphan."""
    import psutil

    try:
        rank = psutil.Process(pid)
        family = [*rank.children(recursive=True), rank]
    except psutil.NoSuchProcess:
        return
    for proc in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
