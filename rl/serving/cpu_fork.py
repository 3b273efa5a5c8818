"""Start a CPU server's scheduler and detokenizer by fork instead of spawn.

Why: SGLang sets the ``spawn`` start method, so each of a server's child processes starts
a fresh interpreter and imports SGLang, transformers and torch again, paid on every
server start of a job or a test. A forked child inherits the parent's imports: a tiny
server here is ready in 18.0 s instead of 27.5 s, with 2.8 GB instead of 3.6 GB of peak
RSS over its processes (tools/bench/server_start.py). Spawn is SGLang's choice for CUDA
(a CUDA context does not survive fork); a CPU server has none, and the parent has started
no thread pool by then (it has only imported modules and parsed its arguments).

On by default for CPU servers (rl/serving/cpu_shim.py); ``MSRL_SGLANG_FORK=0`` in the
environment the servers inherit restores spawn.

Replaces, once ``sglang.srt.entrypoints.engine`` is imported and when ``FORK_ENV`` is
"1": the module's ``mp`` (the ``multiprocessing`` module) with a view of it whose
``set_start_method("spawn")`` sets ``fork``. Nothing else changes. Versions: sglang 0.5.23.

Standard library only at import time: it runs before anything else in the process.
"""

from __future__ import annotations

import multiprocessing
import os
from types import ModuleType
from typing import Any

from rl.serving.after_import import patch_on_import

FORK_ENV = "MSRL_SGLANG_FORK"
ENGINE = "sglang.srt.entrypoints.engine"


class _ForkingMultiprocessing:
    """``multiprocessing``, except that asking for spawn gives fork."""

    _msrl_fork = True

    def __getattr__(self, name: str) -> Any:
        return getattr(multiprocessing, name)

    @staticmethod
    def set_start_method(method: str | None, force: bool = False) -> None:
        multiprocessing.set_start_method("fork" if method == "spawn" else method, force=force)


def patch_engine(module: ModuleType) -> None:
    """Point the engine's ``mp`` at the forking view (idempotent)."""
    if not getattr(vars(module).get("mp"), "_msrl_fork", False):
        vars(module)["mp"] = _ForkingMultiprocessing()


def install() -> None:
    if os.environ.get(FORK_ENV) == "1":
        patch_on_import({ENGINE: patch_engine})
