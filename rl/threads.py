"""Every thread the controller's process runs beside the RL steps, named in one place
(and the reward ranks' one, whose module holds both ends of the scoring).

A stall line, a py-spy dump or a rank's "lost a thread" error names a thread; this table
says what each one does. Threads are started only through :func:`named_thread`,
:func:`start_thread` and :func:`thread_pool`, which refuse a name the table does not
hold, so it cannot fall behind the code (tests/unit/test_executor_configs.py checks that
nothing in those modules starts a thread another way).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

# A name ending in "*" is a prefix: the threads it covers add what they serve.
THREADS: dict[str, str] = {
    "rollout-stream": "generates and scores groups ahead (rl/controller/rollouts.py)",
    "batch-prefetch": "takes and assembles the next step's batch (rl/controller/prefetch.py)",
    "step-log": "writes a step's records while the next step runs (prefetch.Background)",
    "server-recovery": "re-pushes the current weights into a restarted server, between "
    "two steps under the weight sync's lock (rl/controller/recovery.py)",
    "generator-client": "the event loop of the client's requests to the servers",
    "ddma-control": "the weight sync's calls to each server (rl/generator/ddma_target.py)",
    "env": "multi-turn episodes: tool calls and observations (rl/controller/episodes.py)",
    "tool-*": "one tool call of an episode, named by its tool, given up at its wall-time "
    "limit (rl/envs/tools.py)",
    "reward-model": "a reward model's scores of each group, beside the rule's "
    "(rl/controller/model_reward.py)",
    "reward-replies": "reads the reward ranks' scores as they come (rl/reward/service.py)",
    "reward-deadlines": "sends a score request again, or gives it up, past its deadline "
    "(rl/reward/service.py)",
    "reward-answers": "a reward rank's: sends each request's scores back once all are "
    "done (rl/reward/service.py)",
    "stall-watch": "a line, each rl.stall_warn_s without progress, saying what the loop "
    "waits for (rl/controller/stall.py)",
}


def registered(name: str) -> bool:
    """Is ``name`` in :data:`THREADS`, itself or under one of its prefixes?"""
    return name in THREADS or any(
        k.endswith("*") and name.startswith(k[:-1]) and len(name) > len(k) - 1 for k in THREADS
    )


def _check(name: str) -> None:
    if not registered(name):
        raise ValueError(
            f"thread {name!r} is not named in rl/threads.py THREADS: add it there, "
            "saying what it does"
        )


def named_thread(name: str, target: Callable[..., object], *args: object) -> threading.Thread:
    """A daemon thread (not started) running ``target(*args)``, called ``name``: a thread
    still waiting when the job ends must not hold the process."""
    _check(name)
    return threading.Thread(target=target, args=args, name=name, daemon=True)


def start_thread(name: str, target: Callable[..., object], *args: object) -> threading.Thread:
    """:func:`named_thread`, started."""
    thread = named_thread(name, target, *args)
    thread.start()
    return thread


def thread_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """A pool whose threads are called ``name_0``, ``name_1``...: ``name`` as for
    :func:`named_thread`."""
    _check(name)
    return ThreadPoolExecutor(workers, thread_name_prefix=name)
