"""The architecture registry: every family module under ``rl/models/families/``.

A family is one module that defines ``ARCH`` (an :class:`rl.models.arch.Arch`); the registry
finds them by listing the package, so adding a family adds one module and nothing else here.
Lookups fail in one line naming the unknown value and the supported ones.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from rl.models import families
from rl.models.arch import Arch


class UnknownArchitecture(ValueError):
    """An architecture or model_type no family module declares."""


@cache
def architectures() -> dict[str, Arch]:
    """HF class name -> Arch, for every module in ``rl/models/families``."""
    out: dict[str, Arch] = {}
    for info in sorted(pkgutil.iter_modules(families.__path__), key=lambda i: i.name):
        arch = importlib.import_module(f"{families.__name__}.{info.name}").ARCH
        if arch.hf_class in out:
            raise RuntimeError(f"{arch.hf_class} is declared twice (second: {info.name})")
        out[arch.hf_class] = arch
    return out


def supported() -> str:
    return ", ".join(sorted(architectures()))


def get(hf_class: str, field: str = "model.architecture") -> Arch:
    arch = architectures().get(hf_class)
    if arch is None:
        raise UnknownArchitecture(
            f"{field}={hf_class!r} is not supported (supported: {supported()})"
        )
    return arch


def by_model_type(model_type: str, field: str = "model_type") -> Arch:
    for arch in architectures().values():
        if arch.model_type == model_type:
            return arch
    types = ", ".join(sorted(a.model_type for a in architectures().values()))
    raise UnknownArchitecture(f"{field}={model_type!r} is not supported (supported: {types})")
