"""A checkpoint directory on disk: written beside, renamed into place, recovered after a kill.

Every checkpoint is written to ``<path>.tmp`` and renamed to ``<path>`` only once every
rank has written its shards (rl/weights/dist_ckpt.py). An RL checkpoint replaces the
previous one under the same name, so the previous one is first renamed to ``<path>.old``
and kept until the resume state (rl/checkpoints/resume.py) names the new one; the resume state
also writes the step it records into the checkpoint (:data:`MARKER`). A kill at any
moment then leaves, besides a usable ``<path>`` or ``<path>.old``, only files that
:func:`recover` can sort out without guessing:

=====================================  ==============================================
killed                                 on disk (state says step S)
=====================================  ==============================================
while writing ``.tmp``                 ``path`` (S), partial ``.tmp``: removed
after ``path`` -> ``.old``             ``.old`` (S): renamed back
after ``.tmp`` -> ``path``             ``path`` (new, unrecorded), ``.old`` (S): old back
after the state named the new one      ``path`` (S), stale ``.old``: removed
=====================================  ==============================================

Pure file logic: no torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

TMP, OLD = ".tmp", ".old"
MARKER = "rl_step.json"  # {"step": S}: the RL step the resume state recorded for it
COMPLETE = "metadata.json"  # written by Megatron's torch_dist save, last of its files


def tmp_of(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p.with_name(p.name + TMP)


def old_of(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p.with_name(p.name + OLD)


def complete(path: str | os.PathLike) -> bool:
    """A checkpoint directory that a save finished (its files renamed into place)."""
    return (Path(path) / COMPLETE).is_file()


def marked_step(path: str | os.PathLike) -> int | None:
    """The RL step the resume state recorded for this checkpoint, if any."""
    try:
        return int(json.loads((Path(path) / MARKER).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def mark(path: str | os.PathLike, step: int) -> None:
    """Record in the checkpoint the RL step it holds (before the resume state names it)."""
    if not Path(path).is_dir():  # nothing to mark: read() reports the missing checkpoint
        return
    dst = Path(path) / MARKER
    tmp = dst.with_name(MARKER + TMP)
    tmp.write_text(json.dumps({"step": step}) + "\n")
    os.replace(tmp, dst)


def drop_previous(path: str | os.PathLike) -> None:
    """Remove ``<path>.old``: the resume state now names ``path``."""
    shutil.rmtree(old_of(path), ignore_errors=True)


@contextlib.contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Every rank of a torchrun launch reads the resume state at once: one recovers."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def recover(path: str | os.PathLike, step: int) -> list[str]:
    """Make ``path`` the complete checkpoint of RL ``step`` after a kill mid-save; remove
    what a save left half-done. Returns what it did, for the log; raises FileNotFoundError
    when no complete checkpoint of ``step`` exists."""
    final = Path(path)
    old, tmp = old_of(final), tmp_of(final)
    done: list[str] = []
    if not final.parent.is_dir():
        raise FileNotFoundError(final)
    with _locked(final.parent):
        if tmp.exists():  # a save that never finished
            shutil.rmtree(tmp, ignore_errors=True)
            done.append(f"removed the unfinished {tmp.name}")
        mine = complete(final) and marked_step(final) in (step, None)
        if (
            old.exists()
            and complete(old)
            and marked_step(old) == step
            and not (complete(final) and marked_step(final) == step)
        ):
            # The state still names the previous checkpoint: a newer one that it never
            # recorded (or none, mid-rename) is dropped; the recorded one comes back.
            if final.exists():
                aside = final.with_name(final.name + ".discard")
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(final, aside)
                shutil.rmtree(aside, ignore_errors=True)
                done.append(f"dropped {final.name} (saved after step {step}, not recorded)")
            os.replace(old, final)
            done.append(f"restored step {step}'s checkpoint from {old.name}")
        elif old.exists() and mine:  # the state names ``path``: the previous one goes
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed the superseded {old.name}")
        if not complete(final):
            raise FileNotFoundError(final)
    return done
