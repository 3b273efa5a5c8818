"""Metrics for people and tools: a progress line per step, JSONL, TensorBoard, PNG plots.

Only one rank (the controller's rank 0) writes; other ranks get a disabled logger so the
training code can call it unconditionally.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    def __init__(
        self, out_dir: str | Path, enabled: bool = True, totals: dict[str, int] | None = None
    ):
        """``totals``: steps of each stage by phase prefix (``{"warmup": 200}`` shows
        "step 20/200" for the phases warmup and warmup_eval)."""
        self.enabled = enabled
        self.totals = totals or {}
        self.out_dir = Path(out_dir)
        self._t0 = time.perf_counter()
        self._tb = None
        self._jsonl = None
        if enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.out_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))

    def log(
        self,
        step: int,
        metrics: dict[str, float],
        phase: str,
        echo: bool = True,
        show: tuple[str, ...] | None = None,
    ) -> None:
        """Write every metric to JSONL and TensorBoard; print a line of the ``show`` ones
        (all of them by default) when ``echo``."""
        if not self.enabled:
            return
        assert self._jsonl is not None and self._tb is not None
        rec = {"phase": phase, "step": step, "time": round(time.perf_counter() - self._t0, 3)}
        rec.update({k: float(v) for k, v in metrics.items()})
        self._jsonl.write(json.dumps(rec) + "\n")
        for k, v in metrics.items():
            self._tb.add_scalar(f"{phase}/{k}", float(v), step)
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


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(jsonl: str | Path, png: str | Path, keys: tuple[str, ...]) -> Path:
    """One panel per key, x = step, a line per phase; saved as a PNG a person can open."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_jsonl(jsonl)
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

    recs = read_jsonl(jsonl)
    rl = [r for r in recs if r["phase"] == "rl"]
    ev = [r for r in recs if r["phase"] == "rl_eval"]
    fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(7.5, 9), sharex=True)
    if ev:
        a1.plot([r["step"] for r in ev], [r["eval_accuracy"] for r in ev], "o-", label="pass@1")
        for key in sorted({k for r in ev for k in r if k.startswith("eval_pass@")}):
            pts = [(r["step"], r[key]) for r in ev if key in r]
            a1.plot(*zip(*pts, strict=True), "s--", label=key.removeprefix("eval_"))
        a1.axhline(ev[0]["eval_accuracy"], ls="--", c="gray", label="start (pass@1)")
    a1.set_ylabel("held-out accuracy")
    a1.set_ylim(0, 1)
    a1.legend(loc="lower right")
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
