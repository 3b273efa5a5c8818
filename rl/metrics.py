"""Metrics for people and tools: a progress line per step, JSONL, TensorBoard, PNG plots.

Only one rank (the controller's rank 0) writes; other ranks get a disabled logger so the
training code can call it unconditionally.

A resumed run (rl/checkpoints/resume.py) logs again the steps after its checkpoint, which the
lost attempt had logged already; the logger drops those records of the resumed phases
from both the JSONL and the TensorBoard files before it writes, so each step appears once.
SummaryWriter's ``purge_step`` cannot do it here: it hides *every* tag at or after the
step, and the warm-up's steps (up to ``sft.steps``) share the run and the step axis.

With ``logging.wandb=true`` the same records also go to a Weights & Biases run (offline by
default: under ``<run.output_dir>/wandb``, for ``wandb sync``), which a resumed run
continues; wandb cannot drop what it logged, so there the repeated steps show twice.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import time
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from wandb.sdk.wandb_run import Run

    from rl.config.schema import RootConfig

JSONL, TENSORBOARD = "metrics.jsonl", "tensorboard"
# wandb's directory and the id of the run dir's wandb run, both in the run dir.
WANDB, WANDB_ID = "wandb", "wandb_run_id"
RESUMED_PHASES = ("rl", "rl_eval")  # what a resumed run logs again
WARMUP_PHASES = ("warmup", "warmup_eval")  # and a run that starts over, besides


@dataclass(frozen=True)
class WandbRun:
    """The wandb run a :class:`MetricsLogger` logs to beside TensorBoard (the config's
    ``logging`` section): plain values, so the logger needs no config."""

    project: str
    name: str  # the run's display name (run.name)
    mode: str = "offline"  # offline | online | disabled (wandb.init's mode)
    entity: str | None = None
    _: KW_ONLY
    config: dict[str, Any] = field(default_factory=dict)  # shown as the run's config

    @classmethod
    def from_config(cls, cfg: RootConfig) -> WandbRun | None:
        """The run ``cfg`` asks for; None when ``logging.wandb`` is off."""
        lg = cfg.logging
        if not lg.wandb:
            return None
        from omegaconf import DictConfig, OmegaConf

        # The resolved config (interpolations filled in), as the launch printed it.
        plain = OmegaConf.to_container(cast(DictConfig, cfg), resolve=True, enum_to_str=True)
        config = cast(dict[str, Any], plain)
        # str(): WandbMode's value (a StrEnum), or the str itself
        return cls(lg.wandb_project, cfg.run.name, str(lg.wandb_mode), lg.wandb_entity,
                   config=config)  # fmt: skip


def wandb_run_id(out_dir: str | Path) -> str:
    """The run dir's wandb run id, made by its first run and kept in ``<out>/wandb_run_id``:
    every later attempt in the dir (a requeued job resumes there) logs to the same run."""
    path = Path(out_dir) / WANDB_ID
    if path.exists():
        return path.read_text().strip()
    run_id = secrets.token_hex(8)  # wandb ids: letters, digits, - and _; at most 64
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)  # whole or absent: a kill cannot leave an empty id
    return run_id


def open_wandb(out_dir: Path, run: WandbRun) -> Run:
    """Start ``run`` (``wandb.init``) with every file it writes under ``out_dir``."""
    # wandb's run files go to <out>/wandb (dir=); wandb-core's logs (~/.cache/wandb by
    # default) and its upload staging (~/.local/share/wandb) beside them. A value the user
    # set wins. wandb-core starts once per process, with the environment of that moment.
    os.environ.setdefault("WANDB_CACHE_DIR", str(out_dir / WANDB / "cache"))
    os.environ.setdefault("WANDB_DATA_DIR", str(out_dir / WANDB / "data"))
    import wandb  # only when asked for: its import takes seconds

    # Online, resume="allow" continues the run of this id (or starts it). Offline wandb
    # ignores resume (and warns), so it is not passed: each attempt writes an
    # offline-run-*-<id> directory, and `wandb sync` uploads those of one id in the order
    # they started, into one run. wandb cannot delete the steps the lost attempt logged
    # after its checkpoint (rewind, resume_from, is a server-side preview that only takes
    # wandb's own _step, which the step axis here is not), so those steps show twice.
    wb = wandb.init(
        project=run.project,
        entity=run.entity,
        name=run.name,
        id=wandb_run_id(out_dir),
        resume="allow" if run.mode == "online" else None,
        mode=cast(Any, run.mode),
        dir=str(out_dir),
        config=run.config,
    )
    # TensorBoard's step axis: wandb's own (_step) must only grow, but every phase counts
    # its steps from 1 (RL's restart after the warm-up's), so charts use "step" instead.
    wb.define_metric("step")
    return wb


class MetricsLogger:
    def __init__(
        self,
        out_dir: str | Path,
        enabled: bool = True,
        totals: dict[str, int] | None = None,
        resume_step: int | None = None,
        *,
        wandb_run: WandbRun | None = None,
        redo_phases: tuple[str, ...] = RESUMED_PHASES,
    ):
        """``totals``: steps of each stage by phase prefix (``{"warmup": 200}`` shows
        "step 20/200" for the phases warmup and warmup_eval). ``resume_step``: the run
        resumes after this step of ``redo_phases`` (RL's by default); their records of
        later steps already on disk go (-1: every record of them, for a job that starts
        over). ``wandb_run``: also log to this wandb run (see :func:`open_wandb`)."""
        self.enabled = enabled
        self.totals = totals or {}
        self.out_dir = Path(out_dir)
        self._t0 = time.perf_counter()
        self._tb = None
        self._jsonl = None
        self._wandb: Run | None = None
        self._wandb_phases: set[str] = set()  # the phases given their step axis
        if enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if resume_step is not None:
                drop_jsonl_after(self.out_dir / JSONL, resume_step, redo_phases)
                drop_tensorboard_after(self.out_dir / TENSORBOARD, resume_step, redo_phases)
            if wandb_run is not None:  # first: a wandb that cannot start opens nothing
                self._wandb = open_wandb(self.out_dir, wandb_run)
            self._jsonl = open(self.out_dir / JSONL, "a", buffering=1)  # noqa: SIM115
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.out_dir / TENSORBOARD))

    def log(
        self,
        step: int,
        metrics: dict[str, float],
        phase: str,
        echo: bool = True,
        show: tuple[str, ...] | None = None,
    ) -> None:
        """Write every metric to JSONL, TensorBoard (tag ``<phase>/<name>``) and wandb (the
        same keys, with ``step``); print a line of the ``show`` ones (all of them by
        default) when ``echo``."""
        if not self.enabled:
            return
        assert self._jsonl is not None and self._tb is not None
        rec = {"phase": phase, "step": step, "time": round(time.perf_counter() - self._t0, 3)}
        rec.update({k: float(v) for k, v in metrics.items()})
        self._jsonl.write(json.dumps(rec) + "\n")
        for k, v in metrics.items():
            self._tb.add_scalar(f"{phase}/{k}", float(v), step)
        # On disk now, like the JSONL line: a job stopped or killed (its ranks end at once)
        # lost up to the writer's 120 s of buffered events.
        self._tb.flush()
        if self._wandb is not None:
            if phase not in self._wandb_phases:
                self._wandb.define_metric(f"{phase}/*", step_metric="step")
                self._wandb_phases.add(phase)
            row = {f"{phase}/{k}": float(v) for k, v in metrics.items()}
            self._wandb.log({"step": step, **row})
        if echo:
            line = metrics if show is None else {k: metrics[k] for k in show if k in metrics}
            print(self.format_line(step, phase, line), flush=True)

    def format_line(self, step: int, phase: str, m: dict[str, float]) -> str:
        n = next((v for k, v in self.totals.items() if phase.startswith(k)), 0)
        total = f"/{n}" if n else ""
        parts = [f"[{phase}] step {step}{total}"]
        for k, v in m.items():
            if isinstance(v, float) and not math.isfinite(v):
                parts.append(f"{k} {v}")
            elif k in ("lr",):
                parts.append(f"{k} {v:.2e}")
            elif k.endswith("per_s"):
                parts.append(f"{k} {v:,.0f}")
            else:
                parts.append(f"{k} {v:.4g}")
        return " | ".join(parts)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            # finish() returns before wandb-core has written (offline) or sent (online) the
            # last records, and a rank leaves with os._exit (rl/runtime/launch.py), which
            # skips wandb's atexit teardown: wait here for wandb-core to end.
            wandb.teardown()
            self._wandb = None


def drop_jsonl_after(path: str | Path, step: int, phases: tuple[str, ...] = RESUMED_PHASES) -> int:
    """Drop the records of ``phases`` after ``step`` and any line a kill cut short;
    return how many went. Rewritten beside and renamed, so a kill keeps one whole file."""
    path = Path(path)
    if not path.exists():
        return 0
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if rec.get("phase") in phases and rec.get("step", 0) > step:
            dropped += 1
        else:
            keep.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(x + "\n" for x in keep))
        os.replace(tmp, path)
    return dropped


def drop_tensorboard_after(
    log_dir: str | Path, step: int, phases: tuple[str, ...] = RESUMED_PHASES
) -> int:
    """Rewrite the event files of ``log_dir`` without the scalars of ``phases`` (tags
    ``<phase>/<name>``) after ``step``; return how many values went. The new file is
    moved in before the old ones go: a kill in between leaves duplicates, never a loss."""
    log_dir = Path(log_dir)
    files = sorted(log_dir.glob("events.out.tfevents.*"))
    if not files:
        return 0
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    events, dropped = [], 0
    for f in files:
        for ev in EventFileLoader(str(f)).Load():
            if ev.HasField("file_version"):  # each file's header: the new file has its own
                continue
            if ev.HasField("summary") and ev.step > step:
                values = list(ev.summary.value)
                kept = [v for v in values if v.tag.split("/", 1)[0] not in phases]
                if len(kept) < len(values):
                    dropped += len(values) - len(kept)
                    if not kept:
                        continue
                    del ev.summary.value[:]
                    ev.summary.value.extend(kept)
            events.append(ev)
    if not dropped:
        return 0
    tmp = log_dir.with_name(log_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    writer = EventFileWriter(str(tmp))
    for ev in events:
        writer.add_event(ev)
    writer.close()
    for new in tmp.glob("events.out.tfevents.*"):
        os.replace(new, log_dir / new.name)
    for f in files:
        f.unlink()
    shutil.rmtree(tmp, ignore_errors=True)
    return dropped


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def last_attempts(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (phase, step)'s last record, in the order of those: what a run dir written
    before its jobs dropped a lost attempt's records (a restart from nothing) says."""
    last: dict[tuple[Any, Any], dict[str, Any]] = {}
    for r in records:
        key = (r.get("phase"), r.get("step"))
        last.pop(key, None)  # a later attempt's record goes where that attempt wrote it
        last[key] = r
    return list(last.values())


def plot_curves(jsonl: str | Path, png: str | Path, keys: tuple[str, ...]) -> Path:
    """One panel per key, x = step, a line per phase; saved as a PNG a person can open."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = last_attempts(read_jsonl(jsonl))
    fig, axes = plt.subplots(len(keys), 1, figsize=(7, 2.6 * len(keys)), squeeze=False)
    for ax, key in zip(axes[:, 0], keys, strict=True):
        for phase in sorted({r["phase"] for r in recs}):
            pts = [(r["step"], r[key]) for r in recs if r["phase"] == phase and key in r]
            if pts:
                xs, ys = zip(*pts, strict=True)
                ax.plot(xs, ys, marker="o" if len(pts) < 30 else None, label=phase)
        ax.set_ylabel(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)


def plot_rl(jsonl: str | Path, png: str | Path) -> Path:
    """The RL run at a glance: held-out accuracy against the warm-up's, the batch reward,
    and where each step's time went."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = last_attempts(read_jsonl(jsonl))
    rl = [r for r in recs if r["phase"] == "rl"]
    ev = [r for r in recs if r["phase"] == "rl_eval"]
    fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(7.5, 9), sharex=True)
    if ev:
        a1.plot([r["step"] for r in ev], [r["eval_accuracy"] for r in ev], "o-", label="pass@1")
        # pass@k (any of k samples right) and mean@k (the share of them right)
        for prefix, style in (("eval_pass@", "s--"), ("eval_mean@", "^:")):
            for key in sorted({k for r in ev for k in r if k.startswith(prefix)}):
                pts = [(r["step"], r[key]) for r in ev if key in r]
                a1.plot(*zip(*pts, strict=True), style, label=key.removeprefix("eval_"))
        a1.axhline(ev[0]["eval_accuracy"], ls="--", c="gray", label="start (pass@1)")
    a1.set_ylabel("held-out accuracy")
    a1.set_ylim(0, 1)
    a1.legend(loc="upper left", ncol=2)
    steps = [r["step"] for r in rl]
    reward = [r["reward_mean"] for r in rl]
    a2.plot(steps, reward, alpha=0.35, label="batch")
    k = max(1, len(reward) // 20)
    smooth = [
        sum(reward[max(0, i - k + 1) : i + 1]) / len(reward[max(0, i - k + 1) : i + 1])
        for i in range(len(reward))
    ]
    a2.plot(steps, smooth, label=f"mean of {k}")
    a2.set_ylabel("reward (train batches)")
    a2.legend(loc="lower right")
    parts = [("train_s", "train"), ("sync_s", "weight sync"), ("wait_batch_s", "wait for batch")]
    bottom = [0.0] * len(rl)
    for key, label in parts:
        vals = [r.get(key, 0.0) for r in rl]
        a3.bar(steps, vals, bottom=bottom, width=1.0, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    a3.set_ylabel("seconds per step")
    a3.set_xlabel("RL step")
    a3.legend(loc="upper right")
    for ax in (a1, a2, a3):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return Path(png)
