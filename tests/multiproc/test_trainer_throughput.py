"""tools/bench/trainer_throughput.py end to end on the host at its smoke shape (hidden 64,
2 layers, 64 tokens), in seconds: every CPU configuration is built the way it says (core
attention, norm dtype), trains, and the JSON holds the default's figures and the table,
MFU included when a peak is given. The figures themselves come from a GPU run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "tools" / "bench" / "trainer_throughput.py"


def test_the_benchmark_runs_on_cpu_at_its_smoke_shape(tmp_path):
    out = tmp_path / "tt.json"
    cmd = [sys.executable, str(BENCH), "--device", "cpu", "--smoke", "--peak-tflops", "1",
           "--out", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    rows = {c["name"]: c for c in r["configs"]}
    assert list(rows) == ["default", "packed_long", "recompute_full", "bf16_norms", "baseline"]
    assert all("error" not in c for c in rows.values()), rows
    built = {n: (c["core_attention"], c["norm_dtype"]) for n, c in rows.items()}
    assert built == {
        "baseline": ("DotProductAttention", "float32"),
        "bf16_norms": ("DotProductAttention", "bfloat16"),
        "default": ("SDPAttention", "bfloat16"),
        "recompute_full": ("SDPAttention", "bfloat16"),
        "packed_long": ("SDPAttention", "bfloat16"),
    }
    # One packed row of 8 x the context: its attention FLOPs count that context.
    long, d = rows["packed_long"], rows["default"]
    assert long["long"] == 8 and long["flops_per_token"] > d["flops_per_token"]
    d = rows["default"]
    assert r["tokens_per_s"] == d["tokens_per_s"] > 0 and r["mfu"] == d["mfu"] > 0
    assert r["peak_gb"] is None  # no device memory on the host
    # MFU: model FLOPs (6 x matmul params + 6 x layers x hidden x context) at 1 TFLOP/s
    assert abs(d["mfu"] - d["tokens_per_s"] * d["flops_per_token"] / 1e12) < 1e-4
    assert rows["baseline"]["vs_baseline"] == 1.0 and "tokens/s against the baseline" in res.stdout
