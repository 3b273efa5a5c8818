"""launch/slurm/train.sbatch's own logic, without a SLURM: stand-ins for ``scontrol`` and
``srun`` run the script's per-node command once per node, and a stand-in ``torchrun``
records what each node's agent would have started.

The real job on a real SLURM is tests/cluster/test_slurm.py; this checks, on any machine,
that the script hands each node the planner's process count and node ranks, that every
process then takes the role the plan gives it (with no planner in the job), and that a bad
job is refused before srun.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl.compose import compose
from rl.config.roles import NODE_RANKS_ENV, RoleMap
from rl.runtime.job import placed_rank
from tests.helpers.sbatch import BAD_JOB_IDS, BAD_JOBS

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "launch/slurm/train.sbatch"

# One write, as the real scontrol does: the script reads it through `| head -n1` under
# pipefail, and a second write after head has exited would die of SIGPIPE.
SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] || exit 1
cat <<<"$(printf 'node%s\\n' $(seq 1 "$SLURM_JOB_NUM_NODES"))"
"""
# srun --opts... bash -c SCRIPT TORCHRUN ARGS...: one task per node, in turn, with the
# node's SLURM_NODEID, and the recorder in place of torchrun.
SRUN = """#!/usr/bin/env bash
set -euo pipefail
while [[ "$1" == --* ]]; do shift; done
shell="$1" flag="$2" script="$3"
shift 4
for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do
  SLURM_NODEID=$i "$shell" "$flag" "$script" "$(dirname "$0")/torchrun" "$@"
done
"""
TORCHRUN = """#!/usr/bin/env bash
printf '%s\\t%s\\t%s\\n' "$SLURM_NODEID" "$MSRL_NODE_RANKS" "$*" >>"$MSRL_TEST_RECORD"
"""


def _sbatch(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, Path, Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", SCONTROL), ("srun", SRUN), ("torchrun", TORCHRUN)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    out, record = tmp_path / "out", tmp_path / "agents.tsv"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": "node[1-2]",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "msrl",
        "MSRL_VENV": sys.prefix,
        "MSRL_OUTPUT_DIR": str(out),
        "MSRL_TEST_RECORD": str(record),
    }
    env.pop(NODE_RANKS_ENV, None)
    res = subprocess.run(
        ["bash", str(SBATCH), "experiment=tiny_arithmetic_slurm", *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return res, out, record


def test_each_node_starts_the_planned_ranks_and_each_rank_finds_its_role(
    tmp_path: Path,
) -> None:
    res, out, record = _sbatch(tmp_path)
    assert res.returncode == 0, res.stderr
    assert "5 ranks on 2 nodes (node[1-2], ranks per node 3,2" in res.stdout
    agents = [line.split("\t") for line in record.read_text().splitlines()]
    assert [a[0] for a in agents] == ["0", "1"]  # one agent per node, in node order
    cfg = compose(["experiment=tiny_arithmetic_slurm"])
    roles = RoleMap.from_config(cfg)
    placed: dict[str, str] = {}
    for node, node_ranks, argv in agents:
        assert node_ranks == "0,1,2;3,4"
        args = argv.split()
        assert args[:2] == ["-m", "rl.runtime.torchrun"]  # its stores bound to one address
        started = int(args[args.index("--nproc-per-node") + 1])
        assert args[-3:] == [
            "rl.train",
            "experiment=tiny_arithmetic_slurm",
            f"run.output_dir={out}",
        ]
        for local in range(started):
            env = {NODE_RANKS_ENV: node_ranks, "SLURM_NODEID": node, "LOCAL_RANK": str(local)}
            env["LOCAL_WORLD_SIZE"] = str(started)
            role, role_rank = roles.role_of(placed_rank(roles, env, rank=-1))
            placed[f"{role} {role_rank}"] = f"node{int(node) + 1}"
    assert placed == {
        "controller 0": "node1",
        "trainer 0": "node1",
        "trainer 1": "node1",
        "generator 0": "node2",
        "reward 0": "node2",
    }


@pytest.mark.parametrize(("overrides", "message"), BAD_JOBS, ids=BAD_JOB_IDS)
def test_a_bad_job_is_refused_before_srun(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    res, out, record = _sbatch(tmp_path, *overrides)
    assert res.returncode != 0
    assert message in res.stderr, res.stderr
    assert not record.exists()  # srun never ran
    assert not out.exists()  # nothing written
