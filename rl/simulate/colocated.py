"""The synchronous baseline's GPUs: what the co-located trainer keeps on them while they
generate, the KV cache the rest holds, and the waves a batch then needs.

The baseline (DeepSpeed-Chat-like, the paper's comparison) runs the trainer's TP x PP on
every GPU of the cluster: ``replicas`` data-parallel copies, each one generating its share
of the batch through the trainer's own layout, then training. Memory per GPU comes from
the planner's model of the trainer (rl/plan/memory.py: ``trainer_gpu``, at ``dp =
replicas``), not from a formula of its own, so the planner and the simulator cannot drift:

* resident while generating: the weights, the frozen reference copy (``kl_coef > 0``),
  the CUDA context and NCCL buffers, and whatever ``cluster.hardware.baseline_offload``
  leaves: ``none`` keeps the fp32 grads and the Adam shards too, ``optimizer`` moves Adam
  to host memory, ``optimizer_grads`` also frees the grad buffer. The activations and
  logits are freed after each backward pass and are not resident;
* the KV cache gets the rest: ``(GPU memory - resident) / kv bytes of one token on one
  stage``, the stage holding the least deciding for the whole copy;
* a batch that does not fit runs in waves, each a full decode of its longest sample; a
  sample's KV is reserved for the whole cap (prompt + ``max_new_tokens``), as a static
  engine does;
* moving Adam out and back costs ``2 * bytes / pcie_gbps`` per step; freed grads are
  zeroed again before the next backward, so they move nothing. After the optimizer step
  each GPU gathers its updated weights from its data-parallel peers over the NIC.

Pure logic.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING

from rl.config import dtypes
from rl.config.errors import ConfigError
from rl.plan.memory import GIB, TrainerGPU, kv_bytes_per_token, trainer_gpu

if TYPE_CHECKING:
    from rl.config.schema import RootConfig

# What each offload policy moves off the GPUs while they generate (TrainerGPU's fields).
OFFLOADS: dict[str, tuple[str, ...]] = {
    "none": (),
    "optimizer": ("optimizer",),
    "optimizer_grads": ("optimizer", "grads"),
}


@dataclass(frozen=True)
class SharedLayout:
    """The synchronous baseline's layout and memory (bytes: the busiest GPU's)."""

    gpus: int
    replicas: int
    samples_per_replica: float
    offload: str  # cluster.hardware.baseline_offload
    _: KW_ONLY
    resident: float  # trainer state kept on a GPU while it generates
    offloaded: float  # moved to host memory (Adam) or freed (grads) for generation
    kv_tokens: float  # per replica (one generation copy)
    waves: int
    offload_s: float  # Adam to host memory and back, per step
    gather_s: float  # the updated weights gathered from the data-parallel peers

    @property
    def reload_s(self) -> float:
        return self.offload_s + self.gather_s


def _kept(g: TrainerGPU, offload: str) -> tuple[int, int]:
    """Resident and offloaded bytes of one GPU while it generates."""
    moved = sum(getattr(g, f) for f in OFFLOADS[offload])
    resident = g.weights + g.reference + g.grads + g.optimizer + g.overhead - moved
    return resident, moved


def shared_layout(cfg: RootConfig, prompt: float, cap: float, samples: int) -> SharedLayout:
    """The baseline for ``samples`` samples of ``prompt`` tokens and at most ``cap`` more."""
    c, t, m, hw = cfg.cluster, cfg.trainer, cfg.model, cfg.cluster.hardware
    size = t.tp * t.cp * t.pp
    replicas = c.nodes * c.gpus_per_node // size
    if replicas < 1:
        raise ConfigError(
            f"trainer.tp*cp*pp = {size} GPUs > the cluster's {c.nodes * c.gpus_per_node}: the "
            "synchronous baseline runs the trainer's layout on every GPU"
        )
    itemsize = dtypes.itemsize(t.params_dtype)
    kv_stage = kv_bytes_per_token(m, t.tp, itemsize) / t.pp  # a token's KV on one stage
    stages = [trainer_gpu(cfg, s, dp=replicas) for s in range(t.pp)]
    kept = [_kept(g, hw.baseline_offload) for g in stages]
    resident = max(r for r, _ in kept)
    kv_tokens = max(c.gpu_memory_gb * GIB - resident, 0.0) / kv_stage
    if kv_tokens < prompt + cap:
        raise ConfigError(
            f"the synchronous baseline's GPUs (trainer.tp={t.tp}, pp={t.pp}) keep "
            f"{resident / GIB:.1f} GB of trainer state of cluster.gpu_memory_gb="
            f"{c.gpu_memory_gb:g} with cluster.hardware.baseline_offload="
            f"{hw.baseline_offload}: no room for one sample's KV cache"
        )
    n = samples / replicas
    waves = max(1, math.ceil(n * (prompt + cap) / kv_tokens))
    adam = max(g.optimizer for g in stages) if "optimizer" in OFFLOADS[hw.baseline_offload] else 0
    weights = max(g.weights for g in stages)
    nic = c.interconnect_gbps * 1e9 / 8 * hw.network_efficiency
    return SharedLayout(
        gpus=replicas * size,
        replicas=replicas,
        samples_per_replica=n,
        offload=hw.baseline_offload,
        resident=resident,
        offloaded=max(o for _, o in kept),
        kv_tokens=kv_tokens,
        waves=waves,
        offload_s=2 * adam / (hw.pcie_gbps * 1e9),
        gather_s=weights / nic,
    )
