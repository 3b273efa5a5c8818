"""The whole plan of a job on its cluster: placement, DDMA volume, memory per GPU, verdict.

Why one function: the planner, the tests and (later) launchers must agree on a single
answer to "does this config run on this cluster", computed from the composed config alone
in milliseconds, before any queue wait. Arithmetic that cannot be placed (node counts,
GPU counts, TP across nodes) raises :class:`PlanRefused` at once; budgets that are
exceeded (GPU memory, KV cache) are collected as ``problems`` so the CLI can print the
breakdown that explains them before refusing.

The config is first checked by the torch-free checks of rl.config (model, trainer,
rollout) and by its DDMA transport's (rl/ddma/transport.py); ``rl.checks.check`` as a
whole runs at launch and in tests/unit/test_config.py.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

from rl.config.roles import COMPANIONS
from rl.config.validate import validate_rollout
from rl.ddma import transport
from rl.models.checks import validate_model, validate_trainer
from rl.models.shapes import param_count
from rl.plan.memory import (
    GIB,
    GeneratorGPU,
    TrainerGPU,
    generator_gpu,
    model_gpu,
    sequence_length,
    trainer_gpu,
)
from rl.plan.placement import Placement, PlanRefused, check_cpus, place, refuse
from rl.plan.suggest import trainer_hint
from rl.plan.transfer import Transfer, ddma_plan, transfer

if TYPE_CHECKING:
    from rl.config.schema import RootConfig


@dataclass
class ClusterPlan:
    run: str
    model: str
    params: int
    placement: Placement
    _: KW_ONLY
    trainer: list[TrainerGPU]  # one per pipeline stage
    generator: GeneratorGPU | None  # None without RL steps (no servers)
    transfer: Transfer | None
    gpu_bytes: int | None  # None on a CPU-only cluster (nothing to fit)
    busy_cpus: dict[int, int]
    sequence: int  # tokens per sample the memory is sized for
    problems: list[str] = field(default_factory=list)
    # Host memory of the busiest node's staging copies (rollout.weight_sync.staging=host).
    host_staging: int = 0
    # Each model executor's GPUs (a critic, a reward model, a teacher): one per stage.
    models: dict[str, list[TrainerGPU]] = field(default_factory=dict)

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
    hint = trainer_hint(cfg, activations_dominate=g.activations + g.logits > g.static)
    return (
        f"trainer GPU (pipeline stage {g.stage}) needs {_gb(g.total)} > "
        f"cluster.gpu_memory_gb={cfg.cluster.gpu_memory_gb:g}: {hint}"
    )


def _model_problem(cfg: RootConfig, role: str, g: TrainerGPU, budget: int) -> str | None:
    if g.total <= budget:
        return None
    t = getattr(cfg, role).trainer
    return (
        f"{role} GPU (pipeline stage {g.stage}) needs {_gb(g.total)} > "
        f"cluster.gpu_memory_gb={cfg.cluster.gpu_memory_gb:g}: raise {role}.trainer.tp={t.tp} "
        f"or {role}.trainer.pp={t.pp}"
    )


def _generator_problem(cfg: RootConfig, g: GeneratorGPU, budget: int, seq: int) -> str | None:
    r = cfg.rollout
    more = "" if r.weight_sync.fp8_block else " or set rollout.weight_sync.fp8_block=128"
    if g.staged:  # the device copy is the first thing to give up
        more = f" or set rollout.weight_sync.staging=host or none{more}"
    if g.weights + g.staged + g.reserved > budget:
        copy = f" + {_gb(g.staged)} staging copy (rollout.weight_sync.staging=device)"
        return (
            f"generator GPU needs {_gb(g.weights)} of weights{copy if g.staged else ''} + "
            f"{_gb(g.reserved)} SGLang reserve > cluster.gpu_memory_gb="
            f"{cfg.cluster.gpu_memory_gb:g}: raise rollout.tp={r.tp}{more}"
        )
    assert g.kv_capacity is not None
    if r.max_total_tokens is not None and r.max_total_tokens > g.kv_capacity:
        return (
            f"rollout.max_total_tokens={r.max_total_tokens} needs "
            f"{_gb(r.max_total_tokens * g.kv_bytes_per_token)} of KV cache per GPU but "
            f"{_gb(g.kv_capacity * g.kv_bytes_per_token)} is free: lower it (null: what "
            f"fits) or raise rollout.tp={r.tp}{more}"
        )
    if g.kv_tokens < seq:
        return (
            f"generator KV cache holds {g.kv_tokens} tokens < one {seq}-token sequence "
            f"(rollout.context_length={r.context_length}): raise rollout.tp={r.tp}{more}"
        )
    return None


def _host_staging(cfg: RootConfig, placement: Placement, per_gpu: int) -> int:
    """Host bytes of the busiest node's staging copies (one per server GPU on it)."""
    per_node: dict[int, int] = {}
    for s in placement.servers:
        per_node[s.node] = per_node.get(s.node, 0) + cfg.rollout.tp * per_gpu
    return max(per_node.values(), default=0)


# The rule the presets' rollout.weight_sync.staging follows (tests/presets check it): a
# device copy only where it costs at most this share of the KV cache (the cache bounds the
# batch, so generation throughput), else a host copy where a node's copies take at most
# this share of its host memory (pinned: the OS can neither page nor reuse it), else none.
DEVICE_STAGING_KV_SHARE = 0.10
HOST_STAGING_SHARE = 0.25


def suggested_staging(cfg: RootConfig, plan: ClusterPlan) -> str:
    """The staging :data:`DEVICE_STAGING_KV_SHARE` and :data:`HOST_STAGING_SHARE` pick for
    ``plan`` (on CPU, or without servers, ``device``: nothing is sized from memory)."""
    if plan.gpu_bytes is None or plan.transfer is None:
        return "device"
    weights = plan.transfer.server_weight_bytes
    g = generator_gpu(cfg, weights, plan.gpu_bytes, "none")
    assert g.kv_capacity is not None
    if weights <= DEVICE_STAGING_KV_SHARE * g.kv_capacity * g.kv_bytes_per_token:
        return "device"
    host = cfg.cluster.host_memory_gb
    per_node = _host_staging(cfg, plan.placement, weights)
    return "host" if host is not None and per_node <= HOST_STAGING_SHARE * host * GIB else "none"


def _host_problem(cfg: RootConfig, host_bytes: int) -> str | None:
    c = cfg.cluster
    if c.host_memory_gb is None or host_bytes <= c.host_memory_gb * GIB:
        return None
    return (
        f"a generation node needs {_gb(host_bytes)} of host memory for its servers' staging "
        f"copies (rollout.weight_sync.staging=host) > cluster.host_memory_gb="
        f"{c.host_memory_gb:g}: set rollout.weight_sync.staging=none or raise rollout.tp"
    )


def plan_cluster(cfg: RootConfig, strict: bool = True) -> ClusterPlan:
    """Plan ``cfg`` on ``cfg.cluster``. Raises :class:`PlanRefused` (a ConfigError) for a
    layout that cannot be placed and, with ``strict``, for one that does not fit."""
    validate_model(cfg.model)
    validate_trainer(cfg.trainer, cfg.model)
    validate_rollout(cfg.rollout)
    transport.check(cfg)
    placement = place(cfg)
    busy = check_cpus(cfg, placement)
    gpus = cfg.cluster.gpus_per_node
    budget = int(cfg.cluster.gpu_memory_gb * GIB) if gpus else None
    seq = sequence_length(cfg)
    sync: Transfer | None = None
    gen: GeneratorGPU | None = None
    host_staging = 0
    if cfg.rl.steps > 0:
        w = cfg.rollout.weight_sync
        crossing = [n for n, t in transport.registry().items() if not t.one_host]
        refuse(
            not placement.split or not transport.get(w.transport).one_host,
            f"rollout.weight_sync.transport={w.transport!r} needs the trainer and the servers "
            "on one host; with separate training and generation nodes use "
            f"rollout.weight_sync.transport={' or '.join(crossing)}",
        )
        sync = transfer(cfg, ddma_plan(cfg), placement.split)
        gen = generator_gpu(cfg, sync.server_weight_bytes, budget)
        host_staging = _host_staging(cfg, placement, gen.host_staged)
    plan = ClusterPlan(
        run=cfg.run.name,
        model=cfg.model.name,
        params=param_count(cfg.model),
        placement=placement,
        trainer=[trainer_gpu(cfg, p) for p in range(cfg.trainer.pp)],
        models=_models(cfg, placement),
        generator=gen,
        transfer=sync,
        gpu_bytes=budget,
        busy_cpus=busy,
        sequence=seq,
        host_staging=host_staging,
    )
    if budget is not None:
        for problem in (
            _trainer_problem(cfg, plan.busiest_trainer, budget),
            _generator_problem(cfg, gen, budget, seq) if gen else None,
            _host_problem(cfg, host_staging),
            *(
                _model_problem(cfg, role, max(gs, key=lambda g: g.total), budget)
                for role, gs in plan.models.items()
            ),
        ):
            if problem:
                plan.problems.append(problem)
    if strict:
        plan.check()
    return plan


def _models(cfg: RootConfig, placement: Placement) -> dict[str, list[TrainerGPU]]:
    """Each placed model executor's memory per GPU, stage by stage."""
    from rl.companion import TRAINED, model_of
    from rl.models.arch import has_score_head

    out = {}
    for role in COMPANIONS:
        if placement.ranks.get(role):
            m, t = model_of(cfg, role), getattr(cfg, role).trainer
            score = has_score_head(str(m.architecture))
            out[role] = [model_gpu(cfg, m, t, p, trained=role in TRAINED, score=score)
                         for p in range(t.pp)]  # fmt: skip
    return out


__all__ = ["ClusterPlan", "PlanRefused", "plan_cluster", "suggested_staging"]
