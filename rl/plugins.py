"""Registries found by listing a package: every extension point is a package with one
module per choice (model families, DDMA transports, off-policy corrections, RL
objectives), each module defining one object under an agreed name. Adding a choice is
adding a module; nothing else names it.

Pure logic and a leaf: importlib and pkgutil only.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

T = TypeVar("T")


def discover(package: ModuleType, attr: str, key: Callable[[T], str]) -> dict[str, T]:
    """``key(obj) -> obj`` for the ``attr`` of every module of ``package``, in module-name
    order; a key declared twice is an error naming the second module."""
    out: dict[str, T] = {}
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        obj: T = getattr(importlib.import_module(f"{package.__name__}.{info.name}"), attr)
        name = key(obj)
        if name in out:
            raise RuntimeError(f"{name!r} is declared twice in {package.__name__} ({info.name})")
        out[name] = obj
    return out
