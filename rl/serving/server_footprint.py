"""What a CPU server would otherwise leave open or behind on the machine: its scheduler's
store on a port of every interface, and a semaphore in ``/dev/shm`` after it stops
(imported at start-up in every process of a CPU server, by the ``sitecustomize`` that
rl/serving/cpu_shim.py writes).

The store. Each SGLang server initialises torch.distributed for its TP group with
``tcp://127.0.0.1:<port>``, and torch's TCPStore server listens on every interface
whatever host it is given: anyone who reaches the machine could connect to the
scheduler's store (``ss -ltn`` showed it on ``*`` during the tiny job, the one listener of
the job not on loopback). When the address is a loopback one, every rank of the group is
on this machine, and a ``file://`` store in the server's own log directory does the same
job with no socket at all. Replaces, once ``sglang.srt.distributed.bootstrap`` is
imported: the module's ``init_distributed_environment``, wrapped to turn a loopback
``tcp://`` init method into ``file://`` + the path the launcher gives in ``STORE_ENV`` (a
fresh file per server start). Any other address (a server spanning nodes) is left as it
is.

The semaphore. Loading weights, SGLang shows a tqdm bar, and tqdm's first bar creates a
multiprocessing ``RLock`` (for bars of several processes): a named semaphore
``/dev/shm/sem.mp-*``, which the resource tracker would unlink, but stopping a server
kills its process tree, tracker included, so every run of the job left one (found by
logging every ``SemLock`` the job's processes made). Replaces, once ``tqdm.std`` is
imported: ``TqdmDefaultWriteLock.mp_lock`` is set to None, so tqdm keeps only its
thread lock (bars of one process; the servers' are).

Versions: sglang 0.5.23, torch 2.14.1, tqdm 4.x. On CUDA the shim is not installed, so
a GPU server's store still listens on every interface and its semaphore stays.

Standard library only at import time: it runs before anything else in the process.
"""

from __future__ import annotations

import os
from types import ModuleType
from urllib.parse import urlsplit

from rl.serving.after_import import Patch, patch_on_import

STORE_ENV = "MSRL_SGLANG_STORE"
BOOTSTRAP = "sglang.srt.distributed.bootstrap"
TQDM = "tqdm.std"
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def local_method(method: object, path: str) -> object:
    """``file://`` + the absolute ``path`` for a ``tcp://`` method on a loopback address,
    else ``method``. Absolute: ``file://runs/x.store`` would name host "runs", and the
    store would wait for its peers forever (a job whose output directory is relative,
    as the main job's is, hung so at its server's start)."""
    if not isinstance(method, str) or not method.startswith("tcp://"):
        return method
    if urlsplit(method).hostname not in LOOPBACK:
        return method
    return f"file://{os.path.abspath(path)}"


def patch_bootstrap(module: ModuleType) -> None:
    """Wrap the bootstrap's ``init_distributed_environment`` (idempotent)."""
    original = getattr(module, "init_distributed_environment", None)
    if original is None or getattr(original, "_msrl_file_store", False):
        return

    def init_distributed_environment(*args: object, **kw: object) -> object:
        path = os.environ.get(STORE_ENV)
        if path and "distributed_init_method" in kw:
            kw["distributed_init_method"] = local_method(kw["distributed_init_method"], path)
        return original(*args, **kw)

    init_distributed_environment._msrl_file_store = True  # type: ignore[attr-defined]
    vars(module)["init_distributed_environment"] = init_distributed_environment


def patch_tqdm(module: ModuleType) -> None:
    """tqdm without its multiprocessing lock (idempotent)."""
    lock = getattr(module, "TqdmDefaultWriteLock", None)
    if lock is not None and not hasattr(lock, "mp_lock"):
        lock.mp_lock = None


def install() -> None:
    """No tqdm semaphore; the bootstrap's store a file if the launcher gave its path."""
    patches: dict[str, Patch] = {TQDM: patch_tqdm}
    if os.environ.get(STORE_ENV):
        patches[BOOTSTRAP] = patch_bootstrap
    patch_on_import(patches)
