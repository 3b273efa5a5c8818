"""The launcher's watch over its ranks: their results, their deaths, and the final sweep.

Why a failure is explained after a short wait rather than at once: when one rank dies,
the others notice within milliseconds (a collective's peer is gone, the store's host
closed, the controller relays an executor's ``Failed``) and report errors of their own.
The error that names the rank which died first *in cause* is the useful one: a rank
that was killed or exited without a word, else one whose error is not a consequence of
another's. Once a failure is seen, what the ranks print is kept but no longer shown.
"""

from __future__ import annotations

import contextlib
import signal
import time
import uuid
from collections.abc import Callable
from multiprocessing import connection
from typing import TYPE_CHECKING, Any, cast

import psutil

from rl.runtime import tree

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from rl.runtime.rank_output import RankOutput


class RankFailed(RuntimeError):
    """A rank, or a thread in one, died: the message names it and ends with its last lines.
    Every process of the job is gone when this is raised."""


EXIT_GRACE_S = 2.0  # how long finished ranks get to exit before the sweep
FAILURE_WINDOW_S = 0.5  # after a first failure, how long to look for the one behind it
# What a rank reports when it failed because another one did first (a closed store, a
# peer gone from a collective, the controller relaying an executor's Failed).
_CONSEQUENCES = ("RemoteError", "DistNetworkError", "Connection closed by peer",
                 "Connection reset by peer", "Failed to recv")  # fmt: skip


MARK_ENV = "MSRL_SPAWN_MARK"


class Supervisor:
    """The launcher's side of a running job: results, deaths, the final sweep."""

    def __init__(
        self,
        procs: list[Any],
        outputs: list[RankOutput],
        results: list[Connection],
        name: Callable[[int], str],
    ):
        self.procs, self.outputs, self.results, self.name = procs, outputs, results, name
        # Every process of the job carries this in its environment (the ranks set it, and
        # what they start inherits it); the sweep spares whatever lacks it: the caller's
        # own processes, such as a test's SGLang server or torch's shared-memory manager.
        self.mark = uuid.uuid4().hex

    def _pids(self) -> frozenset[int]:
        return frozenset(p.pid for p in self.procs if p.pid is not None)

    def gather(self, timeout_s: float) -> dict[int, bytes]:
        """Every rank's result; on the first failure, the failing rank's error."""
        out: dict[int, bytes] = {}
        failed: dict[int, str] = {}  # rank -> its report
        first_failure: float | None = None
        deadline = time.monotonic() + timeout_s

        pending = {conn: rank for rank, conn in enumerate(self.results)}

        def take(timeout: float) -> bool:
            """Read what is ready within ``timeout``; False if nothing was."""
            ready = connection.wait(list(pending), timeout)
            for conn in self.results:
                if conn not in ready:
                    continue
                rank = pending.pop(conn)  # one message per rank, or end-of-file
                with contextlib.suppress(EOFError, OSError):
                    ok, payload = conn.recv()
                    if ok:
                        out[rank] = cast("bytes", payload)
                    else:
                        failed.setdefault(rank, str(payload))
                conn.close()
            return bool(ready)

        while len(out) < len(self.procs):
            if not take(0.2):
                tree.reap(self._pids())  # orphans of the ranks, reparented to us
            dead = self._dead(out, failed)
            while dead and take(0.05):  # what it sent just before it ended comes first
                dead = self._dead(out, failed)
            if (failed or dead) and first_failure is None:
                first_failure = time.monotonic()
                for o in self.outputs:  # what dying ranks print from now on is noise
                    o.mute()
            if first_failure is not None and time.monotonic() > first_failure + FAILURE_WINDOW_S:
                raise RankFailed(self._explain(failed, self._dead(out, failed)))
            if time.monotonic() > deadline:
                for o in self.outputs:
                    o.mute()
                raise TimeoutError(f"ranks did not finish within {timeout_s:.0f}s")
        return out

    def _dead(self, out: dict[int, bytes], failed: dict[int, str]) -> dict[int, int]:
        """Ranks that ended with neither a result nor a report."""
        dead = {}
        for r, p in enumerate(self.procs):
            code = p.exitcode
            if code is not None and r not in failed and r not in out:
                dead[r] = code
        return dead

    def _explain(self, failed: dict[int, str], dead: dict[int, int]) -> str:
        """One error: the rank whose failure came first in cause, not in time."""
        if dead:  # a rank killed or gone without a word: the others only noticed
            rank, code = next(iter(dead.items()))
            if code < 0:
                what = f"was killed by {signal.Signals(-code).name} (exited with code {code})"
            else:
                what = f"exited with code {code} without reporting a result"
            head = f"{self.name(rank)} {what}"
        else:
            causes = [r for r, t in failed.items() if not any(c in t for c in _CONSEQUENCES)]
            rank = causes[0] if causes else next(iter(failed))
            report = failed[rank].rstrip()
            sep = "\n" if "\n" in report else " "  # one line stays one (launch.failure_text)
            head = (f"{self.name(rank)}: {report}" if report.startswith("thread ")
                    else f"{self.name(rank)} failed:{sep}{report}")  # fmt: skip
            if sep == " ":  # a report that is the whole story: what the rank printed is not
                return head
        others = sorted((set(failed) | set(dead)) - {rank})
        lines = self.outputs[rank].tail() or ["(it printed nothing)"]
        text = f"{head}\nlast lines of {self.name(rank)}:\n" + "\n".join(f"  | {x}" for x in lines)
        if others:
            text += "\n(then also: " + ", ".join(self.name(r) for r in others) + ")"
        return text

    def finish(self) -> None:
        """After every result: let the ranks exit, then sweep what they left behind."""
        # Poll the exit status (waitpid) instead of join(), which waits for EOF on the
        # rank's sentinel pipe: a daemon the rank started (torch_shm_manager) inherits
        # that pipe and would hold join() for as long as it lives.
        end = time.monotonic() + EXIT_GRACE_S
        for p in self.procs:
            while p.exitcode is None and time.monotonic() < end:
                time.sleep(0.02)
        self._sweep()
        for o in self.outputs:
            o.join(0.5)

    def kill_everything(self) -> str:
        """Kill every process of the job; say what that was ("5 ranks, 1 SGLang server,
        14 processes in all")."""
        for o in self.outputs:  # what dying ranks print now is noise
            o.mute()
        left = tree.descendants(self._keep())
        ranks = sum(1 for p in self.procs if p.pid is not None and p.exitcode is None)
        servers = sum(1 for p in left if _is_server(p))
        # What the killed processes own in /dev/shm: a server's guard would unlink it, but
        # the sweep kills the guard too. Read from every descendant: an SGLang scheduler's
        # process title overwrites its environment, so it does not show the job's mark.
        shm = tree.shm_mapped(tree.descendants())
        self._sweep()
        tree.unlink_all(shm)
        return (f"{ranks} rank{'s' * (ranks != 1)}, {servers} SGLang server"
                f"{'s' * (servers != 1)}, {len(left)} processes in all")  # fmt: skip

    def _keep(self) -> frozenset[int]:
        """Descendants that are not the job's (the ranks and what carries their mark are)."""
        keep = set(tree.multiprocessing_servers())
        ranks = self._pids()
        for p in tree.descendants():
            if p.pid in ranks:
                continue
            with contextlib.suppress(psutil.Error):  # gone or a zombie: the sweep reaps it
                if p.environ().get(MARK_ENV) != self.mark:
                    keep.add(p.pid)
        return frozenset(keep)

    def _sweep(self) -> None:
        tree.kill_all(self._keep(), spare_reap=self._pids())
        for p in self.procs:
            if p.pid is not None:
                p.join(timeout=2.0)


def _is_server(p: psutil.Process) -> bool:
    """An SGLang server's main process (not the guard in front of it, whose command line
    holds the server's)."""
    with contextlib.suppress(Exception):
        cmd = " ".join(p.cmdline())
        return "sglang.launch_server" in cmd and "server_guard" not in cmd
    return False
