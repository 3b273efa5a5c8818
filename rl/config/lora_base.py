"""Where a LoRA checkpoint's frozen base lives, and proof that it is the same base.

A LoRA checkpoint (rl/engine/checkpoint.py) saves the adapters and their optimizer state
only: the base weights never change while the adapters train, so writing them into every
checkpoint would copy the whole model each time (16 GB at 8B in bf16, for ~100 MB of
adapters). Instead its common state names the base checkpoint it was trained on:

    lora.base = {"path": absolute path, "relpath": from the LoRA checkpoint's parent,
                 "digest": xxh3-128 of the base's files, names and bytes}

and loading finds the base (``relpath`` first, so a run directory moved with its
conversion cache still resolves, then ``path``) and refuses it unless its content hashes
to ``digest``: a base overwritten or replaced since would give adapters trained on
other weights. The hash reads every byte of the base once per process (cached by the
files' sizes and modification times); the checkpoint code asks for it on one rank only.

Without torch: the launcher resolves a LoRA checkpoint's base before any rank starts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

_CACHE: dict[tuple[str, tuple[tuple[str, int, int], ...]], str] = {}


class BaseError(ValueError):
    """A LoRA checkpoint whose base is missing or is no longer the base it was trained on."""


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def digest(path: str | os.PathLike) -> str:
    """xxh3-128 over a checkpoint directory's files: each one's relative name and bytes."""
    import xxhash

    root = Path(path).resolve()
    files = _files(root)
    stats = tuple((str(f.relative_to(root)), *_stat(f)) for f in files)
    key = (str(root), stats)
    if key not in _CACHE:
        h = xxhash.xxh3_128()
        for f in files:
            h.update(str(f.relative_to(root)).encode() + b"\0")
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 24):
                    h.update(chunk)
        _CACHE[key] = h.hexdigest()
    return _CACHE[key]


def _stat(f: Path) -> tuple[int, int]:
    st = f.stat()
    return st.st_size, st.st_mtime_ns


def reference(base: str | os.PathLike, checkpoint: str | os.PathLike) -> dict[str, Any]:
    """The ``lora.base`` entry of a LoRA checkpoint to be saved at ``checkpoint``."""
    b = Path(base).resolve()
    parent = Path(checkpoint).resolve().parent
    return {"path": str(b), "relpath": os.path.relpath(b, parent), "digest": digest(b)}


def resolve(ref: dict[str, Any], checkpoint: str | os.PathLike) -> str:
    """The base directory that ``ref`` (read from ``checkpoint``) names, checked by content."""
    parent = Path(checkpoint).resolve().parent
    tried = [parent / ref["relpath"], Path(ref["path"])]
    found = next((p.resolve() for p in tried if p.is_dir()), None)
    where = f"checkpoint {str(checkpoint)!r} holds LoRA adapters only; its base"
    if found is None:
        raise BaseError(
            f"{where} {ref['path']!r} is missing (digest {ref['digest']}): restore it there "
            "or next to the checkpoint as it was"
        )
    got = digest(found)
    if got != ref["digest"]:
        raise BaseError(
            f"{where} {str(found)!r} has changed since (digest {got}, saved {ref['digest']}): "
            "the adapters were trained on other weights"
        )
    return str(found)
