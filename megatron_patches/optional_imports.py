"""Patch: Megatron-Core's inference context and timers import neither flashinfer nor wandb
on CPU.

Why: ``import megatron.core`` executes ``megatron.core.inference.contexts.dynamic_context``
(through ``inference_params``), which tries ``import flashinfer`` (a fused RoPE for
Megatron's own dynamic-batching inference) and ``import wandb`` (that inference's
logging), and ``megatron.core.timers``, which tries ``import wandb`` (to write timings to
a wandb writer it is handed). The trainer uses none of them: generation is SGLang's, and
the controller logs to wandb itself. Both packages are installed as SGLang's dependencies,
so both load: 3.6 s of the 7.6 s the CPU patches with ``import megatron.core`` took on
this machine, paid by every trainer rank and every test that spawns ranks.
Replaces: while one of those modules executes, and only then, its optional imports raise
ImportError, so it takes its own fallback (``HAVE_FLASHINFER``/``HAVE_WANDB`` false,
``wandb = None``). Anywhere else both import as usual; a package already imported is
left as it is. Must run before Megatron is imported.
Versions: megatron-core 0.16.1.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType

from megatron_patches._util import once

NAME = "optional_imports"
# Megatron module -> the optional packages it does not import.
SKIPPED = {
    "megatron.core.inference.contexts.dynamic_context": ("flashinfer", "wandb"),
    "megatron.core.timers": ("wandb",),
}


class _Skip(importlib.abc.MetaPathFinder):
    """Refuses ``packages`` (while it is on ``sys.meta_path``)."""

    def __init__(self, importer: str, packages: tuple[str, ...]):
        self.importer, self.packages = importer, packages

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in self.packages:
            raise ImportError(f"{name}: not imported by {self.importer} (megatron_patches.{NAME})")
        return None


class _Guard(importlib.abc.MetaPathFinder):
    """Finds each module of ``SKIPPED`` as usual and runs it with :class:`_Skip` first on
    the path."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name not in SKIPPED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            skip = _Skip(name, SKIPPED[name])
            sys.meta_path.insert(0, skip)
            try:
                run(module)
            finally:
                sys.meta_path.remove(skip)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def apply() -> bool:
    def _do() -> None:
        if not any(m in sys.modules for m in SKIPPED):  # else too late, and nothing to save
            sys.meta_path.insert(0, _Guard())

    return once(NAME, _do)
