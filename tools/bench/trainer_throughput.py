"""The Megatron trainer's training throughput and MFU on one device, as the RL step runs it.

    PYTHONPATH=. python tools/bench/trainer_throughput.py --device cuda
    PYTHONPATH=. python tools/bench/trainer_throughput.py --device cpu --smoke   # seconds

One process, a one-rank group. Each configuration is ``build_trainer`` on a composed config
(bf16, TP=PP=DP=1, micro-batch 1, Adam) taking ``MegatronTrainer.train_step`` with the
configured RL policy loss (``algorithm=aipo``) on random rows of ``--context`` tokens, the
whole sequence scored. Shape: Llama-3-8B's layers (hidden 4096, ffn 14336, 32 heads, 8 KV
groups, vocabulary 128256) with ``--layers`` of them. The weights are not initialised on
the host (minutes at 2B parameters): the model is built empty, filled on the device and
the optimizer's fp32 main copies refreshed from it.

Configurations, measured in one run so that each change's share shows:
  baseline          Megatron's DotProductAttention, norm weights in float32 (the old path)
  bf16_norms        + norm weights in bf16 (torch's fused RMSNorm kernel)
  default           + SDPA core attention: what ``trainer`` builds today
  recompute_full    default with ``trainer.recompute=full``
  packed_long       one packed row of 8x --context tokens (32k at the default) a step,
                    with ``trainer.recompute=full``
  fused_adam        default with torch's fused Adam kernel (a benchmark-only probe: the
                    trainer runs Megatron's choice, torch's multi-tensor Adam, without TE)
  te                Transformer Engine's layer spec, when transformer_engine imports

MFU counts model FLOPs per token, ``6 * matmul parameters`` (the LM head included, the
input embedding lookup not) ``+ 6 * layers * hidden * context`` (causal attention, forward
and backward); recomputation's extra forward is not model FLOPs. The peak is the device's
dense bf16 tensor rate from the table below.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools" / "bench"))

from bench_util import write_result  # noqa: E402

# Dense (no sparsity) BF16 tensor-core peaks, TFLOP/s: NVIDIA's H100 datasheet gives
# 1,979 (SXM), 1,671 (NVL) and 1,513 (PCIe) "with sparsity", half of it dense; the H200
# datasheet gives the H100 SXM's figure for the H200 SXM and the NVL's for the H200 NVL.
# Matched in order against torch.cuda.get_device_name().
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.5),
    ("H200 NVL", 835.5),
    ("H200", 989.4),
    ("H100", 989.4),  # "NVIDIA H100 80GB HBM3": the SXM module
)
PEAK_SOURCE = "NVIDIA H100 and H200 datasheets: dense BF16 tensor core (half the sparse figure)"
DEFAULT_OUT = ROOT / "tools" / "bench" / "results" / "trainer_throughput.json"


@dataclass(frozen=True)
class Variant:
    name: str
    attention: str = "sdpa"  # trainer.attention
    bf16_norms: bool = True
    recompute: str = "none"  # trainer.recompute
    spec: str = "local"  # local | te
    fused_adam: bool = False
    # One packed row of this many times --context tokens per step (32k at the default)
    # with full recomputation, in place of --rows rows of --context.
    long: int = 0


# In the order they run. The baseline runs last: a trainer with float32 norms in bf16
# training is not freed when dropped (seen on CPU: something outside Python's reach holds
# it), so anything after it would run beside a dead copy of its whole state.
VARIANTS = (
    Variant("default"),
    Variant("packed_long", recompute="full", long=8),
    Variant("recompute_full", recompute="full"),
    Variant("fused_adam", fused_adam=True),
    Variant("te", spec="te"),
    Variant("bf16_norms", attention="dot_product"),
    Variant("baseline", attention="dot_product", bf16_norms=False),
)


def peak_tflops(device_name: str) -> float | None:
    for key, peak in PEAK_BF16_TFLOPS:
        if key in device_name:
            return peak
    return None


def model_flops_per_token(model: torch.nn.Module, layers: int, hidden: int, context: int) -> int:
    """``6 * matmul parameters + 6 * layers * hidden * context`` (see the module docstring).
    Matmul parameters: every 2-D weight but the input embedding, whose lookup is no
    matmul; with tied embeddings the LM head multiplies by it, so it is counted once."""
    matmul = 0
    for name, p in model.named_parameters():
        if p.dim() == 2 and "word_embeddings" not in name:
            matmul += p.numel()
    if getattr(model, "share_embeddings_and_output_weights", False):
        matmul += model.embedding.word_embeddings.weight.numel()
    return 6 * matmul + 6 * layers * hidden * context


def context(args: argparse.Namespace, v: Variant) -> int:
    return args.context * (v.long or 1)


def rows(args: argparse.Namespace, v: Variant) -> int:
    return 1 if v.long else args.rows


def overrides(args: argparse.Namespace, v: Variant) -> list[str]:
    model = ["model=llama3_8b", f"model.num_layers={args.layers}"]
    if args.smoke:  # a tiny Llama-style shape with GQA: the same code path in seconds
        model = ["model=tiny", "model.num_layers=2", "model.hidden_size=64",
                 "model.ffn_hidden_size=128", "model.num_attention_heads=4",
                 "model.num_query_groups=2", "model.vocab_size=256"]  # fmt: skip
    if args.vocab:
        model.append(f"model.vocab_size={args.vocab}")
    return [
        *model,
        f"model.max_position_embeddings={max(context(args, v), 64)}",
        "trainer.tp=1", "trainer.pp=1", "trainer.dp=1", "trainer.micro_batch_size=1",
        f"trainer.global_batch_size={rows(args, v)}", "trainer.params_dtype=bfloat16",
        f"trainer.device={args.device}", f"trainer.recompute={v.recompute}",
        f"trainer.attention={v.attention}", "trainer.use_distributed_optimizer=true",
        # DotProductAttention takes no packed sequences (one row per micro-batch here)
        f"trainer.packing={v.attention == 'sdpa'}",
    ]  # fmt: skip


@contextlib.contextmanager
def building(v: Variant) -> Iterator[None]:
    """The old path's norms (float32) and the local spec even where TE imports."""
    from rl.models import megatron_gpt as mg

    with contextlib.ExitStack() as stack:
        if not v.bf16_norms:
            stack.enter_context(mock.patch.object(mg, "norms_in_compute_dtype", _keep))
        if v.spec == "local":
            stack.enter_context(mock.patch.object(mg, "have_transformer_engine", lambda: False))
        yield


def _keep(model: torch.nn.Module, dtype: torch.dtype) -> None:
    return None


def fill_on_device(model: torch.nn.Module, seed: int, std: float) -> None:
    """Weights drawn where they live: N(0, std) matrices, unit norm weights."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, std) if p.dim() >= 2 else p.fill_(1.0)


def make_batch(rows: int, context: int, vocab: int, seed: int):  # -> TrainBatch
    """An RL batch: a quarter prompt, the rest response (scored), sampled log-probs and
    per-row advantages; the last column is never scored (no next token)."""
    from rl.batch import TrainBatch

    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, context)
    mask[:, context // 4 : context - 1] = 1.0
    return TrainBatch(
        tokens=torch.randint(0, vocab, (rows, context), generator=g),
        loss_mask=mask,
        behaviour_logprobs=-torch.rand(rows, context, generator=g) * 4,
        advantages=torch.randn(rows, 1, generator=g).expand(rows, context).contiguous(),
    )


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(args: argparse.Namespace, v: Variant, peak: float | None) -> dict:
    from rl.algorithms.registry import loss_from_config
    from rl.compose import compose
    from rl.engine.trainer import build_trainer
    from rl.models.parallel import destroy_model_parallel

    cfg = compose(overrides(args, v))
    t0 = time.perf_counter()
    with building(v):
        tr = build_trainer(cfg.model, cfg.trainer, total_steps=1000, initialize=False)
    fill_on_device(tr.model.module, cfg.trainer.seed, cfg.model.init_method_std)
    assert tr.optimizer is not None
    tr.optimizer.reload_model_params()  # the fp32 main copies follow the filled weights
    if v.fused_adam:
        for opt in getattr(tr.optimizer, "chained_optimizers", [tr.optimizer]):
            for group in opt.optimizer.param_groups:
                group.update(fused=True, foreach=False)
    build_s = time.perf_counter() - t0
    loss_fn = loss_from_config(cfg.algorithm)
    batch = make_batch(rows(args, v), context(args, v), cfg.model.vocab_size, cfg.trainer.seed)
    module = tr.model.module
    core = type(module.decoder.layers[0].self_attention.core_attention).__name__
    norm = module.decoder.final_layernorm.weight.dtype
    flops = model_flops_per_token(module, cfg.model.num_layers, cfg.model.hidden_size,
                                  context(args, v))  # fmt: skip
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        sync(args.device)
        s0 = time.perf_counter()
        metrics = tr.train_step(batch, loss_fn)
        sync(args.device)
        if i >= args.warmup:
            times.append(time.perf_counter() - s0)
            losses.append(metrics["loss"])
    step_s = statistics.median(times)
    tokens_per_s = rows(args, v) * context(args, v) / step_s
    tflops = tokens_per_s * flops / 1e12
    out = {
        **asdict(v),
        "core_attention": core,
        "norm_dtype": str(norm).removeprefix("torch."),
        "build_s": round(build_s, 2),
        "step_s": round(step_s, 4),
        "step_s_all": [round(t, 4) for t in times],
        "tokens_per_s": round(tokens_per_s, 1),
        "model_tflops": float(f"{tflops:.4g}"),
        "mfu": round(tflops / peak, 4) if peak else None,
        "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2)
        if args.device == "cuda" else None,
        "loss": losses[-1],
        "flops_per_token": flops,
    }  # fmt: skip
    del tr, module, metrics
    gc.collect()
    destroy_model_parallel()  # Megatron's groups and its global score buffer go too
    if args.device == "cuda":
        torch.cuda.empty_cache()
        out["left_allocated_gb"] = round(torch.cuda.memory_allocated() / 1e9, 2)
    return out


def setup(device: str, threads: int) -> None:
    from rl.runtime.launch import setup_rank
    from rl.runtime.net import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    setup_rank(device, threads)


def chosen(args: argparse.Namespace) -> list[Variant]:
    from rl.models.megatron_gpt import have_transformer_engine

    out = [v for v in VARIANTS if not args.only or v.name in args.only]
    if args.device != "cuda":  # fused Adam needs CUDA tensors; TE needs CUDA
        out = [v for v in out if not v.fused_adam and v.spec == "local"]
    elif not have_transformer_engine():
        out = [v for v in out if v.spec != "te"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--layers", type=int, default=4, help="8B layers (2-4 fit one H100)")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--vocab", type=int, help="vocabulary (default: the model's, 128256)")
    ap.add_argument("--rows", type=int, default=4, help="rows per step (micro-batch 1)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="hidden 64, 2 layers, context 64")
    ap.add_argument("--only", nargs="*", help="configurations to run (default: all)")
    ap.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args()
    if args.smoke:
        args.context, args.warmup, args.steps = 64, 1, 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: torch.cuda.is_available() is False", file=sys.stderr)
        return 2
    setup(args.device, args.threads)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    peak = args.peak_tflops or (peak_tflops(name) if args.device == "cuda" else None)
    rows: list[dict] = []
    for v in chosen(args):
        try:
            rows.append(measure(args, v, peak))
        except Exception as e:  # one failed configuration must not lose the others
            rows.append({**asdict(v), "error": f"{type(e).__name__}: {str(e)[:400]}"})
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
        print(report_line(rows[-1]), flush=True)
        # After each configuration: a run cut short (a lent machine's time) keeps its rows.
        result = summarize(args, rows, name, peak)
        write_result(result, args.out)
    return 0 if all("error" not in r for r in rows if r["name"] in ("baseline", "default")) else 1


def report_line(r: dict) -> str:
    if "error" in r:
        return f"{r['name']:>15}: FAILED {r['error']}"
    mfu = f"MFU {r['mfu']:.3f}" if r["mfu"] is not None else "MFU n/a"
    mem = f"peak {r['peak_gb']:.1f} GB" if r["peak_gb"] is not None else ""
    return (f"{r['name']:>15}: {r['step_s']:.3f} s/step, {r['tokens_per_s']:,.0f} tokens/s, "
            f"{r['model_tflops']:.1f} TFLOP/s, {mfu} {mem} ({r['core_attention']}, "
            f"norms {r['norm_dtype']}, build {r['build_s']:.1f} s)")  # fmt: skip


def summarize(args: argparse.Namespace, rows: list[dict], name: str, peak: float | None) -> dict:
    ok = {r["name"]: r for r in rows if "error" not in r}
    base = ok.get("baseline")
    for r in ok.values():
        r["vs_baseline"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3) if base else None
    if base:
        story = ("baseline", "bf16_norms", "default", "fused_adam", "recompute_full", "te")
        print("tokens/s against the baseline: " + ", ".join(
            f"{n} {ok[n]['vs_baseline']:.2f}x" for n in story if n in ok))  # fmt: skip
    default = ok.get("default", {})
    from importlib.metadata import version

    return {
        "benchmark": "tools/bench/trainer_throughput.py",
        "device": name,
        "torch": torch.__version__,
        "megatron_core": version("megatron-core"),
        "shape": {
            "model": "tiny (smoke)" if args.smoke else "llama3_8b layers",
            "layers": 2 if args.smoke else args.layers,
            "context": args.context,
            "rows": args.rows,
            "micro_batch": 1,
            "dtype": "bfloat16",
            "optimizer": "adam (distributed optimizer, fp32 main weights)",
        },
        "timing": {"warmup_steps": args.warmup, "timed_steps": args.steps, "step": "median"},
        "peak_tflops": peak,
        "peak_source": "--peak-tflops" if args.peak_tflops else (PEAK_SOURCE if peak else None),
        "tokens_per_s": default.get("tokens_per_s"),
        "mfu": default.get("mfu"),
        "peak_gb": default.get("peak_gb"),
        "model_tflops": default.get("model_tflops"),
        "mfu_goal": 0.40,
        "goal_met": None if default.get("mfu") is None else default["mfu"] >= 0.40,
        "configs": rows,
    }


if __name__ == "__main__":
    sys.exit(main())
