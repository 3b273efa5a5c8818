"""Every process a rank starts through multiprocessing ends when that rank ends.

Why: ranks start long-lived helpers through multiprocessing (Megatron's checkpoint writer
starts a spawn Manager that serves until it is asked to shut down; the reward executor
starts scoring workers). While the launcher lives, it is their subreaper and sweeps them
(rl/runtime/tree.py). When the launcher itself is SIGKILLed, the ranks die of their
parent-death signal, but nothing ended these helpers: two Managers (torch imported,
570 MB each) were seen waiting forever with PPID 1 after a killed job.

How: a helper that multiprocessing starts copies its parent's
``current_process()._config`` and, when spawned (or started by a forkserver), unpickles
it before it runs its target. :func:`install` puts a :class:`Lifeline` there; in the
child, unpickling it opens a pidfd on the process that started it and starts a thread
that ends the child (``os._exit``) as soon as that process is gone, and puts a Lifeline
in the child's own config, so the child's children are tied to it in turn. Forked
children do the same through multiprocessing's after-fork hooks.

Why a watching thread and not PR_SET_PDEATHSIG: that signal follows the *thread* that
started the child (the reward executor restarts workers from its dispatch thread) and
only a direct parent (a forkserver's children have the forkserver as theirs); the thread
ends the helper whatever its main thread is blocked in and whatever signals it handles.
"""

from __future__ import annotations

import os
import select
import threading
import time
from multiprocessing import process, util

POLL_S = 0.2  # without pidfds: how soon a helper notices that its parent is gone
_KEY = "msrl_lifeline"
_linked: tuple[int, Lifeline] | None = None  # the process this one watches, and its tie


def _watch(parent: int, pidfd: int | None) -> None:
    if pidfd is not None:  # readable once the process has ended
        select.select([pidfd], [], [])
    else:  # a dead parent's children are reparented at once
        while os.getppid() == parent:
            time.sleep(POLL_S)
    os._exit(1)


def _link(parent: int) -> Lifeline:
    """In a new child: end it when ``parent`` (the process that started it) ends, or now
    if it already has; tie the child's own children to it as well."""
    global _linked
    if _linked is not None and _linked[0] == parent:  # a spawned child runs both hooks
        return _linked[1]
    pidfd = None
    try:
        pidfd = os.pidfd_open(parent)
    except ProcessLookupError:
        os._exit(1)
    except (OSError, AttributeError):  # no pidfds (old kernel): watch the parent pid
        if os.getppid() != parent:
            os._exit(1)
    lifeline = Lifeline()
    _linked = (parent, lifeline)  # held here: after-fork hooks are held only weakly
    threading.Thread(target=_watch, args=(parent, pidfd), name="lifeline", daemon=True).start()
    util.register_after_fork(lifeline, _after_fork)
    return lifeline


class Lifeline:
    """Pickled by a parent into each child it spawns; unpickled, it ties the child to it."""

    def __reduce__(self) -> tuple[object, tuple[int]]:
        return _link, (os.getpid(),)  # pickled in the parent, while it starts the child


def _after_fork(_: Lifeline) -> None:
    parent = process.current_process()._parent_pid  # type: ignore[attr-defined]
    if parent is not None:
        process.current_process()._config[_KEY] = _link(parent)  # type: ignore[attr-defined]


def install() -> None:
    """Tie every process this one starts through multiprocessing (and theirs) to this
    one's life. Called in each rank, before it starts anything."""
    lifeline = Lifeline()
    process.current_process()._config[_KEY] = lifeline  # type: ignore[attr-defined]
    util.register_after_fork(lifeline, _after_fork)
