"""Rank functions that fail in every way a rank can, for the spawner's tests (module level,
so spawned ranks import them), and a small launcher entry point for the signal tests:

    python -m tests.helpers.spawn_workers RUN_DIR   # 3 ranks that wait; SIGTERM/SIGINT it
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

_KEEP: list[object] = []


def _leave_children(run_dir: str, rank: int) -> None:
    """What a real rank leaves running: a Manager (as Megatron's checkpoint saving
    starts one) and a plain grandchild; their pids go to ``run_dir``."""
    manager = multiprocessing.get_context("spawn").Manager()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    pids = [manager._process.pid, sleeper.pid]  # type: ignore[attr-defined]
    Path(run_dir, f"children.{rank}").write_text(" ".join(map(str, pids)))
    _KEEP.append(manager)  # alive past this frame


def started_as(var: str) -> dict:
    """What a rank found when its function began: ``var`` in its environment, whether
    Megatron-Core was imported and patched already, and whether its parent is the
    launcher's fork server; and its command line once it titled itself as rl.train's
    ranks do (``ps`` shows the title)."""
    import setproctitle

    import megatron_patches
    from rl.runtime import tree

    setproctitle.setproctitle("msrl:test:0")
    return {
        "title": Path("/proc/self/cmdline").read_bytes().split(b"\0")[0].decode(),
        "value": os.environ.get(var),
        "megatron": "megatron.core" in sys.modules,
        "patched": bool(megatron_patches.applied()),
        "parent": os.getppid(),
        "servers": sorted(tree.multiprocessing_servers()),
    }


def fail(run_dir: str, victim: int, how: str) -> int:
    """Rank ``victim`` dies ``how`` after printing a line; the others wait (as ranks in a
    collective would) and would finish only after 120 s."""
    rank = int(os.environ["RANK"])
    if rank != victim:
        time.sleep(120)
        return rank
    _leave_children(run_dir, rank)
    print(f"rank {rank}: last words before {how}", flush=True)
    time.sleep(0.5)
    Path(run_dir, "died_at").write_text(repr(time.time()))
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "exit":
        os._exit(3)
    elif how == "raise":
        raise ValueError("a bad value in the victim")
    elif how == "thread":

        def die() -> None:
            raise RuntimeError("the reply thread met a malformed message")

        threading.Thread(target=die, name="replies").start()
    elif how == "protocol":  # an authentic message that breaks the protocol: one line

        def refuse() -> None:
            from rl.runtime.channel import ProtocolError

            raise ProtocolError("reward/out: a reply to request 7, which is not pending")

        threading.Thread(target=refuse, name="replies").start()
    elif how == "protocol_raise":  # the same, met by the rank's main thread
        from rl.runtime.channel import ProtocolError

        raise ProtocolError("reward/out: a reply to request 7, which is not pending")
    time.sleep(120)
    return rank


def finish_leaving_children(run_dir: str) -> int:
    """Every rank returns at once, leaving a Manager and a grandchild behind."""
    rank = int(os.environ["RANK"])
    _leave_children(run_dir, rank)
    return rank


def wait(run_dir: str) -> int:
    rank = int(os.environ["RANK"])
    _leave_children(run_dir, rank)
    Path(run_dir, f"ready.{rank}").write_text("")
    time.sleep(120)
    return rank


def main(run_dir: str) -> None:
    from rl.runtime.launch import Stopped, spawn

    try:
        spawn(wait, 3, run_dir, setup=False, names=lambda r: f"worker rank {r}",
              saved=lambda: "saved: nothing (a test)")  # fmt: skip
    except Stopped as e:
        print(e, file=sys.stderr, flush=True)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    main(sys.argv[1])
