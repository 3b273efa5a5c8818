"""DDMA volume per step, from the very plan the trainer and servers run (rl/ddma/plan.py).

Why reuse the plan instead of a formula: the bytes depend on details a formula drifts from
(SGLang's vocab padding, KV heads replicated past num_query_groups, FP8 scales per block,
which DP replica sends which layer). Every server gets the same plan from every trainer
rank, so one plan, built with one bucket per (trainer rank, generator rank) pair, gives
exact per-server, per-trainer-rank and per-server-GPU payloads in milliseconds.

The time estimate is a lower bound: the busiest sender (a trainer rank pushes to every
server in turn) or receiver (a server GPU), whichever is larger, at its NIC's line rate
(``cluster.interconnect_gbps``), with no contention; it is only given for p2p transport
across nodes (ipc stays on one host). Pure logic.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl.config.dtypes import itemsize as dtype_itemsize
from rl.ddma.plan import SCALE_SUFFIX, Plan, PlanError, plan_for
from rl.plan.placement import PlanRefused

if TYPE_CHECKING:
    from rl.config.schema import RootConfig

ONE_BUCKET = 1 << 50  # bucket size that never splits a pair's pieces


@dataclass(frozen=True)
class Transfer:
    """Payload bytes of one weight sync (headers and alignment excluded)."""

    servers: int
    per_server: int  # into one server (all its TP ranks)
    per_trainer_rank: dict[int, int]  # trainer rank (0-based in the trainer) -> bytes, all servers
    per_server_gpu: dict[int, int]  # server TP rank -> bytes it receives
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


def ddma_plan(cfg: RootConfig) -> Plan:
    try:
        return plan_for(
            cfg.model, cfg.trainer, cfg.rollout, dp=cfg.trainer.dp, bucket_bytes=ONE_BUCKET
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
        if name.endswith(SCALE_SUFFIX):
            total += n * 4
        else:
            total += n * (1 if plan.quantized(name) else itemsize)
    return total


def transfer(cfg: RootConfig, plan: Plan, split: bool) -> Transfer:
    servers = cfg.rollout.servers
    sent: dict[int, int] = defaultdict(int)
    received: dict[int, int] = defaultdict(int)
    for b in plan.buckets:
        n = sum(plan.piece_bytes(p) for p in b.pieces)
        sent[b.src] += n * servers
        received[b.dst] += n
    for rank in range(plan.src.world):
        sent.setdefault(rank, 0)
    seconds = None
    w = cfg.rollout.weight_sync
    if split and w.transport == "p2p" and cfg.cluster.gpus_per_node:
        rate = cfg.cluster.interconnect_gbps * 1e9 / 8
        seconds = max(max(sent.values()), max(received.values())) / rate
    return Transfer(
        servers=servers,
        per_server=plan.sent_bytes(),
        per_trainer_rank=dict(sorted(sent.items())),
        per_server_gpu=dict(sorted(received.items())),
        wire_dtype=cfg.trainer.params_dtype,
        fp8_block=plan.fp8_block,
        seconds=seconds,
        server_weight_bytes=engine_weight_bytes(plan, cfg.rollout.dtype),
    )
