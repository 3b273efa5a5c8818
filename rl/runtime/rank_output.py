"""Each spawned rank's stdout and stderr, passed through to the launcher's, last lines kept.

Why: when a rank dies the launcher must say which one and show what it last printed, and
once the job is failing or stopping, what the dying ranks print on the way out (store
connection warnings, KeyboardInterrupt tracebacks of every rank) is noise that buries the
one line that matters. So every rank writes into pipes that the launcher reads: lines go
on to the launcher's own stdout/stderr (unchanged, so tools that read the job's output
see the same text) until :meth:`RankOutput.mute`, and the last lines of each rank are
kept either way.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
from multiprocessing.connection import Connection
from typing import TextIO

TAIL_LINES = 12


class RankOutput:
    """The read side of one rank's two pipes, drained by one thread each."""

    def __init__(self, ctx: object, tail: int = TAIL_LINES):
        # Connections (not raw fds) so that multiprocessing hands the write ends to the
        # spawned rank; the rank dup2()s them onto its fds 1 and 2.
        self.out_r, self.out_w = ctx.Pipe(duplex=False)  # type: ignore[attr-defined]
        self.err_r, self.err_w = ctx.Pipe(duplex=False)  # type: ignore[attr-defined]
        self.lines: collections.deque[str] = collections.deque(maxlen=tail)
        self._lock = threading.Lock()
        self._muted = False
        self._threads: list[threading.Thread] = []

    @property
    def write_ends(self) -> tuple[Connection, Connection]:
        return self.out_w, self.err_w

    def start(self) -> None:
        """Drain both pipes; call once the rank holds its write ends (they are closed here,
        so end-of-file means every process that inherited them is gone)."""
        self.out_w.close()
        self.err_w.close()
        for conn, name in ((self.out_r, "stdout"), (self.err_r, "stderr")):
            t = threading.Thread(target=self._drain, args=(conn, name), daemon=True)
            t.start()
            self._threads.append(t)

    def mute(self) -> None:
        """Stop passing lines through (they are still kept in :attr:`lines`)."""
        with self._lock:
            self._muted = True

    def tail(self) -> list[str]:
        with self._lock:
            return list(self.lines)

    def join(self, timeout: float) -> None:
        """Wait until both pipes are drained (every writer gone) or ``timeout`` passes."""
        for t in self._threads:
            t.join(timeout)

    def _drain(self, conn: Connection, name: str) -> None:
        fd, rest = conn.fileno(), b""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                break
            rest += chunk
            *whole, rest = rest.split(b"\n")
            for raw in whole:
                self._line(raw.decode(errors="replace"), name)
        if rest:
            self._line(rest.decode(errors="replace"), name)
        conn.close()

    def _line(self, line: str, name: str) -> None:
        with self._lock:
            self.lines.append(line)
            if self._muted:
                return
            stream: TextIO = sys.stdout if name == "stdout" else sys.stderr
            try:
                stream.write(line + "\n")
                stream.flush()
            except (OSError, ValueError):  # the launcher's own output is gone
                self._muted = True


def redirect_into(out_w: Connection, err_w: Connection) -> None:
    """In the rank: send fds 1 and 2 (and so every child's output) into the pipes, line
    by line (a rank killed a moment later has still delivered what it printed)."""
    for conn, fd in ((out_w, 1), (err_w, 2)):
        os.dup2(conn.fileno(), fd)
        conn.close()
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)
