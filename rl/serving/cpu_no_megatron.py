"""Keep Megatron-Core out of a CPU server's processes.

Why: SGLang's debug dumper (``sglang.srt.debug_utils.dumper``, imported by the model
runner whatever the flags) probes for Megatron-Core at import time (``_MegatronPlugin``:
``from megatron.core import parallel_state``, an ``ImportError`` meaning "not there").
This project installs one environment for trainer and servers, so the probe finds it, and
importing Megatron-Core pulls in wandb (its dynamic inference context): 5.3 s of a tiny
CPU server's 19 s start here, paid on every server start of a job or a test, by a server
that never uses either.

Replaces: the import of ``megatron`` (and its submodules) in the server's processes, which
fails as if it were not installed; the dumper's plugin then reports itself unavailable,
its documented fallback. Nothing the servers run needs Megatron: the DDMA receiver they
load (rl/ddma/sglang_receiver.py) imports none of it. Versions: sglang 0.5.23,
megatron-core 0.16.1.

On by default for CPU servers (rl/serving/cpu_shim.py); ``MSRL_SGLANG_MEGATRON=1`` in the
environment the servers inherit lets them import it. Standard library only: it runs before
anything else in the process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Sequence
from types import ModuleType

ALLOW_ENV = "MSRL_SGLANG_MEGATRON"
BLOCKED = "megatron"


class NoMegatron(importlib.abc.MetaPathFinder):
    """Refuses ``megatron`` and its submodules, as a missing package would."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name == BLOCKED or name.startswith(BLOCKED + "."):
            raise ModuleNotFoundError(f"No module named {name!r} (a CPU server's shim)", name=name)
        return None


def install() -> None:
    """Idempotent: one finder, first on the path, unless the environment allows Megatron."""
    if os.environ.get(ALLOW_ENV) == "1":
        return
    if not any(isinstance(f, NoMegatron) for f in sys.meta_path):
        sys.meta_path.insert(0, NoMegatron())
