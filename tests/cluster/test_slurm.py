"""launch/slurm/train.sbatch on a real SLURM: Debian's slurm-wlm with munge, two nodes whose
slurmds share this host (tools/slurm/local_cluster.sh installs, configures and starts it).

One job runs the tiny experiment on 2 nodes (`srun torchrun --rdzv_backend c10d`, the
controller and the trainer on one node, the generator and the reward rank on the other,
DDMA point to point) and is requeued with `scontrol requeue` after its first RL
checkpoint, as a preemption would: the second attempt must resume from that checkpoint (no
second warm-up, no step trained twice in the metrics) and the job must end COMPLETED. Bad
jobs (a wrong config, a plan for more nodes than allocated) must fail in the batch script,
with the reason in the job's output, before any rank starts.

Installing SLURM needs root and apt-get (it writes /etc/slurm and adds node1/node2 to
/etc/hosts; it never overwrites a slurm.conf it did not write). CI sets
MSRL_REQUIRE_SLURM=1, which turns a machine without them into a failure rather than a
skip; MSRL_SKIP_SLURM=1 skips these tests on a machine that should not get a SLURM.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.sbatch import BAD_JOB_IDS, BAD_JOBS

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "tools/slurm/local_cluster.sh"
SBATCH = ROOT / "launch/slurm/train.sbatch"
STEPS, SAVE_EVERY = 8, 3
JOB = [
    "experiment=tiny_arithmetic_slurm",
    "sft.steps=5",
    "sft.stop_at_accuracy=null",
    "sft.eval_every=5",
    "task.eval_size=32",
    "rl.prompts_per_step=8",
    f"rl.steps={STEPS}",
    f"rl.save_interval={SAVE_EVERY}",
    "rl.eval_every=4",
]


@pytest.fixture(scope="module")
def slurm() -> Iterator[None]:
    required = os.environ.get("MSRL_REQUIRE_SLURM") == "1"
    if os.environ.get("MSRL_SKIP_SLURM") == "1" and not required:
        pytest.skip("MSRL_SKIP_SLURM=1: not installing a local SLURM on this machine")
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        reason = "a local SLURM needs root and apt-get (CI sets MSRL_REQUIRE_SLURM=1)"
        if required:
            pytest.fail(reason)
        pytest.skip(reason)
    was_up = subprocess.run([CLUSTER, "status"], capture_output=True).returncode == 0
    res = subprocess.run([CLUSTER, "start"], capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, f"local_cluster.sh start failed:\n{res.stderr[-3000:]}"
    yield
    if not was_up:  # leave the machine as it was
        subprocess.run([CLUSTER, "stop"], capture_output=True, timeout=120)


def _job_state(job: str) -> str:
    res = subprocess.run([CLUSTER, "job-state", job], capture_output=True, text=True)
    return res.stdout.strip()


def _rl_steps(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    recs = [json.loads(x) for x in metrics.read_text().splitlines() if x.endswith("}")]
    return [r["step"] for r in recs if r["phase"] == "rl"]


def _wait(what: str, check, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            tail = log.read_text()[-4000:] if log.exists() else "(no job output)"
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}:\n{tail}")
        time.sleep(2)


@pytest.mark.long(
    reason="a requeued SLURM job waits out cred_expire before it runs again, then the job "
    "resumes and completes on two slurmd nodes"
)
def test_sbatch_job_is_requeued_resumes_from_its_checkpoint_and_completes(
    slurm: None, tmp_path: Path
) -> None:
    out, log = tmp_path / "out", tmp_path / "job.out"
    env = {**os.environ, "MSRL_VENV": sys.prefix, "MSRL_OUTPUT_DIR": str(out)}
    sub = subprocess.run(
        ["sbatch", "--parsable", "--nodes=2", f"--output={log}", str(SBATCH), *JOB],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    job = sub.stdout.strip().split(";")[0]
    try:
        metrics, state = out / "metrics.jsonl", out / "rl_state.json"
        # Preempt once the first RL checkpoint is recorded and a step past it has run.
        _wait("the first RL checkpoint", lambda: state.exists(), 600, log)
        _wait("a step after it", lambda: max(_rl_steps(metrics)) > SAVE_EVERY, 300, log)
        subprocess.run(["scontrol", "requeue", job], check=True)
        done = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
        _wait("the job to end", lambda: _job_state(job).split(" ")[0] in done, 900, log)
    finally:
        subprocess.run(["scancel", job], capture_output=True)

    text = log.read_text()
    assert _job_state(job) == "COMPLETED 0:0", text[-4000:]
    # Both attempts ran with the planner's placement: 3 ranks on the first node, 2 on the
    # second, each rank in the role the plan gives its node, with per-rank logs.
    for attempt in (0, 1):
        assert f"attempt {attempt}: 5 ranks on 2 nodes (node[1-2], ranks per node 3,2" in text
        rank_logs = list((out / f"logs/attempt{attempt}").rglob("stdout.log"))
        assert len(rank_logs) == 5, rank_logs
    placed = {"controller 0": "node1", "trainer 0": "node1", "trainer 1": "node1"}
    placed |= {"generator 0": "node2", "reward 0": "node2"}
    for who, node in placed.items():
        assert text.count(f"[job] {who} on {node} ") == 2, who  # once per attempt
    # The second attempt resumed: every RL step once, in order, and no second warm-up.
    assert _rl_steps(metrics) == list(range(1, STEPS + 1))
    recs = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert sum(r["phase"] == "warmup_eval" and r["step"] == 5 for r in recs) == 1
    assert json.loads(state.read_text())["step"] == STEPS
    assert "resuming from RL step" in text
    evals = [r for r in recs if r["phase"] == "rl_eval"]
    assert [r["step"] for r in evals] == [0, 4, 8]
    assert (out / "curves.png").stat().st_size > 0


@pytest.mark.parametrize(("overrides", "message"), BAD_JOBS, ids=BAD_JOB_IDS)
def test_sbatch_refuses_a_bad_job_before_any_rank_starts(
    slurm: None, tmp_path: Path, overrides: list[str], message: str
) -> None:
    out, log = tmp_path / "out", tmp_path / "job.out"
    env = {**os.environ, "MSRL_VENV": sys.prefix, "MSRL_OUTPUT_DIR": str(out)}
    cmd = ["sbatch", "--wait", "--parsable", "--nodes=2", f"--output={log}", str(SBATCH)]
    res = subprocess.run(
        [*cmd, "experiment=tiny_arithmetic_slurm", *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    job = res.stdout.strip().split(";")[0]
    assert res.returncode != 0
    assert message in log.read_text(), log.read_text()
    assert _job_state(job).startswith("FAILED"), _job_state(job)
    assert not out.exists()  # no rank started, nothing written
