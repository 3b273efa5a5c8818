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
    def __init__(self, out_dir: str | Path, enabled: bool = True, total_steps: int = 0):
        self.enabled = enabled
        self.total = total_steps
        self.out_dir = Path(out_dir)
        self._t0 = time.perf_counter()
        self._tb = None
        self._jsonl = None
        if enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(self.out_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float], phase: str, echo: bool = True) -> None:
        if not self.enabled:
            return
        assert self._jsonl is not None and self._tb is not None
        rec = {"phase": phase, "step": step, "time": round(time.perf_counter() - self._t0, 3)}
        rec.update({k: float(v) for k, v in metrics.items()})
        self._jsonl.write(json.dumps(rec) + "\n")
        for k, v in metrics.items():
            self._tb.add_scalar(f"{phase}/{k}", float(v), step)
        if echo:
            print(self.format_line(step, phase, metrics), flush=True)

    def format_line(self, step: int, phase: str, m: dict[str, float]) -> str:
        total = f"/{self.total}" if self.total else ""
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
