"""Where each value of ``cluster.hardware`` comes from, and the checks on them.

Why beside the code: the simulator's predictions are only as good as these numbers, so
every one is printed with its source (``python -m rl.simulate``, and the "assumptions"
list of its JSON). Public specs are the H100 SXM datasheet's dense figures; the
efficiency factors are assumptions, one set for every preset, never fitted to one.
Pure logic.
"""

from __future__ import annotations

from dataclasses import fields
from typing import TYPE_CHECKING

from rl.config.errors import ConfigError
from rl.config.schema import HardwareConfig, ResponseLengthConfig
from rl.simulate.colocated import OFFLOADS

if TYPE_CHECKING:
    from rl.config.schema import RootConfig

H100 = "NVIDIA H100 SXM datasheet"
SOURCES: dict[str, str] = {
    "bf16_tflops": f"{H100}: BF16 tensor core, dense (1979 with sparsity)",
    "fp8_tflops": f"{H100}: FP8 tensor core, dense (3958 with sparsity)",
    "hbm_gbps": f"{H100}: HBM3 bandwidth 3.35 TB/s",
    "nvlink_gbps": f"{H100}: NVLink 900 GB/s bidirectional, so 450 GB/s each way",
    "pcie_gbps": "PCIe Gen5 x16: 64 GB/s each way",
    "train_mfu": "Llama 3 paper (arXiv 2407.21783), 405B pre-training on H100: 38-43% BF16 "
    "MFU; assumed for every trainer",
    "prefill_mfu": "assumption: prefill and batched-decode matmuls reach half of peak",
    "decode_efficiency": "assumption: a decode step streams weights and KV cache at 60% of "
    "peak HBM bandwidth (kernel and scheduling gaps)",
    "network_efficiency": "assumption: 80% of the NIC's line rate as goodput (DDMA, reload)",
    "collective_latency_us": "assumption: one small NCCL all-reduce on NVLink inside a node "
    "(two per layer with TP)",
    "hop_latency_us": "assumption: one pipeline send of a decode step's activations between nodes",
    "eager_layer_us": "assumption: ~15 kernels per layer x ~5 us CUDA launch overhead in eager "
    "PyTorch; applies to the synchronous baseline's decode in the trainer (SGLang replays "
    "CUDA graphs)",
    "reward_s_per_sample": "assumption: a rule-based scorer; math-verify takes ~2 ms an answer "
    "and 80-480 ms a symbolic one on this project's CPU (FACTS.md)",
    "step_overhead_s": "assumption: the controller's batch assembly, logging and hand-offs per "
    "step, overlapped by neither loop",
    "baseline_offload": "assumption, after DeepSpeed-Chat (arXiv 2308.01320) step 3, whose "
    "hybrid engine generates with the actor's weights, grads and optimizer states resident "
    "on the same GPUs by default (none); its --offload moves the optimizer to host memory "
    "(ZeRO-Offload: optimizer); optimizer_grads also frees the grad buffer",
    "responses.median_frac": "assumption: median response a quarter of max_new_tokens",
    "responses.sigma": "assumption: lognormal spread of response lengths (the tail reaches "
    "max_new_tokens in a 1,024-sample batch)",
    "responses.prompt_frac": "assumption: prompts fill half of the context left to them",
}
ZERO_OK = ("latency_us", "layer_us", "overhead_s", "sigma", "per_sample")
NETWORK = "cluster.interconnect_gbps: one 400 Gb/s NIC per GPU (ConnectX-7 on HGX H100)"


def _flat(hw: HardwareConfig) -> dict[str, float | str]:
    out: dict[str, float | str] = {}
    for f in fields(HardwareConfig):
        value = getattr(hw, f.name)
        if f.name == "responses":
            out.update(
                {
                    f"responses.{k.name}": getattr(value, k.name)
                    for k in fields(ResponseLengthConfig)
                }
            )
        elif f.name != "name":
            out[f.name] = value
    return out


def assumptions(cfg: RootConfig) -> list[dict[str, object]]:
    """Every value the simulator assumed, with its source."""
    hw = cfg.cluster.hardware
    rows: list[dict[str, object]] = [
        {"name": f"cluster.hardware.{k}", "value": v, "source": SOURCES[k]}
        for k, v in _flat(hw).items()
    ]
    rows.append(
        {
            "name": "cluster.interconnect_gbps",
            "value": cfg.cluster.interconnect_gbps,
            "source": NETWORK,
        }
    )
    return rows


def check(cfg: RootConfig) -> None:
    """One line naming the field and value that cannot be simulated."""
    c = cfg.cluster
    if c.gpus_per_node <= 0:
        raise ConfigError(
            f"cluster.gpus_per_node={c.gpus_per_node}: the simulator models GPU clusters "
            "(use a GPU preset, e.g. experiment=llama3_8b_256gpu)"
        )
    if cfg.rl.steps <= 0:
        raise ConfigError(f"rl.steps={cfg.rl.steps}: no RL step to simulate")
    if c.hardware.baseline_offload not in OFFLOADS:
        raise ConfigError(
            f"cluster.hardware.baseline_offload={c.hardware.baseline_offload}: must be one "
            f"of {', '.join(OFFLOADS)}"
        )
    for name, value in _flat(c.hardware).items():
        if isinstance(value, str):
            continue
        share = name.endswith(("mfu", "efficiency", "frac"))
        may_be_zero = name.endswith(ZERO_OK)
        if (value < 0 if may_be_zero else value <= 0) or (share and value > 1):
            want = "in (0, 1]" if share else ">= 0" if may_be_zero else "> 0"
            raise ConfigError(f"cluster.hardware.{name}={value}: must be {want}")
