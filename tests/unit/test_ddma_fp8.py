"""Blockwise FP8 quantization for FP8 SGLang engines (rl/ddma/fp8.py), milliseconds per case.

Round-trip error bounds, SGLang's scale convention, zero and outlier blocks, shard-wise
quantization being bit-identical to slices of the full quantization, the payload layout,
and input validation.
"""

from __future__ import annotations

import pytest
import torch

from rl.ddma.fp8 import (
    AMAX_FLOOR,
    BLOCK,
    FP8_MAX,
    dequantize_blockwise,
    is_quantized_weight,
    quant_config,
    quantize_blockwise,
    quantize_named,
    scale_shape,
    slice_aligned,
)

SHAPES = [(256, 384), (300, 130), (1, 1), (128, 129)]


def _randn(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.02).to(dtype)


def _block_amax(w: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Per-element amax of the element's block (a loop: independent of the code under test)."""
    out = torch.empty(w.shape)
    for i in range(0, w.shape[0], block):
        for j in range(0, w.shape[1], block):
            out[i : i + block, j : j + block] = w[i : i + block, j : j + block].abs().max()
    return out


def _bytes(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_error_bound(shape, dtype):
    # Why the bounds hold. With s = amax_block / 448, every x / s lies in [-448, 448]. e4m3
    # has 3 mantissa bits, so in the binade [2^e, 2^(e+1)) the step is 2^(e-3) and rounding
    # to nearest errs by at most half a step, 2^(e-4) <= |x / s| * 2^-4; below the normal
    # range (|x / s| < 2^-6) the step is 2^-9, so the error is at most 2^-10. In weight units
    # |deq - w| <= max(|w| * 2^-4, s * 2^-10), and since |x / s| <= 448 lies in the top binade
    # [256, 448] (step 32), |deq - w| <= 16 * s = amax / 28 < amax * 2^-3 (the loose bound of
    # "relative step 2^-3"). The float32 division and product add ~2^-24 relative slack.
    w = _randn(shape, seed=sum(shape), dtype=dtype)
    q, s = quantize_blockwise(w)
    deq = dequantize_blockwise(q, s)
    wf = w.float()
    err = (deq - wf).abs()
    amax = _block_amax(wf)
    slack = 1 + 1e-5
    assert (err <= amax * 2**-3).all()
    assert (err <= amax / 28 * slack).all()
    s_elem = amax.clamp(min=AMAX_FLOOR) / FP8_MAX
    assert (err <= torch.maximum(wf.abs() * 2**-4, s_elem * 2**-10) * slack).all()
    # Averaged over a normal distribution the error is ~2.2% of the mean magnitude.
    assert err.mean() <= 0.03 * wf.abs().mean()
    assert (deq - wf).norm() <= 0.03 * wf.norm()


@pytest.mark.parametrize("shape", SHAPES)
def test_shapes_dtypes_and_range(shape):
    q, s = quantize_blockwise(_randn(shape, seed=1))
    assert q.dtype == torch.float8_e4m3fn and q.shape == shape and q.is_contiguous()
    rows, cols = shape
    assert s.dtype == torch.float32
    assert tuple(s.shape) == scale_shape(shape) == (-(-rows // BLOCK), -(-cols // BLOCK))
    assert q.float().abs().max() <= FP8_MAX
    assert torch.isfinite(q.float()).all() and torch.isfinite(s).all() and (s > 0).all()


def test_scale_shape():
    assert scale_shape((256, 384)) == (2, 3)
    assert scale_shape((300, 130)) == (3, 2)
    assert scale_shape((1, 1)) == (1, 1)
    assert scale_shape((128, 129)) == (1, 2)
    assert scale_shape((64, 65), block=32) == (2, 3)


def test_sglang_scale_convention():
    """scale_inv = amax / 448 per block of the [out, in] weight (not its transpose): each
    block's largest element lands exactly on +-448, and dequant multiplies by scale_inv."""
    w = _randn((300, 130), seed=2)
    w[200:300, 0:128] *= 10  # blocks must differ to catch a transposed / misplaced scale
    q, s = quantize_blockwise(w)
    for bi in range(3):
        for bj in range(2):
            blk = w[bi * BLOCK : (bi + 1) * BLOCK, bj * BLOCK : (bj + 1) * BLOCK]
            qb = q[bi * BLOCK : (bi + 1) * BLOCK, bj * BLOCK : (bj + 1) * BLOCK].float()
            assert s[bi, bj] == blk.abs().max() / FP8_MAX
            assert qb.abs().max() == FP8_MAX
    assert torch.equal(dequantize_blockwise(q, s)[250, 3], q[250, 3].float() * s[1, 0])


def test_bf16_input_quantized_like_its_float32_value():
    w = _randn((300, 130), seed=3, dtype=torch.bfloat16)
    qb, sb = quantize_blockwise(w)
    qf, sf = quantize_blockwise(w.float())
    assert torch.equal(_bytes(qb), _bytes(qf)) and torch.equal(sb, sf)


def test_zero_blocks():
    w = _randn((300, 130), seed=4)
    w[128:256, :] = 0  # two full zero blocks
    w[256:, 128:] = 0  # the partial corner block
    q, s = quantize_blockwise(w)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert s[1, 0] == s[1, 1] == s[2, 1] == torch.tensor(AMAX_FLOOR) / FP8_MAX
    deq = dequantize_blockwise(q, s)
    assert torch.equal(deq[128:256], torch.zeros(128, 130))
    assert torch.equal(deq[256:, 128:], torch.zeros(44, 2))
    assert (deq[:128] - w[:128]).abs().max() <= w[:128].abs().max() / 28 * (1 + 1e-5)

    q0, s0 = quantize_blockwise(torch.zeros(5, 7, dtype=torch.bfloat16))
    assert torch.equal(dequantize_blockwise(q0, s0), torch.zeros(5, 7))
    assert torch.isfinite(s0).all() and (s0 > 0).all()


def test_outlier_stays_in_its_block():
    w = _randn((256, 384), seed=5)
    spiked = w.clone()
    spiked[5, 7] = 1000.0  # block (0, 0)
    q, s = quantize_blockwise(w)
    qs, ss = quantize_blockwise(spiked)
    others = torch.ones(2, 3, dtype=torch.bool)
    others[0, 0] = False
    assert torch.equal(s[others], ss[others])
    assert ss[0, 0] == 1000.0 / FP8_MAX
    mask = torch.ones(256, 384, dtype=torch.bool)
    mask[:BLOCK, :BLOCK] = False
    assert torch.equal(_bytes(q)[mask], _bytes(qs)[mask])
    err = (dequantize_blockwise(qs, ss) - spiked).abs()
    assert err[mask].max() <= w.abs().max() / 28 * (1 + 1e-5)
    # Only the spiked block itself goes coarse: its small values fall to e4m3's subnormals.
    blk = (slice(0, BLOCK), slice(0, BLOCK))
    spiked_rel = err[blk].sum() / (spiked[blk].abs().sum() - 1000.0)
    plain_rel = (dequantize_blockwise(q, s) - w).abs()[blk].sum() / w[blk].abs().sum()
    assert spiked_rel > 2 * plain_rel and err[mask].sum() / spiked[mask].abs().sum() < 0.03


@pytest.mark.parametrize(
    "rows,cols",
    [
        ((0, 128), None),
        ((128, 256), None),
        ((256, 300), None),
        ((128, 300), None),
        (None, (0, 128)),
        (None, (128, 130)),
        ((128, 256), (128, 130)),
    ],
)
def test_aligned_slice_quantizes_like_the_full_tensor(rows, cols):
    w = _randn((300, 130), seed=6)
    r0, r1 = rows or (0, 300)
    c0, c1 = cols or (0, 130)
    assert slice_aligned(r0, r1, 300) and slice_aligned(c0, c1, 130)
    q, s = quantize_blockwise(w)
    q_part, s_part = quantize_blockwise(w[r0:r1, c0:c1])  # a non-contiguous view for cols
    assert torch.equal(_bytes(q_part), _bytes(q[r0:r1, c0:c1]))
    sr, sc = scale_shape((r1 - r0, c1 - c0))
    assert torch.equal(s_part, s[r0 // BLOCK : r0 // BLOCK + sr, c0 // BLOCK : c0 // BLOCK + sc])


def test_tp_shards_concatenate_to_the_full_quantization():
    """Each of 4 trainer ranks quantizes its own column-parallel (row) shard."""
    w = _randn((512, 200), seed=7, dtype=torch.bfloat16)
    q, s = quantize_blockwise(w)
    parts = [quantize_blockwise(shard) for shard in w.chunk(4, dim=0)]
    assert torch.equal(_bytes(torch.cat([p[0] for p in parts])), _bytes(q))
    assert torch.equal(torch.cat([p[1] for p in parts]), s)


def test_unaligned_slices_are_detected():
    assert not slice_aligned(100, 228, 300)  # starts mid-block
    assert not slice_aligned(128, 200, 300)  # ends mid-block before the end
    assert not slice_aligned(0, 64, 130)
    assert slice_aligned(256, 300, 300) and slice_aligned(0, 300, 300)
    assert slice_aligned(32, 64, 100, block=32) and not slice_aligned(16, 64, 100, block=32)
    # ...and such a slice really would quantize differently: its block misses the rows that
    # set the full tensor's amax.
    w = _randn((300, 130), seed=8)
    w[250, 0] = 1.0
    _, s = quantize_blockwise(w)
    _, s_part = quantize_blockwise(w[128:200])
    assert s_part[0, 0] != s[1, 0]
    with pytest.raises(ValueError, match=r"\[5, 3\)"):
        slice_aligned(5, 3, 10)
    with pytest.raises(ValueError, match="size 10"):
        slice_aligned(0, 11, 10)


def test_is_quantized_weight():
    layer = "model.layers.3."
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"):
        assert is_quantized_weight(f"{layer}self_attn.{name}.weight")
    for name in ("gate_proj", "up_proj", "down_proj", "gate_up_proj"):
        assert is_quantized_weight(f"{layer}mlp.{name}.weight")
    assert is_quantized_weight("model.layers.0.mlp.experts.7.down_proj.weight")
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        f"{layer}input_layernorm.weight",
        f"{layer}post_attention_layernorm.weight",
        f"{layer}self_attn.q_norm.weight",
        f"{layer}self_attn.q_proj.bias",
        f"{layer}self_attn.qkv_proj.bias",
        f"{layer}self_attn.q_proj.weight_scale_inv",
        f"{layer}mlp.gate.weight",  # MoE router
        f"{layer}mlp.my_up_proj.weight",
        "q_proj",
        "weight",
    ):
        assert not is_quantized_weight(name), name


def _llama_like_state() -> list[tuple[str, torch.Tensor]]:
    """Two layers of a tiny Qwen2-ish HF checkpoint (q/k/v biases), hidden 160, kv 32."""
    g = torch.Generator().manual_seed(9)
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (96, 160))]
    for i in range(2):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (160,)),
            (p + "self_attn.q_proj.weight", (160, 160)),
            (p + "self_attn.q_proj.bias", (160,)),
            (p + "self_attn.k_proj.weight", (32, 160)),
            (p + "self_attn.k_proj.bias", (32,)),
            (p + "self_attn.v_proj.weight", (32, 160)),
            (p + "self_attn.v_proj.bias", (32,)),
            (p + "self_attn.o_proj.weight", (160, 160)),
            (p + "post_attention_layernorm.weight", (160,)),
            (p + "mlp.gate_proj.weight", (320, 160)),
            (p + "mlp.up_proj.weight", (320, 160)),
            (p + "mlp.down_proj.weight", (160, 320)),
        ]
    shapes += [("model.norm.weight", (160,)), ("lm_head.weight", (96, 160))]
    return [(n, torch.randn(s, generator=g).to(torch.bfloat16)) for n, s in shapes]


def test_quantize_named_payload_layout():
    state = _llama_like_state()
    out = quantize_named(iter(state))  # any iterable, consumed once

    expected = []
    for name, _ in state:
        expected.append(name)
        if name.endswith("_proj.weight"):
            expected.append(name.removesuffix("weight") + "weight_scale_inv")
    assert [n for n, _ in out] == expected
    assert len(out) == len(state) + 14  # 7 projections x 2 layers

    got = dict(out)
    for name, t in state:
        if name.endswith("_proj.weight"):
            q, s = got[name], got[name.removesuffix("weight") + "weight_scale_inv"]
            assert q.dtype == torch.float8_e4m3fn and q.shape == t.shape
            assert s.dtype == torch.float32 and tuple(s.shape) == scale_shape(tuple(t.shape))
            ref_q, ref_s = quantize_blockwise(t)
            assert torch.equal(_bytes(q), _bytes(ref_q)) and torch.equal(s, ref_s)
        else:
            assert got[name] is t  # passed through untouched (bf16, same object)
    assert got["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 3)
    assert quantize_named([]) == []


def test_quant_config():
    assert quant_config() == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    assert quant_config(64)["weight_block_size"] == [64, 64]


def test_small_block_round_trip():
    w = _randn((70, 45), seed=10)
    q, s = quantize_blockwise(w, block=16)
    assert s.shape == (5, 3)
    err = (dequantize_blockwise(q, s, block=16) - w).abs()
    assert (err <= _block_amax(w, 16) / 28 * (1 + 1e-5)).all()
    with pytest.raises(ValueError, match="does not match"):
        dequantize_blockwise(q, s)  # block 128 expects (1, 1)


@pytest.mark.parametrize(
    "bad,match",
    [
        (torch.zeros(8), r"shape \(8,\) dtype torch.float32"),
        (torch.zeros(2, 3, 4), r"shape \(2, 3, 4\)"),
        (torch.zeros(4, 4, dtype=torch.int32), "dtype torch.int32"),
        (torch.zeros(4, 4, dtype=torch.bool), "dtype torch.bool"),
        (torch.zeros(4, 4).to(torch.float8_e4m3fn), "dtype torch.float8_e4m3fn"),
    ],
)
def test_quantize_rejects_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        quantize_blockwise(bad)


def test_other_bad_input():
    w = torch.zeros(4, 4)
    for block in (0, -128, 1.5):
        with pytest.raises(ValueError, match="block must be a positive int"):
            quantize_blockwise(w, block=block)
    q, s = quantize_blockwise(w)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        dequantize_blockwise(q.float(), s)
    with pytest.raises(ValueError, match=r"scale_inv shape \(2, 1\)"):
        dequantize_blockwise(q, torch.ones(2, 1))
    with pytest.raises(ValueError, match="2-D shape"):
        scale_shape((4,))
    with pytest.raises(ValueError, match=r"shape \(8,\)"):
        quantize_named([("model.layers.0.self_attn.q_proj.weight", torch.zeros(8))])
