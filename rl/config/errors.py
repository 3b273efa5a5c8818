"""The one error every config check raises, and the helpers the checks share."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and the value."""


def require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def at_least(section: str, obj: object, low: int, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        require(isinstance(v, int) and v >= low, f"{section}.{n}={v!r} must be an integer >= {low}")


def positive(section: str, obj: object, *names: str) -> None:
    at_least(section, obj, 1, *names)
