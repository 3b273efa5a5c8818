"""The README's main command, run as a user would: `python -m rl.train ...`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.procs import run_listening

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "rl.train", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_main_job_trains_at_tp2_and_writes_outputs(tmp_path):
    out = tmp_path / "run"
    res = _run(
        "experiment=tiny_sft",
        "sft.steps=30",
        "sft.log_every=10",
        "sft.eval_every=30",
        "task.eval_size=64",
        "trainer.save_interval=20",
        f"run.output_dir={out}",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("[warmup] step")]
    assert [ln.split()[2] for ln in lines] == ["10/30", "20/30", "30/30"], res.stdout
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in recs if r["phase"] == "warmup"]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses  # it learns
    assert [r["step"] for r in recs if r["phase"] == "warmup_eval"] == [0, 30]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "checkpoint" / "metadata.json").exists()
    assert "tp=2 pp=1 dp=1" in res.stdout


def test_bad_config_fails_in_one_line_before_any_rank_starts():
    t0 = time.monotonic()
    res = _run("trainer.tp=4")
    assert res.returncode != 0
    assert res.stderr.strip().splitlines()[-1] == (
        "config error: trainer.tp=4 does not divide model.num_attention_heads=6"
    )
    assert "starting" not in res.stdout  # no rank was spawned
    assert time.monotonic() - t0 < 60


def test_hydra_typo_fails_before_any_rank_starts():
    res = _run("trainer.tpp=2")
    assert res.returncode != 0
    assert "tpp" in res.stderr
    assert "starting" not in res.stdout


def test_torchrun_launch_runs_the_same_job_listening_on_loopback_only(tmp_path):
    """launch/local.sh: the rank count comes from the config, torchrun starts the ranks,
    and no process of the job listens beyond loopback. torchrun's own stores, the
    rendezvous store and the agent store the ranks share, listened on every interface
    before rl/runtime/torchrun.py bound them."""
    out = tmp_path / "run"
    cmd = [str(ROOT / "launch" / "local.sh"), "experiment=tiny_sft", "trainer.tp=1",
           "trainer.dp=2", "sft.steps=3", "task.eval_size=64", f"run.output_dir={out}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res, listening = run_listening(cmd, ROOT, env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "[warmup] step 3/3" in res.stdout
    assert "starting" not in res.stdout  # ranks came from torchrun, not our spawner
    assert (out / "checkpoint" / "metadata.json").exists()
    # torchrun's two stores (the agent names itself pt_elastic or stays python), beside
    # the ranks' gloo links
    stores = {port for _, port, name in listening if not name.startswith("msrl:")}
    assert len(stores) >= 2, listening
    assert {ip for ip, _, _ in listening} == {"127.0.0.1"}, listening


def test_world_size_helper_rejects_bad_config():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "rl.world_size"]
    ok = subprocess.run(
        [*cmd, "trainer.tp=2", "trainer.dp=2", "trainer.micro_batch_size=32"],
        env=env,
        capture_output=True,
    )
    assert ok.stdout.decode().strip() == "7"  # controller, 4 trainer, generator, reward
    bad = subprocess.run([*cmd, "trainer.pp=3"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2
    assert "trainer.pp=3 does not divide model.num_layers=4" in bad.stderr
