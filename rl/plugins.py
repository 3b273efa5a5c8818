"""Registries found by listing a package: every extension point is a package with one
module per choice (model families, DDMA transports, off-policy corrections, RL
objectives), each module defining one object under an agreed name. Adding a choice is
adding a module; nothing else names it.

It also loads what a user names by path (a reward function, a tool, an environment):
``pkg.module:attr`` from ``sys.path`` or ``path/to/file.py:attr``.

Pure logic and a leaf: importlib, pkgutil and OmegaConf's types only.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import pkgutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Protocol, TypeVar

from omegaconf import OmegaConf

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


class Named(Protocol):
    """A config node that names its choice (a task's, an objective's, a correction's)."""

    name: str


def chosen(
    node: Named,
    choices: dict[str, T],
    config: Callable[[T], type],
    group: str,
    error: type[Exception],
) -> T:
    """The choice a config node names (``node.name``), each choice's config dataclass
    being ``config(choice)``; ``error`` when no choice has that name, or when the node's
    fields are another choice's (its ``name`` set by hand), saying which override of the
    config ``group`` picks it."""
    choice = choices.get(node.name)
    if choice is None:
        raise error(f"{group}={node.name!r} must be one of {', '.join(choices)}")
    kind = OmegaConf.get_type(node)
    if kind is not config(choice):
        raise error(
            f"{group.replace('/', '.')}.name={node.name!r} but its fields are those of "
            f"{getattr(kind, '__name__', kind)}: choose it with {group}={node.name}"
        )
    return choice


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def split_spec(spec: str, forms: str, error: type[Exception]) -> tuple[str, str, bool]:
    """(module or file, attribute, is_file) of a ``where:attr`` spec; ``error`` naming the
    spec and the accepted ``forms`` when it is neither."""
    where, sep, attr = spec.rpartition(":")
    is_file = where.endswith(".py") or "/" in where or "\\" in where
    ok_attr = bool(attr) and all(p.isidentifier() for p in attr.split("."))
    ok_mod = is_file or all(p.isidentifier() for p in where.split("."))
    if not sep or not where or not ok_attr or not ok_mod:
        raise error(f"{spec!r}: not {forms}")
    return where, attr, is_file


def absolute_spec(spec: str, forms: str, error: type[Exception]) -> str:
    """The spec with a relative file path made absolute (against the current directory),
    so it means the same object in a process started elsewhere."""
    where, attr, is_file = split_spec(spec.strip(), forms, error)
    return f"{Path(where).expanduser().absolute()}:{attr}" if is_file else spec.strip()


def _import_file(spec: str, where: str, error: type[Exception]) -> ModuleType:
    path = Path(where).expanduser().absolute()
    if not path.is_file():
        raise error(f"{spec!r}: no such file {str(path)!r}")
    # Unique per file, so two files both called rewards.py do not replace each other.
    name = "_user_module_" + hashlib.sha1(str(path).encode()).hexdigest()[:16]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{spec!r}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise error(f"{spec!r}: importing {str(path)!r} failed: {_one_line(e)}") from None
    return module


def load_object(spec: str, forms: str, error: type[Exception]) -> object:
    """The object a user's ``pkg.module:attr`` or ``path/to/file.py:attr`` names; ``error``
    with one line naming the spec when there is none."""
    where, attr, is_file = split_spec(spec.strip(), forms, error)
    obj: object
    if is_file:
        obj = _import_file(spec, where, error)
    else:
        try:
            obj = importlib.import_module(where)
        except Exception as e:
            raise error(f"{spec!r}: importing {where!r} failed: {_one_line(e)}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise error(f"{spec!r}: {where!r} has no attribute {attr!r}") from None
    return obj
