"""The simulator's table and JSON: phases in both modes, speedup, where the time goes.

Pure logic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rl.plan.memory import GIB
from rl.simulate.hardware import assumptions
from rl.simulate.step import generator_loop, trainer_loop

if TYPE_CHECKING:
    from rl.config.schema import RootConfig
    from rl.simulate.simulation import Simulation

PHASES = ("generate", "reward", "train", "sync", "overhead")
LABELS = {
    "generate": "generate",
    "reward": "reward (waited for)",
    "train": "train",
    "sync": "weights (sync: reload, async: DDMA)",
    "overhead": "controller overhead",
}


def memory(s: Simulation) -> str:
    """The baseline's generation memory: what the trainer keeps, the KV cache, the waves."""
    lay = s.shared
    need = lay.samples_per_replica * (s.prompt_tokens + s.response_cap)
    return (
        f"sync memory per GPU: the trainer keeps {lay.resident / GIB:.1f} GiB while it "
        f"generates (baseline_offload={lay.offload}, {lay.offloaded / GIB:.1f} GiB off), so "
        f"a copy's KV cache holds {lay.kv_tokens / 1e6:.2f}M tokens against the "
        f"{need / 1e6:.2f}M its {lay.samples_per_replica:.0f} samples reserve: "
        f"{lay.waves} wave{'s' if lay.waves > 1 else ''}, {lay.offload_s:.2f} s of offload"
    )


def where_time_goes(s: Simulation) -> list[str]:
    """A few sentences: the dominant phase of each mode and why the modes differ."""
    sync, asyn = s.sync.as_dict(), s.asyn.as_dict()
    top = max(PHASES, key=lambda k: sync[k])
    lay = s.shared
    lines = [
        f"sync: {top} takes {sync[top] / s.sync_step:.0%} of the step; the baseline decodes "
        f"on {lay.replicas} replicas of the trainer's layout ({s.batch['sync']:.0f} samples "
        f"each, {s.decode_ms['sync']:.1f} ms a decode step) and waits for the longest "
        f"sample ({s.longest_response:.0f} tokens, mean {s.mean_response:.0f})",
        f"async: {s.generator} decode {s.batch['async']:.0f} samples each at "
        f"{s.decode_ms['async']:.1f} ms a step, refilling finished slots, so they are "
        f"bound by the mean length; the {s.bottleneck} is the bottleneck "
        f"(generator loop {generator_loop(s.asyn):.1f} s, trainer loop "
        f"{trainer_loop(s.asyn):.1f} s)",
        f"sync/async generation: {sync['generate'] / asyn['generate']:.1f}x "
        f"(decode step {s.decode_ms['sync'] / s.decode_ms['async']:.2f}x, tail "
        f"{s.longest_response / s.mean_response:.1f}x longest/mean)",
    ]
    return lines


def render(s: Simulation) -> str:
    out = [
        f"{s.run}: {s.gpus} GPUs, {s.samples} samples per step, prompts of "
        f"{s.prompt_tokens:.0f} tokens",
        f"  async (LlamaRL): trainer {s.trainer}; generator {s.generator}",
        f"  sync (DeepSpeed-Chat-like): every GPU shares the trainer's layout, "
        f"{s.shared.replicas} replicas of {s.shared.gpus // max(s.shared.replicas, 1)} GPUs",
        f"  {memory(s)}",
        "",
        f"  {'phase (s)':<38}{'sync':>10}{'async':>10}",
    ]
    sync, asyn = s.sync.as_dict(), s.asyn.as_dict()
    for k in PHASES:
        out.append(f"  {LABELS[k]:<38}{sync[k]:>10.2f}{asyn[k]:>10.2f}")
    out.append(f"  {'step':<38}{s.sync_step:>10.2f}{s.async_step:>10.2f}")
    line = f"  speedup {s.speedup:.2f}x"
    if s.paper:
        ps, pa = s.paper
        line += f" (paper: {ps:g} s / {pa:g} s = {ps / pa:.2f}x)"
    out += [line, "", "  where the time goes:"]
    out += [f"  - {x}" for x in where_time_goes(s)]
    out.append("  (async step = max(generate + reward + sync, train + sync) + overhead; every "
               "assumption: --json)")  # fmt: skip
    return "\n".join(out)


def to_json(s: Simulation, cfg: RootConfig | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "run": s.run,
        "gpus": s.gpus,
        "samples": s.samples,
        "prompt_tokens": s.prompt_tokens,
        "mean_response_tokens": s.mean_response,
        "longest_response_tokens": s.longest_response,
        "sync": {"step_s": s.sync_step, **s.sync.as_dict()},
        "async": {"step_s": s.async_step, **s.asyn.as_dict(), "bottleneck": s.bottleneck},
        "speedup": s.speedup,
        "layouts": {
            "async_trainer": s.trainer,
            "async_generator": s.generator,
            "sync_replicas": s.shared.replicas,
            "sync_gpus": s.shared.gpus,
            "sync_waves": s.shared.waves,
        },
        "sync_memory": {
            "offload": s.shared.offload,
            "resident_gib": s.shared.resident / GIB,
            "offloaded_gib": s.shared.offloaded / GIB,
            "kv_tokens_per_copy": s.shared.kv_tokens,
            "tokens_reserved_per_copy": s.shared.samples_per_replica
            * (s.prompt_tokens + s.response_cap),
            "waves": s.shared.waves,
            "offload_s": s.shared.offload_s,
            "gather_s": s.shared.gather_s,
        },
        "decode_step_ms": s.decode_ms,
        "decode_batch": s.batch,
        "where_time_goes": where_time_goes(s),
    }
    if s.paper:
        ps, pa = s.paper
        out["paper"] = {"sync_step_s": ps, "async_step_s": pa, "speedup": ps / pa}
        out["speedup_error"] = s.speedup / (ps / pa) - 1
    if cfg is not None:
        out["assumptions"] = assumptions(cfg)
    return out
