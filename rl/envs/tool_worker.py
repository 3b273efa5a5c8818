"""A user's tool, run in worker processes: an overrun kills its worker, not a thread left
running.

Why: a user's tool is arbitrary Python (``env.tools=[file.py:fn]``). Run in a thread, a
call that never returns could only be abandoned: each such call left a thread running (5
calls of a tool that sleeps an hour left 5). In a worker process, an overrun kills the
worker's process group and the call is answered as a timeout; the next call gets a fresh
worker. Workers are reused between calls, and as many run as calls do at once.

The protocol, JSON lines on the worker's stdin and on a pipe of its own (the tool's prints
go to stderr, never into it): first ``{"ready": true}`` once the tool is loaded, then for
each ``{"arguments": {...}}`` ``{"text": ..., "status": ...}``, or
``{"raised": "TypeName: message"}`` for what the tool (or its loading) raised.

Run as ``python -m rl.envs.tool_worker SPEC``; it imports only the standard library, this
package's plugin loader and the tool's own module.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

# How long a new worker may take to load its tool (an interpreter and the tool's module);
# it does not count against a call's wall clock. A killed worker's replacement starts at
# once, so the next call usually finds it loaded.
START_S = 30.0


class _Worker:
    def __init__(self, spec: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rl.envs.tool_worker", spec],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own group: a kill takes what the tool started
        )  # fmt: skip
        self.loaded = False

    def _answer(self, wait_s: float) -> dict[str, Any] | None:
        """The worker's next line, or None past ``wait_s`` (the worker is then killed)."""
        assert self.proc.stdout is not None
        deadline, fd = time.monotonic() + wait_s, self.proc.stdout.fileno()
        while not select.select([fd], [], [], max(deadline - time.monotonic(), 0))[0]:
            if time.monotonic() >= deadline:
                self.kill()
                return None
        line = self.proc.stdout.readline()
        if not line:  # it died (os._exit, a signal) without an answer
            self.kill()
            return {"raised": f"the tool's worker exited with code {self.proc.poll()}"}
        return json.loads(line)

    def call(self, arguments: dict[str, Any], wall_s: float) -> dict[str, Any] | None:
        """The worker's answer, or None past ``wall_s`` (the worker is then killed)."""
        if not self.loaded:
            ready = self._answer(START_S)
            if ready is None or "raised" in ready:
                return ready or {"raised": f"the tool's worker did not load in {START_S:g} s"}
            self.loaded = True
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"arguments": arguments}).encode() + b"\n")
        self.proc.stdin.flush()
        return self._answer(wall_s)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)


class WorkerPool:
    """Calls of the tool ``spec`` names, each in an idle worker (or a new one)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._closed = False
        self._lock = threading.Lock()
        atexit.register(self.close)

    def call(self, arguments: dict[str, Any], wall_s: float) -> dict[str, Any] | None:
        """The tool's answer, ``{"raised": ...}``, or None past ``wall_s``."""
        with self._lock:
            w = self._idle.pop() if self._idle else _Worker(self.spec)
            self._busy.add(w)
        try:
            out = w.call(arguments, wall_s)
        except (OSError, ValueError) as e:  # a broken pipe: the worker is gone
            w.kill()
            out = {"raised": f"the tool's worker failed: {e}"}
        with self._lock:
            self._busy.discard(w)
            if w.proc.poll() is None:
                self._idle.append(w)
            elif not self._closed and w.loaded:  # killed: its replacement loads now
                self._idle.append(_Worker(self.spec))
        return out

    def workers(self) -> int:
        """Worker processes alive now."""
        with self._lock:
            return sum(w.proc.poll() is None for w in (*self._idle, *self._busy))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            workers, self._idle = [*self._idle, *self._busy], []
            self._busy.clear()
        for w in workers:
            w.kill()


def _serve(spec: str) -> None:
    """The worker: load the tool, then answer calls until stdin closes."""
    from rl.plugins import load_object

    out = os.fdopen(os.dup(1), "w")  # the protocol's pipe; the tool's prints go to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        obj = load_object(spec, "a tool", ValueError)
    except Exception as e:
        out.write(json.dumps({"raised": f"{type(e).__name__}: {e}"}) + "\n")
        return
    fn = getattr(obj, "fn", obj)  # a Tool, or a function
    if not callable(fn):
        out.write(json.dumps({"raised": f"TypeError: {spec} names no function"}) + "\n")
        return
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        try:
            res = fn(**json.loads(line)["arguments"])
            status = getattr(res, "status", None)  # a ToolOutcome, or the text itself
            text = str(getattr(res, "text", res)) if status is not None else str(res)
            status = str(status) if status is not None else "ok"
            answer: dict[str, Any] = {"text": text, "status": status}
        except Exception as e:
            answer = {"raised": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(answer) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve(sys.argv[1])
