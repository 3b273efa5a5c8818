"""Reading ``config.json`` fields with one-line errors: shared by every family module.

Pure logic. Each reader either returns the value or raises :class:`HFConfigError` naming
the field and the bad value, so a checkpoint the Megatron model cannot reproduce is refused
before any weight is read.
"""

from __future__ import annotations

from typing import NoReturn, TypeGuard


class HFConfigError(ValueError):
    """A config.json value the Megatron model cannot reproduce; names the field and value."""


def fail(msg: str) -> NoReturn:
    raise HFConfigError(f"config.json: {msg}")


def _is_number(v: object) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool)


def required(hf: dict, key: str) -> object:
    if hf.get(key) is None:
        fail(f"required key {key!r} is missing")
    return hf[key]


def positive_int(key: str, v: object) -> int:
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        fail(f"{key}={v!r} must be an integer >= 1")
    return v


def positive_float(key: str, v: object) -> float:
    if not (_is_number(v) and v > 0):
        fail(f"{key}={v!r} must be a number > 0")
    return float(v)


def non_negative_float(key: str, v: object) -> float:
    if not (_is_number(v) and v >= 0):
        fail(f"{key}={v!r} must be a number >= 0")
    return float(v)


def flag(hf: dict, key: str, default: bool = False) -> bool:
    """An optional boolean key; absent or null means ``default``."""
    v = hf.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        fail(f"{key}={v!r} must be true or false")
    return v


def refuse_flag(hf: dict, key: str, why: str = "") -> None:
    """A boolean feature the Megatron model does not have: refused when true."""
    if flag(hf, key):
        fail(f"{key}=True is not supported{' (' + why + ')' if why else ''}; need false")
