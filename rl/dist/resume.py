"""Where a restarted job picks up: its last RL checkpoint and the step that checkpoint holds.

Why: SLURM requeues a preempted or failed job under the same job id, and the sbatch script
derives the output directory from that id, so the new attempt sees the old one's files.
After every checkpoint the controller records ``rl_state.json`` next to it (written to a
temporary name and renamed, so a kill leaves either the old state or the new one, never
half of one). On start, the trainer loads that checkpoint with its optimizer and LR
schedule instead of warming up again, and the controller continues with the next step;
metrics the lost attempt logged after the checkpoint are dropped so every step appears
once. Pure logic: files only, no torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

STATE = "rl_state.json"
RL_PHASES = ("rl", "rl_eval")


@dataclass(frozen=True)
class ResumePoint:
    step: int  # RL steps the checkpoint has trained
    checkpoint: str
    start_accuracy: float  # held-out accuracy of the warm-up checkpoint (the baseline)
    warmup_accuracy: float | None


class ResumeError(ValueError):
    """A resume state that cannot be used (corrupt, or its checkpoint is gone)."""


def read(out_dir: str | os.PathLike) -> ResumePoint | None:
    """The point to resume from, or None for a fresh run."""
    path = Path(out_dir) / STATE
    if not path.exists():
        return None
    try:
        point = ResumePoint(**json.loads(path.read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise ResumeError(f"{path}: unreadable resume state ({e}); delete it to start over") from e
    if not Path(point.checkpoint).is_dir():
        raise ResumeError(
            f"{path}: step {point.step}'s checkpoint {point.checkpoint!r} is missing; "
            "delete the state file to start over"
        )
    return point


def write(out_dir: str | os.PathLike, point: ResumePoint) -> None:
    """Record ``point`` atomically (after its checkpoint is complete on disk)."""
    path = Path(out_dir) / STATE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(point), indent=1) + "\n")
    os.replace(tmp, path)


def truncate_metrics(metrics: str | os.PathLike, step: int) -> int:
    """Drop the RL records after ``step`` (logged by an attempt that died before its next
    checkpoint); return how many were dropped."""
    path = Path(metrics)
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by the kill
            dropped += 1
            continue
        if rec.get("phase") in RL_PHASES and rec.get("step", 0) > step:
            dropped += 1
        else:
            keep.append(line)
    if dropped:
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        os.replace(tmp, path)
    return dropped
