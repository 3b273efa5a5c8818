"""The simulator on the LlamaRL paper's three settings: the committed JSON is what it
predicts now, the speedup grows with scale, and the state of the 15% goal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl.config import CONF_DIR, compose
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
