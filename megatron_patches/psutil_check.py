"""Patch: fail early, with the fix, when ``psutil`` is missing.

Why: ``megatron.core.dist_checkpointing`` imports ``psutil`` on save/load, but
megatron-core does not declare it, so a checkpoint save can die deep inside a training run
with a bare ModuleNotFoundError. The project's requirements install it; this check turns
a broken environment into a clear error before any work is done.
Replaces: nothing (a check, not a replacement).
Versions: megatron-core 0.16.1.
"""

from __future__ import annotations

import importlib.util

from megatron_patches._util import once

NAME = "psutil_check"


def apply() -> bool:
    def _do() -> None:
        if importlib.util.find_spec("psutil") is None:
            raise ImportError(
                "psutil is required by megatron.core.dist_checkpointing but is not installed; "
                "rebuild the environment with tools/setup_env.sh"
            )

    return once(NAME, _do)
