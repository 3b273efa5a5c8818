"""``python -m rl.plan [--json | --ranks-per-node | --node-ranks] [hydra overrides...]``:
print a job's placement and memory.

``--ranks-per-node`` prints only the processes to start on each node, comma-separated
(launch/slurm/train.sbatch starts that many on each node, and refuses a plan that does
not fit before anything is allocated to it). ``--node-ranks`` prints which role-map ranks
those processes play, node by node (``0,1,2;3,4``, rl/config/roles.py); the script hands
it to every rank, which takes its role from its node and local rank.

Exit status: 0 the plan fits, 1 refused (cannot be placed or does not fit), 2 the config
itself is wrong (a Hydra typo, a bad value), each with a one-line reason on stderr.
"""

from __future__ import annotations

import json
import sys

USAGE = """usage: python -m rl.plan [--json | --ranks-per-node | --node-ranks] [overrides...]

Compose the config (same overrides as python -m rl.train, e.g. experiment=llama3_8b_256gpu
trainer.pp=2) and print where every rank and GPU goes, the DDMA volume per step and the
memory each GPU needs; refuse a plan that does not fit."""
OPTIONS = ("--json", "--ranks-per-node", "--node-ranks")


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    as_json, per_node, node_ranks = (opt in argv for opt in OPTIONS)
    overrides = [a for a in argv if a not in OPTIONS]
    bad = [a for a in overrides if a.startswith("--")]
    if bad:
        opts = ", ".join((*OPTIONS, "--help"))
        print(f"unknown option {bad[0]} (options: {opts})", file=sys.stderr)
        return 2

    from omegaconf.errors import OmegaConfBaseException

    from rl.checks import compose_resolved
    from rl.config import ConfigError
    from rl.config.roles import format_node_ranks
    from rl.plan.cluster import plan_cluster
    from rl.plan.placement import PlanRefused
    from rl.plan.report import render, to_json

    try:
        cfg = compose_resolved(overrides)
        plan = plan_cluster(cfg, strict=False)
    except PlanRefused as e:
        if as_json:
            print(json.dumps({"fits": False, "problems": [str(e)]}))
        print(f"plan refused: {e}", file=sys.stderr)
        return 1
    except (ConfigError, OmegaConfBaseException) as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    if per_node or node_ranks:
        if plan.fits:
            ranks = plan.placement.node_ranks()
            print(format_node_ranks(ranks) if node_ranks else ",".join(str(len(r)) for r in ranks))
    else:
        print(json.dumps(to_json(plan), indent=1) if as_json else render(plan, cfg))
    if not plan.fits:
        print(f"plan refused: {plan.problems[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
