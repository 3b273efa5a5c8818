"""What a CPU server would otherwise leave behind on the machine: a semaphore in
``/dev/shm`` after it stops (imported at start-up in every process of a CPU server, by
the ``sitecustomize`` that rl/serving/cpu_shim.py writes).

Loading weights, SGLang shows a tqdm bar, and tqdm's first bar creates a multiprocessing
``RLock`` (for bars of several processes): a named semaphore ``/dev/shm/sem.mp-*``, which
the resource tracker would unlink, but stopping a server kills its process tree, tracker
included, so every run of the job left one (found by logging every ``SemLock`` the job's
processes made). Replaces, once ``tqdm.std`` is imported: ``TqdmDefaultWriteLock.mp_lock``
is set to None, so tqdm keeps only its thread lock (bars of one process; the servers'
are). On CUDA the shim is not installed: there the server's guard unlinks the semaphore
once the server is gone (rl/serving/server_guard.py), unless the guard is SIGKILLed too.

The scheduler's store, the other thing a server opened beyond loopback, is a file by the
launcher's choice of SGLang's init method (rl/serving/launcher.py), on every device.

Versions: sglang 0.5.23, tqdm 4.x. Standard library only at import time: it runs before
anything else in the process.
"""

from __future__ import annotations

from types import ModuleType

from rl.serving.after_import import patch_on_import

TQDM = "tqdm.std"


def patch_tqdm(module: ModuleType) -> None:
    """tqdm without its multiprocessing lock (idempotent)."""
    lock = getattr(module, "TqdmDefaultWriteLock", None)
    if lock is not None and not hasattr(lock, "mp_lock"):
        lock.mp_lock = None


def install() -> None:
    """No tqdm semaphore."""
    patch_on_import({TQDM: patch_tqdm})
