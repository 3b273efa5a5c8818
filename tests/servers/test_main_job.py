"""The main job, run as a user would: the tiny RL job, launched once under torchrun
(`launch/local.sh`, the path SLURM jobs take) and read by three tests: the warm-up, the
async RL stream, and what it listens on. The same job through `python -m rl.train`'s own
spawner: tests/servers/test_rl_job.py's sync, MoE and LoRA jobs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.helpers.procs import no_run_process_left, run_listening, shm_leftovers

ROOT = Path(__file__).resolve().parents[2]
# The README's job, shortened: 30 warm-up steps (enough to see the loss fall), then 6
# async RL steps with partial rollouts (2-token segments) and two minibatches per batch,
# as a user turns sample reuse on.
MAIN = ["sft.steps=30", "sft.log_every=10", "sft.eval_every=30", "task.eval_size=32",
        "trainer.save_interval=20", "rl.prompts_per_step=8", "rl.steps=6", "rl.eval_every=3",
        "rollout.segment_tokens=2", "algorithm.minibatches=2",
        "trainer.micro_batch_size=32"]  # fmt: skip
PER_STEP = (
    "reward_mean",
    "lag_mean",
    "lag_max",
    "is_ratio",
    "truncated_frac",
    "mismatch_abs_logp",
    "gen_tokens_per_s",
    "train_tokens_per_s",
    "wait_batch_s",
    "trainer_idle_frac",
    "gen_idle_frac",
    "sync_s",
    "step_s",
    "dropped_total",
    "loss",
    "grad_norm",
    "reward_failures",
    "reward_timeouts",
)


class Ran(NamedTuple):
    out: Path
    res: subprocess.CompletedProcess
    listening: set[tuple[str, int, str]]
    shm_left: set[str]


@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> Ran:
    """launch/local.sh: the rank count comes from the config and torchrun starts the
    ranks; every TCP listener of the job's processes is sampled while it runs."""
    out = tmp_path_factory.mktemp("main") / "run"
    before = shm_leftovers()
    cmd = [str(ROOT / "launch" / "local.sh"), *MAIN, f"run.output_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res, listening = run_listening(cmd, ROOT, env, timeout=900)
    assert res.returncode == 0, res.stderr[-4000:]
    no_run_process_left(out)
    return Ran(out, res, listening, shm_leftovers() - before)


def _records(out: Path, phase: str) -> list[dict]:
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r["phase"] == phase]


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


def test_main_job_warms_up_at_tp2_and_writes_outputs(main_job):
    out, res = main_job.out, main_job.res
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("[warmup] step")]
    assert [ln.split()[2] for ln in lines] == ["10/30", "20/30", "30/30"], res.stdout
    losses = [r["loss"] for r in _records(out, "warmup")]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses  # it learns
    assert [r["step"] for r in _records(out, "warmup_eval")] == [0, 30]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "warmup" / "metadata.json").exists()  # the warm-up checkpoint
    assert (out / "checkpoint" / "metadata.json").exists()  # the RL policy
    assert "done: held-out accuracy" in res.stdout


def test_async_job_streams_rollouts_within_the_lag_bound(main_job):
    out, res = main_job.out, main_job.res
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("[rl] step")]
    assert [ln.split()[2] for ln in lines] == [f"{i}/6" for i in range(1, 7)], res.stdout
    assert all("reward_mean" in ln and "lag_mean" in ln and "sync_s" in ln for ln in lines)
    steps = _records(out, "rl")
    assert [r["step"] for r in steps] == list(range(1, 7))
    for r in steps:
        missing = [k for k in PER_STEP if k not in r]
        assert not missing, missing
        assert r["lag_max"] <= 1 and r["sync_s"] > 0 and 0 <= r["gen_idle_frac"] <= 1
        # Two minibatches: two optimizer steps per batch, pi_old scored before them.
        assert r["updates"] == 2 and r["old_logprobs_s"] > 0 and r["policy_change_abs_logp"] >= 0
    assert any(r["lag_max"] == 1 for r in steps)  # the generator really ran ahead
    # Answers are 4 tokens and segments 2: every response that did not end (EOS) within
    # its first 2 tokens was cut and resumed in the loop; after this warm-up that is most.
    assert sum(r["resumed_segments"] for r in steps) >= 6 * 8 * 8 // 2
    assert [r["step"] for r in _records(out, "rl_eval")] == [0, 3, 6]
    assert main_job.shm_left == set()  # nothing left in /dev/shm


def test_torchrun_job_listens_on_loopback_only(main_job):
    """No process of the job listens beyond loopback: the job's store, the SGLang server's
    HTTP port and its scheduler's store (each was once on every interface), and
    torchrun's own two stores, the rendezvous store and the agent store the ranks share,
    which listened on every interface before rl/runtime/torchrun.py bound them."""
    assert "starting" not in main_job.res.stdout  # ranks came from torchrun, not our spawner
    listening = main_job.listening
    # torchrun's two stores (the agent names itself pt_elastic or stays python), beside
    # the ranks' gloo links
    stores = {port for _, port, name in listening if not name.startswith("msrl:")}
    assert len(stores) >= 2, listening
    assert {ip for ip, _, _ in listening} == {"127.0.0.1"}, listening


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
