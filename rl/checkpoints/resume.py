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
from dataclasses import KW_ONLY, asdict, dataclass
from pathlib import Path

from rl.checkpoints import files as ckpt_files

STATE = "rl_state.json"


@dataclass(frozen=True)
class ResumePoint:
    step: int  # RL steps the checkpoint has trained
    checkpoint: str
    start_accuracy: float  # held-out accuracy of the warm-up checkpoint (the baseline)
    warmup_accuracy: float | None
    _: KW_ONLY
    # The controller's rollout state saved with the checkpoint (rl/controller/rollout_state.py),
    # relative to the run dir; None in states written before it was saved.
    rollouts: str | None = None
    # Other executors' checkpoints of the same step (a critic's), kept, recovered and
    # replaced exactly as ``checkpoint`` is.
    companions: tuple[str, ...] = ()

    @property
    def checkpoints(self) -> tuple[str, ...]:
        return (self.checkpoint, *self.companions)


class ResumeError(ValueError):
    """A resume state that cannot be used (corrupt, or its checkpoint is gone)."""


MODES = ("auto", "never")


def read(out_dir: str | os.PathLike, mode: str = "auto") -> ResumePoint | None:
    """The point to resume from, or None for a fresh run. ``mode`` is ``rl.resume``:
    ``never`` refuses a run dir that holds a resume point rather than overwrite its
    checkpoints and records with a fresh run's."""
    if mode not in MODES:
        raise ResumeError(f"rl.resume={mode!r} must be one of {', '.join(MODES)}")
    path = Path(out_dir) / STATE
    if not path.exists():
        return None
    if mode == "never":
        raise ResumeError(
            f"rl.resume=never but {path} holds a resume point: give a new run.output_dir, "
            "or rl.resume=auto to continue that run"
        )
    try:
        fields = json.loads(path.read_text())
        fields["companions"] = tuple(fields.get("companions", ()))
        point = ResumePoint(**fields)
    except (json.JSONDecodeError, TypeError) as e:
        raise ResumeError(f"{path}: unreadable resume state ({e}); delete it to start over") from e
    for ckpt in point.checkpoints:
        try:  # a kill mid-save leaves the recorded checkpoint under .old, or a .tmp behind
            for what in ckpt_files.recover(ckpt, point.step):
                print(f"resume: {what}", flush=True)
        except FileNotFoundError:
            raise ResumeError(
                f"{path}: step {point.step}'s checkpoint {ckpt!r} is missing or "
                "incomplete; delete the state file to start over"
            ) from None
    if point.rollouts is not None and not (Path(out_dir) / point.rollouts).is_file():
        raise ResumeError(
            f"{path}: step {point.step}'s rollout state {point.rollouts!r} is missing; "
            "delete the state file to start over"
        )
    return point


def check(out_dir: str | os.PathLike, point: ResumePoint) -> None:
    """The checkpoints ``point`` names pass the checks ``trainer.load_dir`` gets before
    launch (their index read without running its code, their shards' sizes): a resume
    from a damaged or planted one is refused here, in one line, before any rank starts."""
    from rl.config import ckpt_check

    for ckpt in point.checkpoints:
        if (why := ckpt_check.problem(Path(ckpt))) is not None:
            raise ResumeError(
                f"{Path(out_dir) / STATE}: step {point.step}'s checkpoint {ckpt!r} {why}; a "
                "restart refuses it the same way: restore it, or delete the state file to "
                "start over"
            )


def write(out_dir: str | os.PathLike, point: ResumePoint) -> None:
    """Record ``point`` atomically (after its checkpoint is complete on disk); then the
    checkpoint it replaces (``<checkpoint>.old``) goes."""
    for ckpt in point.checkpoints:  # first: read() tells the two apart
        ckpt_files.mark(ckpt, point.step)
    path = Path(out_dir) / STATE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(point), indent=1) + "\n")
    os.replace(tmp, path)
    for ckpt in point.checkpoints:
        ckpt_files.drop_previous(ckpt)


def describe(out_dir: str | os.PathLike) -> str:
    """What a stopped run leaves to resume from, in words (never raises)."""
    out = Path(out_dir)
    try:
        point = json.loads((out / STATE).read_text())
        step, ckpt = int(point["step"]), str(point["checkpoint"])
    except (OSError, ValueError, KeyError, TypeError):
        step, ckpt = -1, ""
    if step >= 0:
        try:  # a save cut short by the stop is sorted out now, not at the next start
            ckpt_files.recover(ckpt, step)
            return f"saved: RL step {step} in {ckpt} (a restart resumes there)"
        except OSError:
            pass
    for name in ("warmup", "checkpoint"):
        if ckpt_files.complete(out / name):
            return f"saved: the warm-up checkpoint {out / name} (no RL step yet)"
    return f"saved: no checkpoint yet in {out}"
