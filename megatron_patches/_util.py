"""Shared bookkeeping for the patches: each patch records what it replaced, once."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_APPLIED: set[str] = set()


def once(name: str, fn: Callable[[], None]) -> bool:
    """Run ``fn`` the first time ``name`` is applied in this process; return whether it ran.

    Why: every ``apply()`` must be idempotent, because spawned processes, tests and the
    launcher may all call ``apply_all`` and a double wrap would nest the replacements.
    """
    if name in _APPLIED:
        return False
    fn()
    _APPLIED.add(name)
    return True


def applied() -> frozenset[str]:
    return frozenset(_APPLIED)


def replace_attr(owner: Any, attr: str, new: Any) -> Any:
    """Replace ``owner.attr`` with ``new`` and keep the original on ``new._msrl_original``."""
    old = getattr(owner, attr)
    try:
        new._msrl_original = old
    except (AttributeError, TypeError):
        pass
    setattr(owner, attr, new)
    return old
