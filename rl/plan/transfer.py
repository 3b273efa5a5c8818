"""DDMA volume per step, from the very plan the trainer and servers run (rl/ddma/plan.py,
with the servers' relay topology of rl/ddma/relay.py).

Why reuse the plan instead of a formula: the bytes depend on details a formula drifts from
(SGLang's vocab padding, KV heads replicated past num_query_groups, FP8 scales per block,
which trainer rank sends which slice, which server forwards to which). One plan, built
with one bucket per (trainer rank, generator rank) pair, gives exact per-trainer-rank and
per-server-GPU payloads in well under a second.

The time estimate is a lower bound: the busiest trainer rank (what it sends to the root
servers) or server GPU (the larger of what it receives and what it forwards: NICs are
full duplex), at its NIC's line rate (``cluster.interconnect_gbps``), with no contention
and no pipeline fill; it is only given for p2p transport across nodes (ipc stays on one
host). Pure logic.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING

from rl.config.dtypes import itemsize as dtype_itemsize
from rl.ddma import relay
from rl.ddma.plan import Plan, PlanError, is_scale
from rl.plan.placement import PlanRefused

if TYPE_CHECKING:
    from rl.config.schema import RootConfig

ONE_BUCKET = 1 << 50  # bucket size that never splits a pair's pieces


@dataclass(frozen=True)
class Transfer:
    """Payload bytes of one weight sync (headers and alignment excluded)."""

    servers: int
    per_server: int  # into one server (all its TP ranks)
    per_trainer_rank: dict[int, int]  # trainer rank (0-based in the trainer) -> bytes it sends
    per_server_gpu: dict[int, int]  # server TP rank -> bytes it receives (every server alike)
    _: KW_ONLY
    per_server_gpu_out: dict[int, int]  # server TP rank -> bytes it forwards, busiest server
    relay: str  # none | chain | tree (rl/ddma/relay.py)
    roots: int  # servers the trainer ranks feed
    depth: int  # servers on the longest relay path (1: no relaying)
    wire_dtype: str  # what the non-FP8 tensors travel as (the trainer's params dtype)
    fp8_block: int | None
    seconds: float | None  # lower-bound estimate (p2p only)
    server_weight_bytes: int  # one server TP rank's weights as the engine holds them

    @property
    def total(self) -> int:
        return self.servers * self.per_server

    @property
    def busiest_trainer_rank(self) -> tuple[int, int]:
        return max(self.per_trainer_rank.items(), key=lambda kv: (kv[1], -kv[0]))

    @property
    def busiest_server_gpu(self) -> tuple[int, int]:
        return max(self.per_server_gpu.items(), key=lambda kv: (kv[1], -kv[0]))

    @property
    def balance(self) -> float:
        """Busiest trainer rank's bytes over the mean trainer rank's (1.0: even)."""
        mean = sum(self.per_trainer_rank.values()) / len(self.per_trainer_rank)
        return self.busiest_trainer_rank[1] / mean if mean else 1.0


def ddma_plan(cfg: RootConfig) -> Plan:
    try:
        return relay.plan_with_relay(
            cfg.model, cfg.trainer, cfg.rollout, cfg.trainer.dp, ONE_BUCKET, schedule=False
        )
    except PlanError as e:
        raise PlanRefused(str(e)) from None


def engine_weight_bytes(plan: Plan, dtype: str) -> int:
    """One SGLang TP rank's weights in the engine's ``dtype`` (FP8 linears and their
    float32 scales with ``fp8_block``), padding rows included: what the GPU holds."""
    itemsize = dtype_itemsize(dtype)
    total = 0
    for name, shape in plan.dst_shapes.items():
        n = 1
        for s in shape:
            n *= s
        if is_scale(name):
            total += n * 4
        else:
            total += n * (1 if plan.quantized(name) else itemsize)
    return total


def transfer(cfg: RootConfig, plan: Plan, split: bool) -> Transfer:
    sent, got, fwd = relay.traffic(plan)
    tp = plan.dst.tp
    for rank in range(plan.src.world):
        sent.setdefault(rank, 0)
    received = {j: got.get(j, 0) for j in range(tp)}  # replica 0's GPUs (all alike)
    out = {j: max(fwd.get(r * tp + j, 0) for r in range(plan.replicas)) for j in range(tp)}
    seconds = None
    if split and cfg.cluster.gpus_per_node:  # over the interconnect (split: a group transport)
        rate = cfg.cluster.interconnect_gbps * 1e9 / 8
        busiest = max([*sent.values(), *got.values(), *fwd.values()])
        seconds = busiest / rate
    return Transfer(
        servers=cfg.rollout.servers,
        per_server=plan.sent_bytes(),
        per_trainer_rank=dict(sorted(sent.items())),
        per_server_gpu=received,
        per_server_gpu_out=out,
        relay=plan.relay if plan.replicas > 1 else "none",
        roots=plan.parents.count(relay.TRAINER),
        depth=relay.depth(plan),
        wire_dtype=cfg.trainer.params_dtype,
        fp8_block=plan.fp8_block,
        seconds=seconds,
        server_weight_bytes=engine_weight_bytes(plan, cfg.rollout.dtype),
    )
