"""DDMA's Triton kernels on CPU, and its checks deferred to the end of a sync.

The kernels (rl/ddma/fp8_triton.py, rl/ddma/checksum_triton.py) run under Triton's
interpreter, in one child process (``TRITON_INTERPRET`` is read when a kernel is defined,
so it must be set before the modules are imported, which this session may have done),
bit-exact against the torch path they replace on CUDA. The interpreter divides exactly
either way, so ``div_rn`` against ``/`` is for tests/gpu to tell apart.

Deferred verification (rl/ddma/wire.py ``Deferred``, rl/ddma/engine.py into a staging
copy) raises at the end what per-bucket verification raises at once, on CPU tensors. And
the real-shape device benchmark runs at toy sizes on CPU. Seconds in all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl.ddma import engine, wire
from rl.ddma.plan import HEADER_BYTES, DstLayout, SrcLayout, make_plan
from rl.weights import keymap as km

ROOT = Path(__file__).resolve().parents[2]
D = km.Dims(
    layers=2, hidden=64, ffn=256, heads=4, groups=2, head_dim=16, vocab=512,
    padded_vocab=512, tied=False, qkv_bias=False,
)  # fmt: skip


def _shards(plan, dtype=torch.float32, seed=0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{k: torch.randn(s, generator=g).to(dtype) for k, s in plan.src_shapes.items()}
            for _ in range(plan.src.world)]  # fmt: skip


# ------------------------------------------------------------------ the interpreted kernels
def _check_equal(got: torch.Tensor, want: torch.Tensor, what: str, errors: list[str]) -> None:
    got, want = got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)
    if not torch.equal(got, want):
        at = (got != want).nonzero()[0].tolist()
        errors.append(f"{what}: differs at byte {at}: {got[tuple(at)]} != {want[tuple(at)]}")


def _quantize(w: torch.Tensor, block: int, errors: list[str], what: str) -> None:
    """The Triton quantizer against rl/ddma/fp8.py's, into views of one buffer."""
    from rl.ddma import fp8, fp8_triton

    rows, cols = w.shape
    srows, scols = fp8.scale_shape((rows, cols), block)
    buf = torch.full((rows * cols + 4 * srows * scols + 64,), 0xAB, dtype=torch.uint8)
    q = buf[: rows * cols].view(torch.float8_e4m3fn).view(rows, cols)
    at = -(-rows * cols // 4) * 4
    s = buf[at : at + 4 * srows * scols].view(torch.float32).view(srows, scols)
    fp8_triton.quantize_into(w, q, s, block)
    want_q, want_s = fp8.quantize_blockwise(w, block)
    _check_equal(q, want_q, f"{what} q", errors)
    _check_equal(s, want_s, f"{what} scale_inv", errors)


def _fp8_shapes(errors: list[str]) -> None:
    """Partial edge blocks, blocks of 8 to 128, bf16/fp16/fp32, and a TP column slice."""
    g = torch.Generator().manual_seed(0)
    dtypes = {300: (torch.float32, torch.bfloat16), 1: (torch.float16,)}
    for rows, cols, block in [(300, 130, 128), (37, 50, 16), (1, 1, 8), (64, 72, 32)]:
        for dtype in dtypes.get(rows, (torch.bfloat16,)):
            w = (torch.randn(rows, cols * 2, generator=g) * 0.02).to(dtype)
            _quantize(w[:, :cols].contiguous(), block, errors, f"{dtype} {rows}x{cols}/{block}")
            _quantize(w[:, 3 : 3 + cols], block, errors, f"{dtype} slice {rows}x{cols}/{block}")
    t = torch.randn(200, 150, generator=g).t()[3:140]  # column-major: no stride of 1 on a row
    _quantize(t, 64, errors, "transposed")


def _e4m3_edges() -> torch.Tensor:
    """Every e4m3 value, the midpoints between them (ties go to even) and their float32
    neighbours, signed zeros, float32 subnormals."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[~grid.isnan()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    up, down = torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)
    extra = torch.tensor([448.0, -448.0, 447.9, 1e-40, -1e-40, 0.0, -0.0, 2**-10, 3 * 2**-10])
    return torch.cat([grid, mids, up, down, extra])


def _fp8_values(errors: list[str]) -> None:
    """:func:`_e4m3_edges` in 128-blocks whose amax is 448 (a scale of exactly 1), scaled
    from 1e-38 (under the amax floor) up to 1e30; all-zero blocks."""
    x = _e4m3_edges()
    w = torch.zeros(-(-x.numel() // 128) * 128)
    w[: x.numel()] = x
    w = w.view(-1, 128)
    w[:, 0] = 448.0
    w = torch.cat([w, torch.zeros(130, 128)])  # whole blocks of zeros below
    for f in (1.0, 1e-38, 1e-6, 1e-4 / 448, 3.0, 1e30):
        for dtype in (torch.float32, torch.bfloat16):
            _quantize((w * f).to(dtype), 128, errors, f"grid x {f} {dtype}")
    _quantize(torch.full((5, 7), 1e-5), 8, errors, "under the amax floor")


def _e4m3_sweep(errors: list[str]) -> None:
    """The cast on its own (clamp, rounding, subnormals, NaN) over a million float32 bit
    patterns of every sign and exponent and :func:`_e4m3_edges`, against torch's clamp and
    cast."""
    global fp8_triton  # a kernel looks its names up among its module's globals
    import triton
    import triton.language as tl

    from rl.ddma import fp8_triton

    @triton.jit
    def cast(y_ptr, out_ptr, n, MAX_BITS: tl.constexpr, BLOCK: tl.constexpr):
        at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        y = tl.load(y_ptr + at, mask=at < n, other=0.0)
        q = fp8_triton._e4m3_bits(y, MAX_BITS)
        tl.store(out_ptr + at, q.to(tl.uint8), mask=at < n)

    bits = torch.arange(0, 1 << 32, 4093, dtype=torch.int64)
    y = ((bits & 0x7FFFFFFF) - (bits & 0x80000000)).to(torch.int32).view(torch.float32)
    big = torch.tensor([float("inf"), -float("inf"), float("nan"), 480.0, 464.0, -1e9])
    y = torch.cat([y, _e4m3_edges(), big])
    out = torch.empty(y.numel(), dtype=torch.uint8)
    cast[(triton.cdiv(y.numel(), 1 << 16),)](y, out, y.numel(), MAX_BITS=fp8_triton._MAX_BITS,
                                              BLOCK=1 << 16)  # fmt: skip
    _check_equal(out, y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn), "e4m3 sweep", errors)


def _tables(on: bool) -> None:
    """The kernels on host tensors (``on``), else every piece through torch's copies."""
    from rl.ddma import kernels

    kernels.ON_HOST = on


FUSED_CASES = {  # name: dims, layouts, transfer dtype, FP8 block, bucket bytes
    "bf16 tp2 -> tp1 (strided scatter)": (D, SrcLayout(2), DstLayout(1), torch.bfloat16, None,
                                          1 << 14),
    "fp32 tp1 -> tp2 (strided gather)": (D, SrcLayout(1), DstLayout(2), torch.float32, None,
                                         1 << 15),
    "fp8 tp2 -> tp1": (km.Dims(**{**D.__dict__, "layers": 1, "hidden": 32, "ffn": 64,
                                  "heads": 2}), SrcLayout(2), DstLayout(1), torch.bfloat16, 16,
                       1 << 12),
    "moe ep2 -> tp2": (km.Dims(**{**D.__dict__, "layers": 1, "experts": 4, "moe_ffn": 32,
                                  "qk_norm": True, "arch": "Qwen3MoeForCausalLM"}),
                       SrcLayout(1, dp=2, ep=2), DstLayout(2), torch.bfloat16, None, 1 << 13),
    "fp8, rows of 24 (not dense)": (km.Dims(**{**D.__dict__, "layers": 1, "hidden": 24,
                                               "ffn": 48, "heads": 2, "head_dim": 16}),
                                    SrcLayout(1), DstLayout(1), torch.float32, 8, 1 << 12),
    "odd sizes (2-byte units)": (km.Dims(**{**D.__dict__, "layers": 1, "hidden": 34, "ffn": 70,
                                            "heads": 2, "head_dim": 17, "vocab": 101,
                                            "padded_vocab": 101}),
                                 SrcLayout(1), DstLayout(1), torch.bfloat16, None, 1 << 12),
}  # fmt: skip


def _transfer_all(plan, shards, dtype, buf, kept, outs) -> tuple[list[torch.Tensor], dict]:
    """Every bucket packed into one reused buffer, kept in its own buffer of ``kept`` (as
    a receiver's ring), and scattered from there into ``outs`` (per destination rank);
    all refilled first. The messages and destinations, copied."""
    buf.fill_(0xAB)
    msgs = []
    for b, keep in zip(plan.buckets, kept, strict=True):
        get = lambda k, i, s=shards[b.src]: s[(k, i)]  # noqa: E731
        msgs.append(keep[: b.nbytes].copy_(wire.pack(buf, plan, b, get, dtype, 3)))
    for out in outs:
        for t in out.values():
            t.fill_(7.0)
    for b, msg in zip(plan.buckets, msgs, strict=True):
        wire.verify(msg, plan, b, 3)
        wire.unpack(msg, plan, b, outs[b.dst].__getitem__, dtype)
    got = {(r, n): t.clone() for r, out in enumerate(outs) for n, t in out.items()}
    return [m.clone() for m in msgs], got


def _fused(errors: list[str]) -> None:
    """rl/ddma/fused.py's tables through the copy kernel and the table quantizer give the
    torch path's messages and destinations byte for byte: TP gathers and scatters of column
    slices, FP8 data and scales, a MoE layer's expert slices, sizes that take 2-byte units;
    a buffer reused with another bucket's stale bytes; the cache reused while the sources
    stay, rebuilt when a getter hands out new tensors (LoRA's merged shards)."""
    from rl.ddma import fused

    units, quantized = set(), set()
    for name, (d, src, dst, dtype, block, size) in FUSED_CASES.items():
        plan = make_plan(d, src, dst, dtype.itemsize, size, fp8_block=block)
        shards = _shards(plan, dtype)
        buf = torch.empty(plan.bucket_bytes, dtype=torch.uint8)
        kept = [torch.empty_like(buf) for _ in plan.buckets]
        outs = [{n: torch.empty(s, dtype=wire.dst_dtype(plan, n, dtype))
                 for n, s in plan.dst_shapes.items()} for _ in range(plan.dst.tp)]  # fmt: skip
        _tables(False)
        want_msgs, want = _transfer_all(plan, shards, dtype, buf, kept, outs)
        _tables(True)
        fused._JOBS.clear()
        jobs = []
        for attempt in ("built", "cached", "new sources"):
            if attempt == "new sources":
                shards = [{k: v.clone() for k, v in s.items()} for s in shards]
            msgs, got = _transfer_all(plan, shards, dtype, buf, kept, outs)
            jobs.append(len(fused._JOBS))
            for b, m, w in zip(plan.buckets, msgs, want_msgs, strict=True):
                _check_equal(m, w, f"{name} ({attempt}): bucket {b.index}", errors)
            for k in want:
                _check_equal(got[k], want[k], f"{name} ({attempt}): {k}", errors)
        n = len(plan.buckets)  # a pack and an unpack job each, then n more packs
        if jobs != [2 * n, 2 * n, 3 * n]:
            errors.append(f"{name}: {jobs} jobs after each pass over {n} buckets")
        units |= {u for j in fused._JOBS.values() for *_, u in j.copies}
        quantized |= {q[-1] for j in fused._JOBS.values() for q in j.quants}
        rest = sum(len(j.rest) for j in fused._JOBS.values())
        if rest:
            errors.append(f"{name}: {rest} places left to torch")
    _tables(False)
    dense = {d for _, d in quantized}
    if not {2, 16} <= units or dense != {True, False}:
        errors.append(f"the cases cover copy units {units} and quantizer groups {quantized}")


def _wsum_finish(errors: list[str]) -> None:
    """The checksum kernel's own epilogue: the sender's header stamped with the sum, the
    receiver's row of header and sum, equal to the torch ops' sum; its scratch left zero
    for the next launch; a payload of partial words declined."""
    from rl.ddma import checksum as cks
    from rl.ddma import checksum_triton

    checksum_triton.BLOCK = 128  # more programs from fewer words (the interpreter is slow)
    _tables(True)
    g = torch.Generator().manual_seed(2)
    for n in (4, 1024, 4 * 128 * 7 + 4):
        body = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        values = (wire.MAGIC_WSUM, -(2**62) + 5, 3, n, n + 64, 0, 1, 2**40)
        head = torch.zeros(8, dtype=torch.int64)
        row = torch.zeros(9, dtype=torch.int64)
        took = cks.WSUM.stamp(body, head, values) and cks.WSUM.row(body, head, row)
        want = [*values[:5], cks.WeightedSum(fused=False)(body), *values[6:]]
        if not took or head.tolist() != want or row.tolist() != [*want, want[5]]:
            errors.append(f"{n} bytes: {took} {head.tolist()} {row.tolist()} != {want}")
        scratch = cks.WSUM._scratch(body.device)
        if scratch.tolist() != [0, 0]:
            errors.append(f"{n} bytes: scratch left at {scratch.tolist()}")
    odd = torch.zeros(6, dtype=torch.uint8)
    if cks.WSUM.stamp(odd, torch.zeros(8, dtype=torch.int64), (0,) * 8):
        errors.append("a payload of 6 bytes taken by the kernel")
    _tables(False)


def _wsum(errors: list[str]) -> None:
    """The checksum kernel: sums that wrap, across programs, chunks and the factor table."""
    from rl.ddma import checksum as cks
    from rl.ddma import checksum_triton

    g = torch.Generator().manual_seed(1)

    def rand(n: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, generator=g)

    tables = cks.WSUM.weights(torch.device("cpu")), torch.tensor(cks._CHUNK_FACTOR)
    checksum_triton.BLOCK = 128  # more programs from fewer words (the interpreter is slow)
    for n, chunk, nf in [(1, 64, 8), (700, 64, 2), (300, 1 << 20, 4096)]:
        words = rand(n)
        w, f = (rand(chunk), rand(nf)) if chunk < cks.CHUNK_WORDS else tables
        w, f = w.to(torch.int32), f.to(torch.int32)
        out = torch.zeros((), dtype=torch.int32)
        checksum_triton.words_sum(words, w, f, out)
        i = torch.arange(n)
        want = (words.long() * w[i % chunk].long() * f[(i // chunk) % nf].long()).sum()
        if (int(out) - int(want)) % 2**32:
            errors.append(f"wsum of {n} words (chunk {chunk}): {int(out)} != {int(want)}")


CHECKS = {f.__name__[1:]: f for f in (_fp8_shapes, _fp8_values, _e4m3_sweep, _fused, _wsum,
                                      _wsum_finish)}  # fmt: skip


@pytest.fixture(scope="module")
def interpreted() -> dict[str, list[str]]:
    """Each check's mismatches, from one interpreted child process."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, __file__], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", list(CHECKS))
def test_kernel_is_bit_exact_under_the_interpreter(interpreted, check):
    assert check in interpreted, interpreted
    assert interpreted[check] == [], interpreted[check][:5]


# ------------------------------------------------------------------ compiled for a GPU
def _ptx(fn, signature: dict[str, str], constants: dict, warps: int = 4) -> str:
    """``fn`` compiled for Hopper (sm_90) by Triton and the ptxas it ships: no GPU needed."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**signature, **dict.fromkeys(constants, "constexpr")}
    src = ASTSource(fn=fn, signature=sig, constexprs=constants)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm[
        "ptx"
    ]


def test_kernels_compile_for_hopper_and_move_16_byte_vectors():
    """What the interpreter cannot show: every kernel variant compiles for a GPU, and the
    table kernels, whose addresses Triton reads from memory and so cannot analyse, still
    load and store 16-byte vectors where their hints say they may (as the per-piece
    quantizer does from its arguments' specialisation); without the hints they were 2- and
    8-byte scalar accesses."""
    import triton.language as tl

    from rl.ddma import checksum_triton, copy_triton, fp8_triton

    table = {"tab_ptr": "*i64", "map_at": "i64"}
    for unit, t in copy_triton.UNITS.items():
        consts = {"UNIT": t, "PAIRS": unit == 16, "R": copy_triton.ROWS, "C": copy_triton.COLS}
        ptx = _ptx(copy_triton._copy, table, consts)
        if unit == 16:
            assert "ld.global.v2.b64" in ptx and "st.global.v2.b64" in ptx
    meta = fp8_triton._meta(128)
    warps = meta.pop("num_warps")
    for x in (tl.bfloat16, tl.float32):
        for dense in (True, False):
            ptx = _ptx(fp8_triton._quantize_table, table, {"X": x, "DENSE": dense, **meta}, warps)
            if dense and x == tl.bfloat16:
                assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    words = {"x_ptr": "*i32", "w_ptr": "*i32", "f_ptr": "*i32", "out_ptr": "*i64", "n": "i32",
             "per_program": "i32", "scratch_ptr": "*i32", "programs": "i32", "length": "i32",
             "head_ptr": "*i64", **dict.fromkeys(["h0", "h1", "h2", "h3", "h4", "h6", "h7"],
                                                 "i64")}  # fmt: skip
    for finish in (0, 1, 2):
        consts = {"CHUNK": 1 << 20, "FACTORS": 4096, "BLOCK": 2048, "FINISH": finish}
        assert "atom.global" in _ptx(checksum_triton._wsum, words, consts)


# ------------------------------------------------------------------ deferred verification
def _packed(plan, version: int = 3) -> list[torch.Tensor]:
    shards = _shards(plan)
    return [wire.pack(torch.zeros(plan.bucket_bytes, dtype=torch.uint8), plan, b,
                      lambda k, i, s=shards[b.src]: s[(k, i)], torch.float32, version).clone()
            for b in plan.buckets]  # fmt: skip


PLAN = make_plan(D, SrcLayout(2), DstLayout(1), 4, 1 << 13)


def _flip_payload(msg: torch.Tensor) -> None:
    msg[HEADER_BYTES + 5] ^= 0x10


def _other_version(msg: torch.Tensor) -> None:
    msg[:HEADER_BYTES].view(torch.int64)[2] += 1


def _other_plan(msg: torch.Tensor) -> None:
    msg[:HEADER_BYTES].view(torch.int64)[1] ^= 1


def _lost(msg: torch.Tensor) -> None:
    wire.write_lost(msg, PLAN.buckets[0])


FAULTS = [_flip_payload, _other_version, _other_plan, _lost]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__[1:])
def test_deferred_raises_at_the_end_what_verify_raises_at_once(fault):
    msgs = _packed(PLAN)
    bad = 1
    fault(msgs[bad])
    b = PLAN.buckets[bad]
    with pytest.raises(wire.BucketError) as now:
        wire.verify(msgs[bad][: b.nbytes], PLAN, b, 3)
    check = wire.Deferred()
    for b, msg in zip(PLAN.buckets, msgs, strict=True):
        check.add(msg[: b.nbytes], PLAN, b, 3)  # raises nothing yet
    assert len(check) == len(PLAN.buckets)
    with pytest.raises(wire.BucketError) as later:
        check.finish()
    assert type(later.value) is type(now.value)
    assert str(later.value) == str(now.value)
    check.finish()  # what was added is checked once


def test_deferred_names_the_first_bad_bucket_and_passes_good_ones():
    msgs = _packed(PLAN)
    check = wire.Deferred()
    for b, msg in zip(PLAN.buckets, msgs, strict=True):
        check.add(msg[: b.nbytes], PLAN, b, 3)
    check.finish()  # all good
    _other_version(msgs[2])
    _flip_payload(msgs[1])
    for b, msg in zip(PLAN.buckets, msgs, strict=True):
        check.add(msg[: b.nbytes], PLAN, b, 3)
    with pytest.raises(wire.BucketError, match=r"^bucket 1 .*xxh3 checksum mismatch"):
        check.finish()


def test_deferred_header_only_ignores_the_payload_not_the_version():
    msgs = _packed(PLAN)
    _flip_payload(msgs[0])
    check = wire.Deferred()
    check.add(msgs[0][: PLAN.buckets[0].nbytes], PLAN, PLAN.buckets[0], 3, payload=False)
    check.finish()
    check.add(msgs[0][: PLAN.buckets[0].nbytes], PLAN, PLAN.buckets[0], 4, payload=False)
    with pytest.raises(wire.BucketError, match="carries version 3, expected 4"):
        check.finish()


def _receive(monkeypatch, msgs, staged: bool) -> tuple[dict[str, torch.Tensor], Exception | None]:
    """rl.ddma.engine.receive of destination rank 0, the group faked: each bucket arrives
    the moment its receive is posted. ``staged``: into a staging copy, checks deferred
    (as on a device; on the host the engine checks at once)."""
    sent = {engine.where(b): m for b, m in zip(PLAN.buckets, msgs, strict=True)}

    def post(op, tensor, peer, group, what, role):
        tensor.copy_(sent[what][: tensor.numel()])
        return object()

    monkeypatch.setattr(engine, "post", post)
    monkeypatch.setattr(engine, "wait", lambda *a: None)
    monkeypatch.setattr(engine, "_deferrable", lambda t, d: isinstance(t, engine.Staged))
    out = {n: torch.full(s, 7.0) for n, s in PLAN.dst_shapes.items()}
    get = engine.Staged(out.__getitem__) if staged else out.__getitem__
    try:
        engine.receive(PLAN, 0, get, 3, torch.float32, None, [0, 1])
    except Exception as e:
        return out, e
    return out, None


@pytest.mark.parametrize("fault", [None, *FAULTS], ids=lambda f: f.__name__[1:] if f else "ok")
def test_engine_into_a_staging_copy_checks_at_the_end(monkeypatch, fault):
    msgs = _packed(PLAN)
    if fault is not None:
        fault(msgs[1])
    now, e_now = _receive(monkeypatch, msgs, staged=False)
    later, e_later = _receive(monkeypatch, msgs, staged=True)
    if fault is None:
        assert e_now is None and e_later is None
        assert all(torch.equal(now[n], later[n]) for n in now)
        return
    assert type(e_later) is type(e_now) and str(e_later) == str(e_now)
    if fault is _lost:
        assert isinstance(e_later, engine.UpstreamLost)
    # At once, nothing after the bad bucket is written; deferred, everything is.
    last = PLAN.buckets[-1].pieces[-1]
    written = [t.narrow(last.dim, last.dst_start, last.length) for t in (now, later)
               for t in [t[last.dst_name]]]  # fmt: skip
    assert (written[0] == 7.0).all() and not (written[1] == 7.0).all()


# ------------------------------------------------------------------ the device benchmark
def test_real_shape_benchmark_runs_at_toy_sizes():
    sys.path.insert(0, str(ROOT / "tools" / "bench"))
    try:
        import weight_sync_device as bench
    finally:
        sys.path.remove(str(ROOT / "tools" / "bench"))
    got = bench.real_shapes(torch.device("cpu"), reps=1, smoke=True)
    assert list(got) == ["8b_bf16_512mb", "8b_bf16_64mb", "8b_fp8_512mb", "70b_bf16_512mb",
                         "30b_a3b_bf16"]  # fmt: skip
    for name, case in got.items():
        assert "error" not in case, (name, case)
        assert case["pack_GBps"] > 0 and case["receive_GBps"] > 0, (name, case)
        assert case["buckets"] > 1, name
    assert got["8b_bf16_64mb"]["buckets"] > got["8b_bf16_512mb"]["buckets"]
    assert all(case["same_bytes_as_per_piece_path"] is True for case in got.values())
    assert got["8b_fp8_512mb"]["pack_per_piece_input_GBps"] > 0
    full = got["30b_a3b_bf16"]["full_model_extrapolated"]
    assert "EXTRAPOLATED" in full["note"] and full["layers"] == 48
    assert full["model_bytes"] > 10 * got["30b_a3b_bf16"]["payload_bytes"]


if __name__ == "__main__":  # the child process of ``interpreted``
    assert os.environ.get("TRITON_INTERPRET") == "1"
    found: dict[str, list[str]] = {}
    for name, check in CHECKS.items():
        found[name] = []
        try:
            check(found[name])
        except Exception as e:  # a kernel that does not run is a failure of its own check
            found[name].append(f"{type(e).__name__}: {e}")
    print(json.dumps(found))


def test_pack_and_unpack_take_live_parameters_outside_autograd():
    """A trainer's shards are parameters that require grad, and a sync runs wherever the
    caller is (tests/gpu/test_megatron_cuda.py packs outside torch.no_grad()): the copies
    into and out of the reused bucket views must not record autograd."""
    params = [{k: torch.nn.Parameter(t) for k, t in s.items()} for s in _shards(PLAN)]
    out = {n: torch.nn.Parameter(torch.zeros(s)) for n, s in PLAN.dst_shapes.items()}
    buf = torch.zeros(PLAN.bucket_bytes, dtype=torch.uint8)
    for b in PLAN.buckets:
        msg = wire.pack(buf, PLAN, b, lambda k, i, s=params[b.src]: s[(k, i)], torch.float32, 1)
        wire.verify(msg, PLAN, b, 1)
        wire.unpack(msg, PLAN, b, out.__getitem__, torch.float32)
    assert not buf.requires_grad and all(p.grad_fn is None for p in out.values())
    k, layer = "decoder.final_layernorm.weight", None
    assert torch.equal(out["model.norm.weight"], params[0][(k, layer)])
