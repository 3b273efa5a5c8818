"""Import only the SGLang model modules a server's checkpoint needs.

Why: SGLang's model registry imports every module of ``sglang.srt.models`` (255 in
0.5.23) when a server starts, to find the class its checkpoint's architecture names:
10 of a tiny CPU server's 19 s here, paid on every server start of a job or a test.

Replaces: nothing in SGLang's code. SGLang's own setting ``SGLANG_DISABLED_MODEL_ARCHS``
(a comma-separated list of module names the registry skips) is set, for a server whose
environment does not set it already, to every module whose source does not name one of
the checkpoint's ``architectures`` (``config.json``) as a class (``class <arch>(`` at the
top level: the registry keys a model by its class's name), read as text, not imported. A
kept module imports whatever it imports itself, and ``transformers`` (SGLang's fallback for
an architecture it has no class of) is always kept. Versions: sglang 0.5.23.
"""

from __future__ import annotations

import importlib.util
import json
import re
from functools import cache
from pathlib import Path

DISABLED_ENV = "SGLANG_DISABLED_MODEL_ARCHS"
ALWAYS = frozenset({"transformers"})


def architectures(model_path: str | Path) -> tuple[str, ...]:
    """The checkpoint's ``architectures`` (none if it has no readable config.json)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return ()
    return tuple(a for a in cfg.get("architectures") or () if isinstance(a, str))


@cache
def _sources() -> dict[str, str]:
    """Module name -> source text of SGLang's model modules (the package is not imported)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return {}
    models = Path(next(iter(spec.submodule_search_locations))) / "srt" / "models"
    return {p.stem: p.read_text(errors="replace") for p in sorted(models.glob("*.py"))}


@cache
def unused(archs: tuple[str, ...]) -> tuple[str, ...]:
    """SGLang's model modules that define none of ``archs`` (none if no module defines
    one: SGLang then looks for it as it always does)."""
    defines = re.compile("|".join(rf"^class {re.escape(a)}\(" for a in archs), re.M)
    keep = {name for name, text in _sources().items() if archs and defines.search(text)}
    if not keep:
        return ()
    return tuple(n for n in _sources() if n not in keep | ALWAYS and n != "__init__")


def skip_unused(env: dict[str, str], model_path: str | Path) -> None:
    """Set the registry's skip list in ``env`` for a server of ``model_path`` (unless set)."""
    if DISABLED_ENV not in env and (names := unused(architectures(model_path))):
        env[DISABLED_ENV] = ",".join(names)
