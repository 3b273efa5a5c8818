"""One RL step of a preset, simulated in both modes, and where its time goes.

``simulate(cfg)`` plans the job (rl.plan: placement, memory, the DDMA plan's bytes) and
models the step twice: asynchronous as configured (LlamaRL: separate trainer and SGLang
GPUs, DDMA between them) and as the synchronous DeepSpeed-Chat-like baseline the paper
compares with (every GPU shared, the trainer's layout generating, weights reloaded in
place). Pure logic, milliseconds after the plan.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING

from rl.plan.cluster import plan_cluster
from rl.simulate.colocated import SharedLayout
from rl.simulate.hardware import check
from rl.simulate.phases import (
    Workload,
    async_phases,
    decode_step_s,
    server_engine,
    server_slots,
    shared_engine,
    sync_phases,
)
from rl.simulate.step import Phases, async_step, bottleneck, sync_step

if TYPE_CHECKING:
    from rl.config.schema import RootConfig
    from rl.plan.cluster import ClusterPlan

# The LlamaRL paper's table (arXiv 2505.24034): seconds per step, synchronous baseline and
# LlamaRL, for the setting each preset reproduces.
PAPER: dict[str, tuple[float, float]] = {
    "llama3_8b_256gpu": (22.45, 8.90),
    "llama3_70b_512gpu": (82.32, 20.67),
    "llama3_405b_1024gpu": (635.8, 59.5),
}


@dataclass(frozen=True)
class Simulation:
    run: str
    gpus: int
    samples: int
    prompt_tokens: float
    _: KW_ONLY
    mean_response: float
    longest_response: float
    response_cap: float  # rollout.sampling.max_new_tokens
    sync: Phases
    asyn: Phases
    shared: SharedLayout  # the synchronous baseline's layout
    trainer: str  # the async layouts, for the report
    generator: str
    # One decode step at a full batch: the baseline's replica and an SGLang server.
    decode_ms: dict[str, float]
    batch: dict[str, float]  # samples decoded at once, per replica / server

    @property
    def sync_step(self) -> float:
        return sync_step(self.sync)

    @property
    def async_step(self) -> float:
        return async_step(self.asyn)

    @property
    def speedup(self) -> float:
        return self.sync_step / self.async_step

    @property
    def bottleneck(self) -> str:
        return bottleneck(self.asyn)

    @property
    def paper(self) -> tuple[float, float] | None:
        return PAPER.get(self.run)


def simulate(cfg: RootConfig, plan: ClusterPlan | None = None) -> Simulation:
    """Simulate ``cfg`` (``plan``: its plan, when the caller has it already)."""
    check(cfg)
    plan = plan or plan_cluster(cfg, strict=False)
    w = Workload.of(cfg)
    asyn = async_phases(cfg, plan, w)
    sync, shared = sync_phases(cfg, w)
    c, t, r, hw = cfg.cluster, cfg.trainer, cfg.rollout, cfg.cluster.hardware
    ctx = w.prompt + w.lengths.mean()
    engine = shared_engine(cfg, w)
    batch = {"sync": shared.samples_per_replica / shared.waves, "async": server_slots(cfg, plan, w)}
    decode = {
        "sync": 1e3 * decode_step_s(engine, hw, batch["sync"], ctx),
        "async": 1e3 * decode_step_s(server_engine(cfg, plan, w), hw, batch["async"], ctx),
    }
    return Simulation(
        run=cfg.run.name,
        gpus=c.nodes * c.gpus_per_node,
        samples=w.samples,
        prompt_tokens=w.prompt,
        mean_response=w.lengths.mean(),
        longest_response=w.lengths.longest(w.samples),
        response_cap=w.lengths.cap,
        sync=sync,
        asyn=asyn,
        shared=shared,
        trainer=f"TP{t.tp}{f' x CP{t.cp}' if t.cp > 1 else ''} x PP{t.pp} x DP{t.dp} = "
        f"{t.tp * t.cp * t.pp * t.dp} GPUs",
        generator=f"{r.servers} SGLang servers x TP{r.tp} ({r.dtype}"
        f"{', fp8 weights' if r.weight_sync.fp8_block else ''}) = {r.servers * r.tp} GPUs",
        decode_ms=decode,
        batch=batch,
    )
