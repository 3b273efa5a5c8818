"""The planner as a user runs it: ``python -m rl.plan`` in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig

from rl.compose import compose

ROOT = Path(__file__).resolve().parents[2]


def _cfg(*overrides: str) -> DictConfig:
    return compose(list(overrides))


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )


def test_cli_prints_the_placement() -> None:
    cfg = _cfg("experiment=llama3_8b_256gpu")
    t, r, c = cfg.trainer, cfg.rollout, cfg.cluster
    out = _run("-m", "rl.plan", "experiment=llama3_8b_256gpu")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    gen_gpus = c.generation_nodes * c.gpus_per_node
    for fragment in (
        f"trainer    nodes 0-{c.train_nodes - 1} ({t.tp * t.pp * t.dp} GPUs)",
        f"Megatron TP{t.tp} x PP{t.pp} x DP{t.dp}",
        f"generator  nodes {c.train_nodes}-{c.nodes - 1} ({gen_gpus} GPUs)",
        f"{r.servers} SGLang server(s) x TP{r.tp}",
        "controller rank 0 on node 0",
        "DDMA per step",
        "memory per trainer GPU",
        "memory per generator GPU",
        "fits: yes",
    ):
        assert fragment in text, f"{fragment!r} not in:\n{text}"


def test_planner_imports_no_torch() -> None:
    """Pure logic, so it runs on a laptop in well under a second."""
    code = (
        "import sys; from rl.compose import compose; from rl.plan import plan_cluster; "
        "plan_cluster(compose(['experiment=llama3_405b_1024gpu'])); "
        "print(sorted(m for m in ('torch', 'megatron', 'sglang') if m in sys.modules))"
    )
    out = _run("-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_an_unknown_option_is_one_line(capsys) -> None:
    from rl.plan.__main__ import main

    assert main(["--bogus", "experiment=llama3_8b_256gpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("unknown option --bogus (options: --json") and "\n" not in err, err
