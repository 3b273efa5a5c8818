"""LoRA against full fine-tuning on SmolLM2-135M, in one run: a train step's time, the
trainer's peak memory, and DDMA's send side (time and bytes).

    PYTHONPATH=. python tools/bench/lora_vs_full.py [--device cuda] [--hf DIR] [--out F]

(results: tools/bench/results/lora_vs_full_cpu.json with --hf models/smollm2-135m-instruct,
lora_vs_full_cuda.json on one H200)

The model is SmolLM2-135M-Instruct's shape (``SMOLLM2``: 30 layers, hidden 576, 9 heads
and 3 KV heads, tied 49,152-token embeddings). Its weights are random unless ``--hf``
names a checkpoint (models/smollm2-135m-instruct, made by tools/make_smollm2.py): a step's
time and memory do not depend on the weights' values, and a GPU machine then needs no
model files. One Megatron trainer rank per case, TP1 as in experiment=smollm2_arith_cpu,
each in a fresh process, so that each case's peak memory is its own:

- **train step**: Adam steps on batches of the experiment's RL shape (16 rows of 48
  tokens, micro-batches of 8), the first dropped as warm-up; the median.
- **peak memory** during the steps, over what the loaded model already held: on CUDA
  ``max_memory_allocated`` (and the planner's figure for the same config, rl/plan/memory.py,
  beside it); on CPU the rank's peak RSS (VmHWM, reset after loading).
- **DDMA's send side**: every bucket of the plan into an SGLang TP1 server packed as the
  sender packs it (gather-copy and the header's checksum; with LoRA each targeted shard is
  first merged, ``W + s B A``), timed on the trainer's device; its payload bytes. What a
  transport and the server then do with the bytes does not depend on LoRA: the same
  bytes arrive either way (a full job's sync, measured, is in smollm2_arith_cpu*.json).

Baseline: full fine-tuning, measured in the same run; ratios are LoRA over full.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_util import write_result

from rl.runtime.launch import spawn

ROOT = Path(__file__).resolve().parents[2]
# SmolLM2-135M-Instruct's config.json, the fields that fix its shape.
SMOLLM2 = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
    bos_token_id=1, eos_token_id=2, pad_token_id=2,
)  # fmt: skip
LORA = ["trainer.lora.rank=16", "trainer.lora.alpha=32"]  # as the SmolLM2 LoRA runs
ROWS, SEQ, MICRO = 16, 48, 8


def make_random(path: Path, dtype: torch.dtype) -> Path:
    import transformers

    torch.manual_seed(0)
    conf = transformers.LlamaConfig(**SMOLLM2)
    transformers.LlamaForCausalLM(conf).to(dtype).save_pretrained(path)
    return path


def _peak_cpu_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def case(ckpt: str, m, dtype: str, device: str, lora: bool, steps: int, reps: int) -> dict:
    """One trainer rank: load, train ``steps`` steps, pack every DDMA bucket ``reps`` times."""
    from rl.algorithms.losses import nll_loss
    from rl.batch import TrainBatch
    from rl.compose import compose
    from rl.config.dtypes import torch_dtype
    from rl.ddma import wire
    from rl.ddma.megatron_source import shard_getter, source_rank
    from rl.ddma.plan import plan_for
    from rl.engine.trainer import build_trainer
    from rl.plan.memory import trainer_gpu

    cfg = compose([
        "trainer.tp=1", "trainer.pp=1", f"trainer.micro_batch_size={MICRO}",
        f"trainer.global_batch_size={ROWS}", f"trainer.params_dtype={dtype}",
        f"trainer.device={device}", "trainer.optim.lr=1e-5", "trainer.optim.min_lr=1e-5",
        "rollout.tp=1", f"rollout.device={device}", f"rollout.context_length={SEQ}",
        "rl.prompts_per_step=4",
        *(LORA if lora else []),
    ])  # fmt: skip
    cuda = device == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    tr = build_trainer(m, cfg.trainer, total_steps=steps)
    tr.load(ckpt, load_optimizer=False)
    module = tr.model.module
    params = list(module.parameters())
    trained = sum(p.numel() for p in params if p.requires_grad)
    sync()
    if cuda:
        loaded = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        loaded = _peak_cpu_mb() * 2**20
        Path("/proc/self/clear_refs").write_text("5")  # the peak restarts at today's RSS
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(steps):
        tokens = torch.randint(3, m.vocab_size, (ROWS, SEQ), generator=g)
        mask = torch.ones(ROWS, SEQ)
        mask[:, :16] = 0.0  # the prompt's tokens
        sync()
        t0 = time.perf_counter()
        tr.train_step(TrainBatch(tokens, mask), nll_loss)
        sync()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else _peak_cpu_mb() * 2**20
    plan = plan_for(m, cfg.trainer, cfg.rollout)
    rank = source_rank(tr.layout, plan.src)
    get = shard_getter(module, plan, rank)
    buf = torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=tr.device)
    wdtype = torch_dtype(dtype)
    buckets = plan.sends(rank)
    packs = []
    for v in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        for b in buckets:
            wire.pack(buf, plan, b, get, wdtype, v + 1)
        sync()
        packs.append(time.perf_counter() - t0)
    cfg.model = m  # the planner's model is the checkpoint's (its own is the tiny preset)
    planned = trainer_gpu(cfg, 0)
    return {
        "trained_params": trained,
        "params": sum(p.numel() for p in params),
        "train_step_s": statistics.median(times[1:]),
        "train_step_s_all": [round(t, 4) for t in times],
        "loaded_mb": loaded / 2**20,
        "peak_mb": peak / 2**20,
        "peak_over_loaded_mb": (peak - loaded) / 2**20,
        "planned_weights_grads_adam_mb": planned.static / 2**20,
        "planned_total_mb": planned.total / 2**20,
        "ddma_pack_s": statistics.median(packs[1:]),
        "ddma_buckets": len(buckets),
        "ddma_payload_bytes": sum(plan.payload(b) for b in buckets),
        "ddma_wire_bytes": sum(b.nbytes for b in buckets),
    }


def main() -> None:
    from rl.weights.convert import hf_to_mcore, prepare_hf_to_mcore

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--hf", help="a SmolLM2 checkpoint (default: random weights of its shape)")
    ap.add_argument("--dtype", help="float32 on CPU (the experiment's), bfloat16 on CUDA")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="default: tools/bench/results/lora_vs_full_<device>.json")
    a = ap.parse_args()
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    tmp = Path(tempfile.mkdtemp(prefix="lora-vs-full-"))
    try:
        hf = Path(a.hf) if a.hf else make_random(tmp / "hf", getattr(torch, dtype))
        m, dtype = prepare_hf_to_mcore(str(hf), 1, 1, vocab_multiple=128, dtype=dtype)
        t0 = time.perf_counter()
        hf_to_mcore(str(hf), str(tmp / "mcore"), dtype=dtype)
        print(f"[bench] {hf} -> Megatron in {time.perf_counter() - t0:.0f} s", flush=True)
        result: dict = {"model": str(a.hf or "SmolLM2-135M shape, random weights"),
                        "device": a.device, "dtype": dtype, "lora_overrides": LORA,
                        "batch": {"rows": ROWS, "tokens": SEQ, "micro_batch": MICRO}}  # fmt: skip
        if a.device == "cuda":
            result["gpu"] = torch.cuda.get_device_name(0)
        for name, lora in (("full", False), ("lora", True)):
            args = (str(tmp / "mcore"), m, dtype, a.device, lora, a.steps, a.reps)
            result[name] = spawn(case, 1, *args, device=a.device, threads=1)[0]
            print(f"[bench] {name}: {result[name]}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    full, lora = result["full"], result["lora"]
    ratios = ["trained_params", "train_step_s", "peak_mb", "ddma_pack_s"]
    result["lora_over_full"] = {k: lora[k] / full[k] for k in ratios}
    print(f"[bench] LoRA / full: {result['lora_over_full']}", flush=True)
    write_result(result, a.out or ROOT / f"tools/bench/results/lora_vs_full_{a.device}.json")


if __name__ == "__main__":
    sys.exit(main())
