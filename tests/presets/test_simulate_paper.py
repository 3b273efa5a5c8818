"""The simulator on the LlamaRL paper's three settings: the committed JSON is what it
predicts now, the speedup grows with scale, and the state of the 15% goal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl.compose import compose
from rl.config import CONF_DIR
from rl.config.errors import ConfigError
from rl.simulate import PAPER, simulate
from rl.simulate.hardware import SOURCES, assumptions
from rl.simulate.report import render, to_json
from tests.helpers.configs import config_of

ROOT = CONF_DIR.parent
RESULT = ROOT / "tools/bench/results/simulate_paper.json"
GOAL = 0.15
# Measured state of the goal with the one profile (see the JSON): 8B and 70B within 15%,
# 405B not (the model predicts ~6.7x where the paper has 10.7x).
WITHIN = {"llama3_8b_256gpu": True, "llama3_70b_512gpu": True, "llama3_405b_1024gpu": False}


@pytest.fixture(scope="module")
def sims() -> dict:
    return {n: simulate(config_of(f"experiment={n}")) for n in PAPER}


def test_committed_json_is_what_the_simulator_predicts_now(sims: dict) -> None:
    committed = json.loads(RESULT.read_text())
    for name, sim in sims.items():
        now = to_json(sim)
        got = committed["presets"][name]
        for mode in ("sync", "async"):
            for k, v in now[mode].items():
                want = v if isinstance(v, str) else pytest.approx(v, rel=1e-6)
                assert got[mode][k] == want, (name, mode, k)
        assert got["speedup"] == pytest.approx(now["speedup"], rel=1e-6), name
    want = assumptions(config_of("experiment=llama3_8b_256gpu"))
    assert committed["assumptions"] == json.loads(json.dumps(want))


def test_speedup_grows_with_scale_and_goal_state(sims: dict) -> None:
    s = [sims[n].speedup for n in PAPER]
    assert s[0] > 1 and s[0] < s[1] < s[2]
    for name, sim in sims.items():
        ps, pa = PAPER[name]
        err = sim.speedup / (ps / pa) - 1
        assert (abs(err) <= GOAL) == WITHIN[name], (name, sim.speedup, err)


def test_every_assumption_has_a_source() -> None:
    rows = assumptions(config_of("experiment=llama3_8b_256gpu"))
    assert {r["name"].removeprefix("cluster.hardware.") for r in rows[:-1]} == set(SOURCES)
    assert all(r["source"] for r in rows)


def test_the_profile_is_the_same_for_every_preset() -> None:
    hw = [config_of(f"experiment={n}").cluster.hardware for n in PAPER]
    assert hw[0] == hw[1] == hw[2]


def test_report_and_bad_input() -> None:
    cfg = config_of("experiment=llama3_405b_1024gpu")
    text = render(simulate(cfg))
    assert "speedup" in text and "paper" in text and "where the time goes" in text
    assert "KV cache holds 16.20M tokens" in text and "1 wave, 0.00 s of offload" in text
    with pytest.raises(ConfigError, match=r"cluster.gpus_per_node=0"):
        simulate(compose([]))
    bad = compose(["experiment=llama3_8b_256gpu", "cluster.hardware.decode_efficiency=1.5"])
    with pytest.raises(ConfigError, match=r"cluster.hardware.decode_efficiency=1.5: must be"):
        simulate(bad)


def test_cli_prints_one_line_on_bad_input(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "rl.simulate"]
    out = tmp_path / "s.json"
    ok = subprocess.run([*run, "experiment=llama3_8b_256gpu", "--json", str(out)],
                        cwd=ROOT, capture_output=True, text=True, check=False)  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert json.loads(out.read_text())["run"] == "llama3_8b_256gpu"
    bad = subprocess.run([*run, "experiment=llama3_8b_256gpu", "cluster.hardware.mfu=1"],
                         cwd=ROOT, capture_output=True, text=True, check=False)  # fmt: skip
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "cluster.hardware.mfu" in bad.stderr


def test_the_baselines_generation_memory_is_the_planners() -> None:
    """What the co-located trainer keeps while its GPUs generate is the planner's
    TrainerGPU at dp = replicas, less what the offload policy moves; Adam's trip to host
    memory and back is charged over PCIe."""
    from rl.plan.memory import GIB, kv_bytes_per_token, trainer_gpu
    from rl.simulate.colocated import shared_layout

    keep = config_of("experiment=llama3_405b_1024gpu")
    off = config_of("experiment=llama3_405b_1024gpu", "cluster.hardware.baseline_offload=optimizer")
    lay, lay_off = (shared_layout(c, 256, 1536, 1024) for c in (keep, off))
    assert lay.replicas == 1024 // (8 * 18) == 7
    stages = [trainer_gpu(keep, s, dp=7) for s in range(18)]
    want = max(g.weights + g.grads + g.optimizer + g.overhead for g in stages)
    assert lay.resident == want and lay.offloaded == 0 and lay.offload_s == 0
    kv = kv_bytes_per_token(keep.model, 8, 2) / 18
    assert lay.kv_tokens == pytest.approx((80 * GIB - want) / kv)
    adam = max(g.optimizer for g in stages)
    assert lay_off.resident == max(g.weights + g.grads + g.overhead for g in stages)
    assert lay_off.offload_s == pytest.approx(2 * adam / 64e9)
    assert lay_off.kv_tokens > lay.kv_tokens and lay.waves == lay_off.waves == 1


def test_a_short_kv_cache_runs_the_batch_in_waves() -> None:
    """8B: 8 samples per replica reserve 8 x (512 + 7168) tokens of 64 KiB each (TP2: 4
    KV heads of 32 layers); 1.5 GiB over what the trainer keeps holds 24,576 tokens, so
    three waves, each waiting for the longest of its third of the batch."""
    from rl.plan.memory import GIB
    from rl.simulate.colocated import shared_layout

    base = config_of("experiment=llama3_8b_256gpu")
    resident = shared_layout(base, 512, 7168, 1024).resident
    tight = config_of(
        "experiment=llama3_8b_256gpu", f"cluster.gpu_memory_gb={resident / GIB + 1.5!r}"
    )
    lay = shared_layout(tight, 512, 7168, 1024)
    assert lay.kv_tokens == pytest.approx(1.5 * GIB / 65536) and lay.waves == 3
    roomy, short = simulate(base), simulate(tight)
    assert short.shared.waves == 3 and roomy.shared.waves == 1
    assert short.sync.generate > 2 * roomy.sync.generate
    with pytest.raises(ConfigError, match=r"cluster.hardware.baseline_offload=all: must be one of"):
        simulate(compose(["experiment=llama3_8b_256gpu", "cluster.hardware.baseline_offload=all"]))
