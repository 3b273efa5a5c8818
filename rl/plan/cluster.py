"""The whole plan of a job on its cluster: placement, DDMA volume, memory per GPU, verdict.

Why one function: the planner, the tests and (later) launchers must agree on a single
answer to "does this config run on this cluster", computed from the composed config alone
in milliseconds, before any queue wait. Arithmetic that cannot be placed (node counts,
GPU counts, TP across nodes) raises :class:`PlanRefused` at once; budgets that are
exceeded (GPU memory, KV cache) are collected as ``problems`` so the CLI can print the
breakdown that explains them before refusing.

The config is first checked by the torch-free checks of rl.config (model, trainer,
rollout); ``validate()`` as a whole runs at launch and in tests/unit/test_config.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rl.config.model_checks import validate_model, validate_trainer
from rl.config.validate import validate_rollout
from rl.models.shapes import param_count
from rl.plan.memory import (
    GIB,
    GeneratorGPU,
    TrainerGPU,
    generator_gpu,
    sequence_length,
    trainer_gpu,
)
from rl.plan.placement import Placement, PlanRefused, check_cpus, place, refuse
from rl.plan.transfer import Transfer, ddma_plan, transfer

if TYPE_CHECKING:
    from rl.config.schema import RootConfig


@dataclass
class ClusterPlan:
    run: str
    model: str
    params: int
    placement: Placement
    trainer: list[TrainerGPU]  # one per pipeline stage
    generator: GeneratorGPU | None  # None without RL steps (no servers)
    transfer: Transfer | None
    gpu_bytes: int | None  # None on a CPU-only cluster (nothing to fit)
    busy_cpus: dict[int, int]
    sequence: int  # tokens per sample the memory is sized for
    problems: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def busiest_trainer(self) -> TrainerGPU:
        return max(self.trainer, key=lambda g: (g.total, -g.stage))

    def check(self) -> None:
        refuse(self.fits, self.problems[0] if self.problems else "")


def _gb(n: float) -> str:
    return f"{n / GIB:.1f} GB"


def _trainer_problem(cfg: RootConfig, g: TrainerGPU, budget: int) -> str | None:
    if g.total <= budget:
        return None
    t, r, gpus = cfg.trainer, cfg.rollout, cfg.cluster.gpus_per_node
    tp_ok = 2 * t.tp <= gpus  # a larger TP group would still fit in a node
    if g.activations + g.logits > g.static:
        ctx = (
            f"lower rollout.context_length={r.context_length}"
            if r.context_length
            else f"set rollout.context_length (null: model.max_position_embeddings="
            f"{cfg.model.max_position_embeddings})"
        )
        hint = f"{ctx} or trainer.micro_batch_size={t.micro_batch_size}"
        hint += f", or raise trainer.tp={t.tp}" if tp_ok else ""
    else:
        hint = f"raise trainer.pp={t.pp}" + (f" or trainer.tp={t.tp}" if tp_ok else "")
        hint += f" (or trainer.dp={t.dp}: the distributed optimizer shards Adam over DP)"
    return (
        f"trainer GPU (pipeline stage {g.stage}) needs {_gb(g.total)} > "
        f"cluster.gpu_memory_gb={cfg.cluster.gpu_memory_gb:g}: {hint}"
    )


def _generator_problem(cfg: RootConfig, g: GeneratorGPU, budget: int, seq: int) -> str | None:
    r = cfg.rollout
    fp8 = "" if r.weight_sync.fp8_block else " or set rollout.weight_sync.fp8_block=128"
    if g.weights + g.reserved > budget:
        return (
            f"generator GPU needs {_gb(g.weights)} of weights + {_gb(g.reserved)} SGLang "
            f"reserve > cluster.gpu_memory_gb={cfg.cluster.gpu_memory_gb:g}: raise "
            f"rollout.tp={r.tp}{fp8}"
        )
    assert g.kv_capacity is not None
    if r.max_total_tokens is not None and r.max_total_tokens > g.kv_capacity:
        return (
            f"rollout.max_total_tokens={r.max_total_tokens} needs "
            f"{_gb(r.max_total_tokens * g.kv_bytes_per_token)} of KV cache per GPU but "
            f"{_gb(g.kv_capacity * g.kv_bytes_per_token)} is free: lower it (null: what "
            f"fits) or raise rollout.tp={r.tp}"
        )
    if g.kv_tokens < seq:
        return (
            f"generator KV cache holds {g.kv_tokens} tokens < one {seq}-token sequence "
            f"(rollout.context_length={r.context_length}): raise rollout.tp={r.tp}{fp8}"
        )
    return None


def plan_cluster(cfg: RootConfig, strict: bool = True) -> ClusterPlan:
    """Plan ``cfg`` on ``cfg.cluster``. Raises :class:`PlanRefused` (a ConfigError) for a
    layout that cannot be placed and, with ``strict``, for one that does not fit."""
    validate_model(cfg.model)
    validate_trainer(cfg.trainer, cfg.model)
    validate_rollout(cfg.rollout)
    placement = place(cfg)
    busy = check_cpus(cfg, placement)
    gpus = cfg.cluster.gpus_per_node
    budget = int(cfg.cluster.gpu_memory_gb * GIB) if gpus else None
    seq = sequence_length(cfg)
    sync: Transfer | None = None
    gen: GeneratorGPU | None = None
    if cfg.rl.steps > 0:
        w = cfg.rollout.weight_sync
        refuse(
            not placement.split or w.transport == "p2p",
            f"rollout.weight_sync.transport={w.transport!r} needs the trainer and the servers "
            "on one host; with separate training and generation nodes use "
            "rollout.weight_sync.transport=p2p",
        )
        sync = transfer(cfg, ddma_plan(cfg), placement.split)
        gen = generator_gpu(cfg, sync.server_weight_bytes, budget)
    plan = ClusterPlan(
        run=cfg.run.name,
        model=cfg.model.name,
        params=param_count(cfg.model),
        placement=placement,
        trainer=[trainer_gpu(cfg, p) for p in range(cfg.trainer.pp)],
        generator=gen,
        transfer=sync,
        gpu_bytes=budget,
        busy_cpus=busy,
        sequence=seq,
    )
    if budget is not None:
        for problem in (
            _trainer_problem(cfg, plan.busiest_trainer, budget),
            _generator_problem(cfg, gen, budget, seq) if gen else None,
        ):
            if problem:
                plan.problems.append(problem)
    if strict:
        plan.check()
    return plan


__all__ = ["ClusterPlan", "PlanRefused", "plan_cluster"]
