"""DDMA on a CUDA device against a device-to-device copy of the same bytes, in one run.

    PYTHONPATH=. python tools/bench/weight_sync.py --device cuda

The ~125M-param Llama of tools/bench/weight_sync.py, its Megatron TP=2 shards on the GPU,
planned into SGLang TP=1 (a GPU layout). For every bucket of both trainer ranks, in one
process: pack (gather-copy, and the header's device checksum), verify (the checksum
again), scatter into destination tensors on the same GPU. This is the device work of a
co-located sync through CUDA IPC, where no byte crosses a wire; a transport (NCCL, CUDA
IPC) adds its own time on top.

FP8 (blockwise, from bf16) too: quantizing on the device is part of the pack.

Baseline: one ``copy_`` of all the buckets' bytes between two GPU buffers (the device's
copy bandwidth, measured in the same run). Reports bytes/s of each phase, the ratio of
DDMA's payload bandwidth to the copy's, the checksum's time against the copy time of the
same bytes, and the peak GPU memory the transfer allocated beyond what it started with,
in buckets.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from rl.ddma import checksum as cks
from rl.ddma import wire
from rl.ddma.plan import HEADER_BYTES, DstLayout, Plan, SrcLayout, make_plan
from rl.weights import keymap as km

MB = 1 << 20
UNFUSED = cks.WeightedSum(fused=False)  # the same sum in torch ops, for comparison


def _sync_time(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first is a warm-up


def _case(plan: Plan, shards: list[dict], dtype: torch.dtype, reps: int) -> dict:
    dev = torch.device("cuda", 0)
    out = {n: torch.zeros(s, device=dev, dtype=wire.dst_dtype(plan, n, dtype))
           for n, s in plan.dst_shapes.items()}  # fmt: skip
    buckets = [(r, b) for r in range(plan.src.world) for b in plan.sends(r)]
    wire_bytes = sum(b.nbytes for _, b in buckets)
    payload = sum(plan.payload(b) for _, b in buckets)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    buf = torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=dev)
    getters = [lambda k, i, s=s: s[(k, i)] for s in shards]

    def ddma():
        for r, b in buckets:
            msg = wire.pack(buf, plan, b, getters[r], dtype, 1)
            wire.verify(msg, plan, b, 1)
            wire.unpack(msg, plan, b, out.__getitem__, dtype)

    def phases() -> dict[str, float]:
        """Each phase of every bucket timed on its own (synchronised around it)."""
        took = dict.fromkeys(("pack", "checksum", "checksum_torch_ops", "verify", "unpack"), 0.0)
        steps = {
            "pack": lambda r, b: wire.pack(buf, plan, b, getters[r], dtype, 1),
            "checksum": lambda r, b: cks.WSUM.tensor(buf[HEADER_BYTES : b.nbytes]),
            "checksum_torch_ops": lambda r, b: UNFUSED.tensor(buf[HEADER_BYTES : b.nbytes]),
            "verify": lambda r, b: wire.verify(buf[: b.nbytes], plan, b, 1),
            "unpack": lambda r, b: wire.unpack(buf[: b.nbytes], plan, b, out.__getitem__, dtype),
        }
        for r, b in buckets:
            for name, step in steps.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(r, b)
                torch.cuda.synchronize()
                took[name] += time.perf_counter() - t0
        return took

    total = _sync_time(ddma, reps)
    peak_extra = torch.cuda.max_memory_allocated() - base
    # The copy baseline: the same bytes, one bucket-sized copy_ at a time between two GPU
    # buffers (what moving the packed buckets costs at the device's copy bandwidth).
    src, dst = torch.empty_like(buf), torch.empty_like(buf)

    def copy():
        for _, b in buckets:
            dst[: b.nbytes].copy_(src[: b.nbytes])

    copy_s = statistics.median(_sync_time(copy, reps))
    ddma_s = statistics.median(total)
    res = {
        "buckets": len(buckets),
        "bucket_bytes": plan.bucket_bytes,
        "wire_bytes": wire_bytes,
        "payload_bytes": payload,
        "ddma_s": round(ddma_s, 5),
        "ddma_payload_gbps": round(payload / ddma_s / 1e9, 1),
        "copy_s": round(copy_s, 5),
        "copy_gbps": round(wire_bytes / copy_s / 1e9, 1),
        "ddma_over_copy_bandwidth": round((payload / ddma_s) / (wire_bytes / copy_s), 3),
        "peak_extra_bytes": int(peak_extra),
        "peak_extra_buckets": round(peak_extra / plan.bucket_bytes, 2),
    }
    runs = [phases() for _ in range(reps + 1)][1:]
    for name in runs[0]:
        res[f"{name}_s"] = round(min(p[name] for p in runs), 5)
    # The checksum against copying the same bytes once (the bucket's copy time).
    res["checksum_over_copy_time"] = round(res["checksum_s"] / copy_s, 3)
    res["checksum_torch_ops_over_copy_time"] = round(res["checksum_torch_ops_s"] / copy_s, 3)
    return res


def run(model: Path, d: km.Dims, bucket_mb: int, reps: int, trainer_shards) -> dict:
    """The device cases (fp32, bf16, FP8) on ``cuda:0``; ``trainer_shards(model, d, tp,
    rank)`` gives a TP rank's Megatron shards (tools/bench/weight_sync.py)."""
    dev = torch.device("cuda", 0)
    result: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__}
    # FP8 in 64-row blocks: this model's query groups (192 rows: 3 heads of 64) cut 128-row
    # blocks, which the planner refuses (real FP8 checkpoints use 128).
    cases = {"fp32": (torch.float32, None, 2), "bf16": (torch.bfloat16, None, 2),
             "fp8_block64_from_bf16": (torch.bfloat16, 64, 2)}  # fmt: skip
    for name, (dtype, fp8, tp) in cases.items():
        plan = make_plan(d, SrcLayout(tp), DstLayout(1), dtype.itemsize, bucket_mb * MB,
                         fp8_block=fp8)  # fmt: skip
        shards = [{k: v.to(dev, dtype) for k, v in trainer_shards(model, d, tp, r).items()}
                  for r in range(tp)]  # fmt: skip
        try:
            result[name] = _case(plan, shards, dtype, reps)
        except Exception as e:  # one case failing leaves the others' figures
            result[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        print(name, result[name], flush=True)
        del shards
        torch.cuda.empty_cache()
    return result
