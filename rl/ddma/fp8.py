"""Blockwise FP8 (e4m3, 128x128) quantization of trainer weights for FP8 SGLang engines.

Why: an SGLang engine started from an FP8 checkpoint config (DeepSeek-V3 / Qwen3-FP8 style,
see :func:`quant_config`) holds its linear weights as ``float8_e4m3fn`` plus one float32
``weight_scale_inv`` per 128x128 block, and its weight loaders expect exactly that pair on
a weight update. The trainer therefore quantizes the linear weights itself and sends
``<name>.weight`` (e4m3) followed by ``<name>.weight_scale_inv``; everything else (embeddings,
lm_head, norms, biases) stays in the trainer's dtype. Halving the bytes on the wire is a
bonus, matching the engine's layout is the point.

Convention (checked against SGLang 0.5.23,
``sglang/srt/layers/quantization/mxfp8_block_convert.py::bf16_to_block_fp8_128``, which
"mirrors the DeepSeek-V3 block-fp8 contract", and ``fp8_utils.py::block_quant_dequant`` /
``fp8.py::create_fp8_weight_``):

* the weight keeps its original ``[out, in]`` orientation and blocks tile it from (0, 0):
  ``weight_block_size = [block_n, block_k]`` with ``block_n`` along the output rows, so
  ``scale_inv`` has shape ``[ceil(out / 128), ceil(in / 128)]`` (``fp8.py`` allocates
  ``weight_scale_inv`` exactly so); edge blocks are partial (SGLang zero-pads, and padding
  zeros never change an absolute maximum);
* ``scale_inv = max(amax_block, 1e-4) / 448`` in float32 (448 = largest e4m3fn value); the
  1e-4 floor is SGLang's and keeps all-zero blocks at a finite, non-zero scale whose
  quantized values are exact zeros;
* ``q = float8_e4m3fn(w / scale_inv)``: a float32 division, then torch's round-to-nearest
  cast (we additionally clamp to +-448, a no-op for in-range values, so a rounding ulp in the
  division can never produce a NaN on a non-saturating backend);
* ``dequant(q)[i, j] = q[i, j].float() * scale_inv[i // 128, j // 128]``.

Sharded quantization. Every quantized value depends only on its own element and the amax of
its own block. A row slice ``[start, stop)`` with ``start % 128 == 0`` tiles into the same
blocks as the full tensor: each full block of the slice is a block of the full tensor, and a
last partial block is one too provided it ends where the full tensor ends (``stop ==
dim_size``) -- otherwise it would miss the rows that share its block in the full tensor, its
amax could differ and so could every value in it. Columns behave the same way. Hence, when
:func:`slice_aligned` holds, quantizing the slice gives *bit-identical* q and scales to the
corresponding rows (columns) of the full tensor's quantization, so each trainer rank can
quantize only its own TP shard, and fused ``[q ; k ; v]`` / ``[gate ; up]`` pieces can be
quantized part by part. SGLang imposes the same alignment on its own TP partitions
(``fp8.py::validate_block_quant_shapes``).

Pure logic: torch only (no torch.distributed, Megatron or SGLang); works on any device.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
BLOCK = 128  # DeepSeek-V3 / Qwen3-FP8 weight_block_size [128, 128]
AMAX_FLOOR = 1e-4  # SGLang's clamp on the block amax (all-zero blocks -> finite scale)

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

# Linear layers an FP8 engine holds in e4m3: HF names and SGLang's fused ones.
_QUANTIZED_MODULES = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "qkv_proj",
        "gate_up_proj",
    }
)


def _check_block(block: int) -> None:
    if not isinstance(block, int) or block <= 0:
        raise ValueError(f"block must be a positive int, got {block!r}")


def scale_shape(shape: tuple[int, int], block: int = BLOCK) -> tuple[int, int]:
    """Shape of ``weight_scale_inv`` for a ``[rows, cols]`` weight: one scale per block,
    partial edge blocks included (what SGLang allocates for the layer)."""
    _check_block(block)
    if len(shape) != 2:
        raise ValueError(f"expected a 2-D shape, got {tuple(shape)}")
    rows, cols = shape
    return -(-rows // block), -(-cols // block)


def quantize_blockwise(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D float weight to (e4m3 ``q`` of the same shape, float32 ``scale_inv``
    of shape :func:`scale_shape`), in the layout an FP8 SGLang engine loads.

    Computed in float32, vectorised: the weight is zero-padded to a block multiple and viewed
    as ``[row_blocks, block, col_blocks, block]`` (padding cannot change a block's amax).
    """
    _check_block(block)
    if w.dim() != 2 or w.dtype not in _FLOAT_INPUTS:
        raise ValueError(
            "quantize_blockwise expects a 2-D floating tensor "
            f"({', '.join(str(d) for d in _FLOAT_INPUTS)}), "
            f"got shape {tuple(w.shape)} dtype {w.dtype}"
        )
    rows, cols = w.shape
    srows, scols = scale_shape((rows, cols), block)
    x = w.float()
    pad_rows, pad_cols = srows * block - rows, scols * block - cols
    if pad_rows or pad_cols:
        x = F.pad(x, (0, pad_cols, 0, pad_rows))
    blocks = x.reshape(srows, block, scols, block)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=AMAX_FLOOR)
    # A tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal,
    # one ulp off the CPU's (and SGLang's CPU loaders') correctly rounded division.
    scale_inv = amax / torch.full_like(amax, FP8_MAX)
    q = (blocks / scale_inv).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(srows * block, scols * block)[:rows, :cols].contiguous()
    return q, scale_inv.reshape(srows, scols).contiguous()


def dequantize_blockwise(
    q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK
) -> torch.Tensor:
    """float32 weight ``q.float() * scale_inv[i // block, j // block]``: what the engine
    computes with; used to check the quantization and to read FP8 weights back."""
    _check_block(block)
    if q.dim() != 2 or q.dtype != torch.float8_e4m3fn:
        raise ValueError(
            "dequantize_blockwise expects a 2-D float8_e4m3fn tensor, "
            f"got shape {tuple(q.shape)} dtype {q.dtype}"
        )
    rows, cols = q.shape
    expected = scale_shape((rows, cols), block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale_inv shape {tuple(scale_inv.shape)} does not match {expected} "
            f"for a weight of shape {tuple(q.shape)} and block {block}"
        )
    rows, cols = q.shape
    s = scale_inv.float().repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return q.float() * s[:rows, :cols]


def is_quantized_weight(hf_or_sglang_name: str) -> bool:
    """Whether an FP8 engine holds this tensor in e4m3: the ``.weight`` of an attention or
    MLP projection (HF or SGLang fused names); not embeddings, lm_head, norms, biases, MoE
    routers (``mlp.gate``) or scales."""
    parts = hf_or_sglang_name.rsplit(".", 2)
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in _QUANTIZED_MODULES


def quantize_named(
    named: Iterable[tuple[str, torch.Tensor]], block: int = BLOCK
) -> list[tuple[str, torch.Tensor]]:
    """The FP8 payload: each quantized weight becomes ``(name, q)`` immediately followed by
    ``(<prefix>.weight_scale_inv, scale_inv)``; other tensors pass through unchanged, in
    order."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in named:
        if is_quantized_weight(name):
            q, scale_inv = quantize_blockwise(tensor, block)
            out.append((name, q))
            out.append((name[: -len("weight")] + "weight_scale_inv", scale_inv))
        else:
            out.append((name, tensor))
    return out


def quant_config(block: int = BLOCK) -> dict:
    """The HF ``quantization_config`` an FP8 SGLang engine must be started with to accept
    this payload (DeepSeek-V3 / Qwen3-FP8 checkpoints carry the same)."""
    _check_block(block)
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }


def slice_aligned(start: int, stop: int, dim_size: int, block: int = BLOCK) -> bool:
    """Whether quantizing ``[start, stop)`` of a dimension of size ``dim_size`` on its own
    gives exactly that slice of the full tensor's quantization (see the module docstring):
    it must start on a block boundary and end on one or at the end of the dimension."""
    _check_block(block)
    if not 0 <= start <= stop <= dim_size:
        raise ValueError(f"invalid slice [{start}, {stop}) of a dimension of size {dim_size}")
    return start % block == 0 and (stop % block == 0 or stop == dim_size)
