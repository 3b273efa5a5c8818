"""DDMA's device path on one CUDA GPU: packing, the device checksum, verification, FP8
quantization and the scatter all run where the shards lie, give bit-for-bit what the CPU
path gives (the CPU path is checked against SGLang's own weight loaders in
tests/servers/test_ddma_sglang_loaders.py), move no bucket through host memory, and a
bucket handed to another process as a CUDA IPC handle is verified and scattered there.
The Triton FP8 quantizer gives the torch quantizer's bytes, and packing and deferred
verification never wait for the device.

One GPU: NCCL refuses two ranks on one device, so the p2p group path needs two GPUs and is
not here; tools/gpu_check.sh says so when it finds one GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rl.ddma import checksum as cks
from rl.ddma import wire
from rl.ddma.plan import HEADER_BYTES, DstLayout, Plan, SrcLayout, make_plan
from tests.helpers.ddma_util import hf_state, megatron_globals, megatron_shards, model_dims
from tests.helpers.hf_models import make_model

CUDA = torch.device("cuda", 0)
SIZES = [13, 4096 + 5, (2 * cks.CHUNK_WORDS + 3) * 4 + 3, 40 * cks.CHUNK_WORDS * 4 + 1]


def test_wsum_is_the_same_on_cuda_and_cpu_and_sees_a_flipped_byte():
    """The Triton kernel, torch's ops on CUDA and torch's ops on CPU agree exactly."""
    from rl.ddma import checksum_triton  # noqa: F401  (the fused path must exist on GPU)

    torch_ops = cks.WeightedSum(fused=False)
    g = torch.Generator().manual_seed(0)
    for n in SIZES:
        x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        y = x.to(CUDA)
        want = cks.WSUM(x)
        assert cks.WSUM(y) == torch_ops(y) == want, n
        y[n // 2] ^= 0x08
        assert cks.WSUM(y) != want and torch_ops(y) != want, n
    assert cks.for_device(CUDA) is cks.WSUM


def _getter(shards: dict) -> wire.SrcGetter:
    return lambda key, layer: shards[(key, layer)]


def _transfer(plan: Plan, glob: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """Every source rank packs its buckets on ``device``; the destination verifies and
    scatters each into tensors on ``device``."""
    out = {n: torch.zeros(s, device=device, dtype=wire.dst_dtype(plan, n, torch.float32))
           for n, s in plan.dst_shapes.items()}  # fmt: skip
    buf = torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=device)
    for rank in range(plan.src.world):
        shards = {k: v.to(device) for k, v in megatron_shards(glob, plan, rank).items()}
        for b in plan.sends(rank):
            msg = wire.pack(buf, plan, b, _getter(shards), torch.float32, 5)
            wire.verify(msg, plan, b, 5)
            wire.unpack(msg, plan, b, out.__getitem__, torch.float32)
    wire.zero_fill(plan, 0, out.__getitem__)
    return out


def _plan(path: Path, fp8_block: int | None) -> tuple[Plan, dict]:
    """Megatron TP=2 -> SGLang TP=1 (a GPU layout), and the trainer's global tensors."""
    d = model_dims(path, src_tp=2)
    plan = make_plan(d, SrcLayout(2), DstLayout(1), 4, 3000, fp8_block=fp8_block)
    return plan, megatron_globals(hf_state(path), d)


def _plans(tmp_path: Path) -> list[tuple[Plan, dict]]:
    path = make_model("llama", tmp_path / "llama")
    return [_plan(path, None), _plan(path, 8)]


def test_pack_verify_scatter_on_cuda_equal_the_cpu_path_bit_for_bit(tmp_path):
    for plan, glob in _plans(tmp_path):
        want = _transfer(plan, glob, torch.device("cpu"))
        got = _transfer(plan, glob, CUDA)
        for name, t in want.items():
            g = got[name]
            assert g.device.type == "cuda", name
            assert torch.equal(g.cpu().view(torch.uint8), t.view(torch.uint8)), name


def test_no_bucket_goes_through_host_memory(tmp_path):
    """Only headers and checksums (a few bytes each) cross to the host, never a payload:
    the device-to-host copies in the profiler's trace total at most 128 bytes per bucket."""
    import json

    from torch.profiler import ProfilerActivity, profile

    plan, glob = _plans(tmp_path)[1]
    _transfer(plan, glob, CUDA)  # warm-up: weights cached, kernels loaded
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        _transfer(plan, glob, CUDA)
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    copies = [e for e in events if "DtoH" in e.get("name", "")]
    moved = sum(int(e.get("args", {}).get("bytes", 0)) for e in copies)
    buckets = len(plan.buckets)
    print(f"{len(copies)} device-to-host copies, {moved} bytes, for {buckets} buckets")
    assert copies and all("bytes" in e.get("args", {}) for e in copies), copies[:3]
    assert moved <= 128 * buckets, (moved, buckets)


def _ipc_receiver(path: str, queue, results) -> None:
    """Another process: map each bucket from its CUDA IPC handle, verify, scatter."""
    plan, _ = _plan(Path(path), None)
    out = {n: torch.zeros(s, device=CUDA, dtype=wire.dst_dtype(plan, n, torch.float32))
           for n, s in plan.dst_shapes.items()}  # fmt: skip
    seen = 0
    while (item := queue.get()) is not None:
        index, msg = item
        b = plan.buckets[index]
        wire.verify(msg, plan, b, 9)
        wire.unpack(msg, plan, b, out.__getitem__, torch.float32)
        seen += 1
        del msg
        results.put(("ack", index))
    wire.zero_fill(plan, 0, out.__getitem__)
    torch.cuda.synchronize()
    # Bytes, not tensors: a CPU tensor would travel as a file descriptor that this process,
    # having exited, could no longer hand over.
    results.put(("done", seen, {n: t.cpu().view(torch.uint8).numpy().tobytes()
                                for n, t in out.items()}))  # fmt: skip


def test_a_bucket_shared_as_a_cuda_ipc_handle_is_scattered_in_another_process(tmp_path):
    path = make_model("llama", tmp_path / "llama")
    plan, glob = _plan(path, None)
    want = _transfer(plan, glob, torch.device("cpu"))
    ctx = mp.get_context("spawn")
    queue, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_receiver, args=(str(path), queue, results))
    child.start()
    try:
        slots = [torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=CUDA) for _ in range(2)]
        sent = 0
        for rank in range(plan.src.world):
            shards = {k: v.to(CUDA) for k, v in megatron_shards(glob, plan, rank).items()}
            for b in plan.sends(rank):
                if sent >= 2:  # the slot is free once the receiver has scattered from it
                    assert results.get(timeout=120)[0] == "ack"
                msg = wire.pack(slots[sent % 2], plan, b, _getter(shards),
                                torch.float32, 9)  # fmt: skip
                torch.cuda.current_stream().synchronize()  # packed before the handle goes
                queue.put((b.index, msg))
                sent += 1
        queue.put(None)
        while (item := results.get(timeout=120))[0] == "ack":
            pass
        _, seen, got = item
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert seen == sent == len(plan.buckets)
    for name, t in want.items():
        assert got[name] == t.view(torch.uint8).numpy().tobytes(), name


def test_triton_fp8_quantizer_is_bit_identical_to_the_torch_one_on_cuda():
    """rl/ddma/fp8_triton.py against rl/ddma/fp8.py on CUDA and on CPU: partial edge blocks,
    a TP column slice, a transposed view, bf16 and fp32, every e4m3 value and the ties
    between them at a scale of 1 and scaled (here ``div_rn`` is the hardware's, not numpy's
    as in tests/unit/test_ddma_triton.py)."""
    from rl.ddma import fp8, fp8_triton, kernels

    assert kernels.for_tensor("fp8_triton", torch.empty(1, device=CUDA)) is fp8_triton
    g = torch.Generator().manual_seed(0)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[~grid.isnan()].unique()
    edges = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([1e-40, -0.0])])
    e = torch.zeros(-(-edges.numel() // 128) * 128)
    e[: edges.numel()] = edges
    e = e.view(-1, 128)
    e[:, 0] = 448.0
    cases = [torch.randn(1536, 4096, generator=g) * 0.02, torch.randn(300, 2 * 130, generator=g)]
    cases += [cases[1][:, 3:133], cases[1].t()[5:200], e, e * 1e-6, e * 3.0, torch.zeros(130, 7)]
    for w in cases:
        for dtype in (torch.bfloat16, torch.float32):
            x = w.to(dtype)
            want_q, want_s = fp8.quantize_blockwise(x, 128)  # CPU
            cuda_q, cuda_s = fp8.quantize_blockwise(x.to(CUDA), 128)
            q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=CUDA)
            s = torch.empty(fp8.scale_shape(tuple(x.shape)), dtype=torch.float32, device=CUDA)
            fp8_triton.quantize_into(x.to(CUDA), q, s, 128)
            for got in (q, cuda_q):
                assert torch.equal(got.cpu().view(torch.uint8), want_q.view(torch.uint8))
            for got in (s, cuda_s):
                assert torch.equal(got.cpu().view(torch.int32), want_s.view(torch.int32))


def test_pack_and_deferred_receive_never_wait_for_the_device_and_catch_a_flipped_byte(tmp_path):
    """Every bucket packed, checked (deferred) and scattered with no host sync (torch's
    sync debug mode raises on one), then one sync at the end names the flipped byte's
    bucket exactly as an immediate verify does."""
    for plan, glob in _plans(tmp_path):
        want = _transfer(plan, glob, torch.device("cpu"))
        out = {n: torch.zeros(s, device=CUDA, dtype=wire.dst_dtype(plan, n, torch.float32))
               for n, s in plan.dst_shapes.items()}  # fmt: skip
        shards = [{k: v.to(CUDA) for k, v in megatron_shards(glob, plan, r).items()}
                  for r in range(plan.src.world)]  # fmt: skip
        msgs = [torch.zeros(plan.bucket_bytes, dtype=torch.uint8, device=CUDA)
                for _ in plan.buckets]  # fmt: skip
        _transfer(plan, glob, CUDA)  # warm-up: tables cached, kernels compiled
        torch.cuda.synchronize()
        check = wire.Deferred()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for b, msg in zip(plan.buckets, msgs, strict=True):
                wire.pack(msg, plan, b, _getter(shards[b.src]), torch.float32, 5)
            for b, msg in zip(plan.buckets, msgs, strict=True):
                check.add(msg[: b.nbytes], plan, b, 5)
                wire.unpack(msg[: b.nbytes], plan, b, out.__getitem__, torch.float32)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        check.finish()
        wire.zero_fill(plan, 0, out.__getitem__)
        for name, t in want.items():
            assert torch.equal(out[name].cpu().view(torch.uint8), t.view(torch.uint8)), name
        bad = plan.buckets[len(plan.buckets) // 2]
        msgs[bad.index][HEADER_BYTES + 3] ^= 0x04
        with pytest.raises(wire.BucketError, match="wsum checksum mismatch") as now:
            wire.verify(msgs[bad.index][: bad.nbytes], plan, bad, 5)
        for b, msg in zip(plan.buckets, msgs, strict=True):
            check.add(msg[: b.nbytes], plan, b, 5)
        with pytest.raises(wire.BucketError) as later:
            check.finish()
        assert str(later.value) == str(now.value)


def _send_and_receive(plan: Plan, shards: list[dict], tables: bool) -> list[torch.Tensor]:
    """Every bucket packed, checked (deferred) and scattered on CUDA, with the bucket
    tables or without; every message, then every destination tensor."""
    from rl.ddma import fused

    dtype = torch.bfloat16
    msgs = [torch.zeros(plan.bucket_bytes, dtype=torch.uint8, device=CUDA) for _ in plan.buckets]
    outs = [{n: torch.zeros(s, device=CUDA, dtype=wire.dst_dtype(plan, n, dtype))
             for n, s in plan.dst_shapes.items()} for _ in range(plan.dst.tp)]  # fmt: skip
    fused.ENABLED = cks.WSUM.finish = tables
    try:
        check = wire.Deferred()
        for b, msg in zip(plan.buckets, msgs, strict=True):
            wire.pack(msg, plan, b, _getter(shards[b.src]), dtype, 5)
            check.add(msg[: b.nbytes], plan, b, 5)
            wire.unpack(msg[: b.nbytes], plan, b, outs[b.dst].__getitem__, dtype)
        check.finish()
    finally:
        fused.ENABLED = cks.WSUM.finish = True
    return msgs + [t.view(torch.uint8) for out in outs for t in out.values()]


def test_bucket_tables_give_the_per_piece_paths_bytes_on_cuda():
    """rl/ddma/fused.py's copy and quantizer tables, and the checksum kernel's own header,
    against the per-piece path (a torch copy a piece, the torch quantizer, the header from
    pinned memory): every message and every destination byte for byte, at the device
    benchmark's layouts at toy sizes (TP gathers and scatters, FP8, a MoE layer's experts)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "bench"))
    import weight_sync_device as bench

    g = torch.Generator(CUDA).manual_seed(0)
    for name, shape in bench.real_cases(smoke=True).items():
        plan = make_plan(shape.dims, shape.src, shape.dst, 2, shape.bucket_bytes,
                         fp8_block=shape.fp8_block)  # fmt: skip
        shards = [{k: torch.randn(s, generator=g, device=CUDA).to(torch.bfloat16)
                   for k, s in plan.src_shapes.items()} for _ in range(plan.src.world)]  # fmt: skip
        got = _send_and_receive(plan, shards, tables=True)
        want = _send_and_receive(plan, shards, tables=False)
        for i, (x, y) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(x, y), (name, i)
