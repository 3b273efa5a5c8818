"""The placement planner: where a job's ranks and GPUs go, and whether it fits.

``python -m rl.plan experiment=llama3_405b_1024gpu [overrides...] [--json]`` composes the
config like every other entry point and prints which nodes and global ranks run the
trainer (its TP x PP x DP stages), which run SGLang servers (how many, TP each, owned by
which generator rank), where the controller and reward ranks go, the DDMA volume of one
weight sync, and the memory every GPU needs. A plan that cannot be placed or does not fit
is refused with the field to change. Pure logic (no torch, no Megatron): it runs on a
laptop in well under a second, so paper-scale presets are checked in the test suite.

* ``placement``: cluster arithmetic and the rank/node/GPU layout;
* ``memory``: per-GPU memory formulas (trainer and generator), documented there;
* ``transfer``: DDMA bytes per step, from rl/ddma/plan.py's own plan;
* ``cluster``: :func:`plan_cluster`, the verdict; ``report``: text and JSON.
"""

from __future__ import annotations

from rl.plan.cluster import ClusterPlan, plan_cluster
from rl.plan.placement import PlanRefused

__all__ = ["ClusterPlan", "PlanRefused", "plan_cluster"]
