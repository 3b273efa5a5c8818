"""Jobs launch/slurm/train.sbatch must refuse before srun starts any rank, with the line it
prints: shared by the stand-in test (tests/multiproc/test_sbatch_script.py) and the real
SLURM one (tests/cluster/test_slurm.py)."""

from __future__ import annotations

BAD_JOBS = [
    (["trainer.tp=4"], "config error: trainer.tp=4 does not divide"),
    (
        [
            "cluster.nodes=3",
            "cluster.generation_nodes=2",
            "cluster.roles.generator=2",
            "rollout.servers=2",
        ],
        "the plan places ranks on 3 nodes (cluster.nodes) but the job has 2",
    ),
]
BAD_JOB_IDS = ["bad-config", "node-count"]
