"""Patch a module right after it is first imported, in a server process (the CPU shim's
``sitecustomize`` runs before SGLang imports anything: rl/serving/cpu_shim.py).

Why a meta-path hook rather than patching at start-up: importing SGLang (and torch) in
every server process only to patch it would cost each one seconds, and a patch applied
before its module runs would be overwritten by it. Standard library only: it runs before
anything else in the process.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

Patch = Callable[[ModuleType], None]


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``patches[name](module)`` right after ``name`` is first executed."""

    def __init__(self) -> None:
        self.patches: dict[str, list[Patch]] = {}

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        fixes = self.patches.pop(name, None)
        if fixes is None:
            return None
        spec = importlib.util.find_spec(name)  # the real one: ``name`` is no longer ours
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            for fix in fixes:
                fix(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def patch_on_import(patches: dict[str, Patch]) -> None:
    """Apply each patch now if its module is loaded, else right after it is imported.
    A patch must be idempotent: a module loaded twice under one name is patched twice."""
    hook = next((f for f in sys.meta_path if isinstance(f, AfterImport)), None)
    for name, fix in patches.items():
        if name in sys.modules:
            fix(sys.modules[name])
            continue
        if hook is None:
            hook = AfterImport()
            sys.meta_path.insert(0, hook)
        hook.patches.setdefault(name, []).append(fix)
