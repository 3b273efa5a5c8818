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

``real_shapes``: the same device work at real layer shapes (:data:`REAL`: Llama-3-8B,
Llama-3-70B and Qwen3-30B-A3B, a few layers plus the embeddings, shards made on the GPU
from random values). Each side is timed over its whole loop of buckets (CUDA events, a
warm-up, the median of ``reps``): ``pack_GBps`` is payload bytes per second of the
sender's device time (gather, FP8 quantization, header and checksum), ``receive_GBps``
the receiver's (checksum and header checks deferred to one host sync at the end, as
rl/ddma/engine.py does into a staging copy; ``receive_immediate_GBps``: one host sync per
bucket, as into live weights). Rates are set against NVLink (450 GB/s a direction) and
a 400 Gb/s NIC (50 GB/s). The baseline, in the same run: ``*_per_piece_GBps``, the same
work without the bucket tables (rl/ddma/fused.py), and ``*_vs_per_piece`` the speed-ups.
``--smoke`` runs the same code on CPU at toy sizes:

    PYTHONPATH=. python tools/bench/weight_sync_device.py --smoke
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from rl.ddma import checksum as cks
from rl.ddma import fused, wire
from rl.ddma.plan import HEADER_BYTES, DstLayout, Plan, SrcLayout, make_plan, round_up
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
    """The device cases (fp32, bf16, FP8) on ``cuda:0``, then :func:`real_shapes`;
    ``trainer_shards(model, d, tp, rank)`` gives a TP rank's Megatron shards
    (tools/bench/weight_sync.py)."""
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
    result["real_shapes"] = real_shapes(dev, reps)
    return result


# ------------------------------------------------------------------ real layer shapes
GB = 1e9
NVLINK, NIC = 450 * GB, 50 * GB  # bytes/s a direction: H100/H200 NVLink; a 400 Gb/s NIC


@dataclass(frozen=True)
class Shape:
    dims: km.Dims
    src: SrcLayout
    dst: DstLayout
    bucket_bytes: int
    fp8_block: int | None = None
    full_layers: int = 0  # > 0: extrapolate one sync of the whole model (that many layers)


def _dims(layers, hidden, ffn, heads, groups, vocab, head_dim=128, **moe) -> km.Dims:
    return km.Dims(layers=layers, hidden=hidden, ffn=ffn, heads=heads, groups=groups,
                   head_dim=head_dim, vocab=vocab, padded_vocab=vocab, tied=False,
                   qkv_bias=False, **moe)  # fmt: skip


def _moe(experts: int, moe_ffn: int) -> dict:
    # Qwen3-MoE: QK norm, routed experts only (top-8 routing changes no tensor's shape).
    return {"qk_norm": True, "experts": experts, "moe_ffn": moe_ffn, "arch": "Qwen3MoeForCausalLM"}


def real_cases(smoke: bool = False) -> dict[str, Shape]:
    """Trainer TP4 -> SGLang TP2 at Llama-3-8B's shapes (4 layers), TP8 -> TP8 at
    Llama-3-70B's (2 layers), and Qwen3-30B-A3B (4 of its 48 layers) from trainer EP8
    (DP8, TP1) -> SGLang TP4; all with their embeddings and untied output layer, bf16.
    ``smoke``: the same layouts at toy sizes, for a CPU test of this code."""
    if smoke:  # block-aligned at every split, as the real shapes are
        b8, b70 = _dims(2, 256, 512, 8, 4, 1024, 32), _dims(1, 256, 512, 8, 8, 1024, 32)
        a3b = _dims(2, 128, 256, 8, 4, 1000, 32, **_moe(8, 64))
        big, small, block = 64 << 10, 8 << 10, 32
    else:
        b8, b70 = _dims(4, 4096, 14336, 32, 8, 128256), _dims(2, 8192, 28672, 64, 8, 128256)
        a3b = _dims(4, 2048, 6144, 32, 4, 151936, **_moe(128, 768))
        big, small, block = 512 * MB, 64 * MB, 128
    tp4_2, tp8_8 = (SrcLayout(4), DstLayout(2)), (SrcLayout(8), DstLayout(8))
    return {
        "8b_bf16_512mb": Shape(b8, *tp4_2, big),
        "8b_bf16_64mb": Shape(b8, *tp4_2, small),
        "8b_fp8_512mb": Shape(b8, *tp4_2, big, fp8_block=block),
        "70b_bf16_512mb": Shape(b70, *tp8_8, big),
        "30b_a3b_bf16": Shape(a3b, SrcLayout(1, dp=8, ep=8), DstLayout(4), big, full_layers=48),
    }


def _sig(x: float) -> float:
    return float(f"{x:.3g}")


def _timed(fn, dev: torch.device, reps: int) -> float:
    """Median seconds of ``reps`` calls after a warm-up, on the device's clock."""
    times = []
    for _ in range(reps + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _host(fn, dev: torch.device, reps: int) -> float:
    """Median host seconds to issue ``fn``'s work (the device may still be running it):
    near the device time, the side is bound by the host's time per bucket, not the GPU."""
    times = []
    for _ in range(reps + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return statistics.median(times[1:])


class _PerPiece:
    """The per-piece path in place of the bucket tables (rl/ddma/fused.py) and the
    checksum's own header epilogue: a torch copy per large piece, batched small ones, the
    torch FP8 quantizer, the header from pinned memory. The baseline, in the same run."""

    def __enter__(self) -> None:
        self.saved = fused.ENABLED, cks.WSUM.finish
        fused.ENABLED, cks.WSUM.finish = False, False

    def __exit__(self, *exc) -> None:
        fused.ENABLED, cks.WSUM.finish = self.saved


def real_case(shape: Shape, dev: torch.device, reps: int) -> dict:
    """One case's rates (see the module docstring); everything it allocates is freed."""
    dtype = torch.bfloat16
    plan = make_plan(shape.dims, shape.src, shape.dst, dtype.itemsize, shape.bucket_bytes,
                     fp8_block=shape.fp8_block)  # fmt: skip
    gen = torch.Generator(dev).manual_seed(0)
    shards: list[dict] = [{} for _ in range(plan.src.world)]  # what each rank sends from
    sources = 0  # elements read from the shards
    for b in plan.buckets:
        for p in b.pieces:
            held = plan.src_shapes[(p.key, p.layer)]
            sources += p.length * math.prod(held) // held[p.dim]
            if (p.key, p.layer) not in shards[b.src]:
                t = torch.randn(held, generator=gen, device=dev, dtype=dtype)
                shards[b.src][(p.key, p.layer)] = t
    getters = [lambda k, i, s=s: s[(k, i)] for s in shards]
    outs = [{n: torch.empty(s, device=dev, dtype=wire.dst_dtype(plan, n, dtype))
             for n, s in plan.dst_shapes.items()} for _ in range(plan.dst.tp)]  # fmt: skip
    payload = sum(plan.payload(b) for b in plan.buckets)
    bufs = [torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=dev) for _ in range(2)]

    def pack_all(into=None) -> None:
        for i, b in enumerate(plan.buckets):
            wire.pack(into[i] if into else bufs[i % 2], plan, b, getters[b.src], dtype, 1)

    # Every bucket's message kept (as a receiver's transport delivers them), to receive from.
    at = [0]
    for b in plan.buckets:
        at.append(at[-1] + round_up(b.nbytes, 256))
    store = torch.zeros(at[-1], dtype=torch.uint8, device=dev)  # gaps between pieces: 0
    msgs = [store[at[i] : at[i] + b.nbytes] for i, b in enumerate(plan.buckets)]
    pack_all(msgs)

    def receive_all(deferred: bool = True) -> None:
        check = wire.Deferred()
        for b, msg in zip(plan.buckets, msgs, strict=True):
            if deferred:
                check.add(msg, plan, b, 1)
            else:
                wire.verify(msg, plan, b, 1)
            wire.unpack(msg, plan, b, outs[b.dst].__getitem__, dtype)
        check.finish()

    kind = cks.for_device(dev)
    res: dict = {
        "buckets": len(plan.buckets),
        "bucket_bytes": plan.bucket_bytes,
        "pieces": sum(len(b.pieces) for b in plan.buckets),
        "payload_bytes": payload,
    }
    rates = {
        "pack": _timed(pack_all, dev, reps),
        "receive": _timed(receive_all, dev, reps),
        "receive_immediate": _timed(lambda: receive_all(False), dev, reps),
        "checksum": _timed(lambda: [kind.tensor(m[HEADER_BYTES:]) for m in msgs], dev, reps),
    }
    with _PerPiece():
        rates["pack_per_piece"] = _timed(pack_all, dev, reps)
        rates["receive_per_piece"] = _timed(receive_all, dev, reps)
        again = torch.zeros_like(store)
        pack_all([again[at[i] : at[i] + b.nbytes] for i, b in enumerate(plan.buckets)])
    for name, seconds in rates.items():
        res[f"{name}_GBps"] = _sig(payload / seconds / GB)
    for side in ("pack", "receive"):
        res[f"{side}_vs_per_piece"] = _sig(rates[f"{side}_per_piece"] / rates[side])
    n = len(plan.buckets)
    for name, fn in (("pack", pack_all), ("receive", receive_all)):
        res[f"{name}_us_per_bucket"] = _sig(rates[name] / n * 1e6)
        res[f"{name}_host_us_per_bucket"] = _sig(_host(fn, dev, reps) / n * 1e6)
    checksums = lambda: [kind.tensor(m[HEADER_BYTES:]) for m in msgs]  # noqa: E731
    res["checksum_host_us_per_bucket"] = _sig(_host(checksums, dev, reps) / n * 1e6)
    for side in ("pack", "receive"):
        res[f"{side}_over_nvlink"] = _sig(payload / rates[side] / NVLINK)
        res[f"{side}_over_nic"] = _sig(payload / rates[side] / NIC)
    if plan.fp8_block:  # the goal counts bf16 input: what the quantizer and copies read
        sources *= dtype.itemsize
        res["input_bytes"] = sources
        res["pack_input_GBps"] = _sig(sources / rates["pack"] / GB)
        res["pack_per_piece_input_GBps"] = _sig(sources / rates["pack_per_piece"] / GB)
    # The two paths' messages, headers included, byte for byte.
    res["same_bytes_as_per_piece_path"] = all(
        torch.equal(m, again[at[i] : at[i] + m.numel()]) for i, m in enumerate(msgs)
    )
    if shape.full_layers:
        res["full_model_extrapolated"] = _extrapolate(shape, plan, rates)
    if dev.type == "cuda":
        res["peak_gb"] = round(torch.cuda.max_memory_allocated(dev) / GB, 1)
    return res


def _extrapolate(shape: Shape, plan: Plan, rates: dict[str, float]) -> dict:
    """One sync of the whole model at the measured rates: not measured."""
    layer_bytes = sum(int(torch.Size(s).numel()) for s in km.hf_shapes(shape.dims).values())
    full = replace(shape.dims, layers=shape.full_layers)
    model = sum(int(torch.Size(s).numel()) for s in km.hf_shapes(full).values())
    payload = sum(plan.payload(b) for b in plan.buckets)
    model_bytes = payload + (model - layer_bytes) * plan.itemsize
    pack_s, recv_s = (model_bytes * rates[k] / payload for k in ("pack", "receive"))
    return {
        "note": f"EXTRAPOLATED, not measured: the {shape.full_layers}-layer model's bytes / "
        f"the rates measured at {shape.dims.layers} layers; one GPU doing every trainer "
        "rank's packing and one every server rank's receiving; a sync pipelines the two "
        "and the link, so it takes about the longest of the three",
        "layers": shape.full_layers,
        "model_bytes": model_bytes,
        "pack_s": _sig(pack_s),
        "receive_s": _sig(recv_s),
        "sync_s_over_nvlink": _sig(max(pack_s, recv_s, model_bytes / NVLINK)),
        "sync_s_over_nic": _sig(max(pack_s, recv_s, model_bytes / NIC)),
    }


def real_shapes(dev: torch.device, reps: int = 3, smoke: bool = False) -> dict:
    """Every case of :func:`real_cases`, one after another, each freed before the next."""
    out: dict = {}
    if dev.type == "cuda":
        torch.cuda.init()  # run on its own, the first peak reset would find no context
    for name, shape in real_cases(smoke).items():
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        try:
            out[name] = real_case(shape, dev, reps)
        except Exception as e:  # one case failing leaves the others' figures
            out[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        out[name]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(name, out[name], flush=True)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    import argparse
    import json

    ap = argparse.ArgumentParser(description="DDMA's device work at real layer shapes")
    ap.add_argument("--smoke", action="store_true", help="toy sizes (runs on CPU)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    where = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    print(json.dumps(real_shapes(where, args.reps, args.smoke), indent=1))
