"""The arithmetic of tools/bench/trainer_throughput.py: model FLOPs per token at the
Llama-3-8B layer shape (the held-out figures of 26,900 tokens/s = 236 TFLOP/s = MFU 0.24
on an H200 follow from it), the peak table, and ``trainer.attention``'s validation."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from rl.checks import check
from rl.config import ConfigError
from tests.helpers.configs import composed

BENCH = Path(__file__).resolve().parents[2] / "tools" / "bench" / "trainer_throughput.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("trainer_throughput", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    path = list(sys.path)  # it puts the repository and tools/bench on the path
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        del sys.modules[spec.name]
        sys.path[:] = path


class _Shapes:
    """Megatron's parameter names and shapes of a Llama GPTModel, on the meta device."""

    def __init__(self, layers: int, h: int, f: int, heads: int, groups: int, vocab: int):
        q, kv = h, h // heads * groups
        shapes = {"embedding.word_embeddings.weight": (vocab, h), "output_layer.weight": (vocab, h),
                  "decoder.final_layernorm.weight": (h,)}  # fmt: skip
        for i in range(layers):
            p = f"decoder.layers.{i}."
            shapes |= {p + "input_layernorm.weight": (h,), p + "pre_mlp_layernorm.weight": (h,),
                       p + "self_attention.linear_qkv.weight": (q + 2 * kv, h),
                       p + "self_attention.linear_proj.weight": (h, q),
                       p + "mlp.linear_fc1.weight": (2 * f, h),
                       p + "mlp.linear_fc2.weight": (h, f)}  # fmt: skip
        self.params = {n: torch.empty(s, device="meta") for n, s in shapes.items()}
        self.share_embeddings_and_output_weights = False

    def named_parameters(self):
        return iter(self.params.items())


def test_flops_per_token_at_the_8b_layer_shape(bench):
    layers, h, f, ctx, vocab = 4, 4096, 14336, 4096, 128256
    model = _Shapes(layers, h, f, 32, 8, vocab)
    per_layer = h * (h + 2 * 1024) + h * h + 2 * f * h + f * h
    want = 6 * (layers * per_layer + vocab * h) + 6 * layers * h * ctx
    got = bench.model_flops_per_token(model, layers, h, ctx)
    assert got == want == 8_789_164_032
    tflops = 26_900 * got / 1e12  # the held-out H200 run: 236 TFLOP/s, MFU 0.24
    assert round(tflops) == 236 and round(tflops / bench.peak_tflops("NVIDIA H200"), 2) == 0.24


def test_peak_table(bench):
    assert bench.peak_tflops("NVIDIA H100 80GB HBM3") == 989.4
    assert bench.peak_tflops("NVIDIA H200") == 989.4
    assert bench.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bench.peak_tflops("NVIDIA H100 NVL") == 835.5
    assert bench.peak_tflops("NVIDIA A100-SXM4-80GB") is None


def test_attention_choice_is_validated():
    assert composed([]).trainer.attention == "sdpa"
    check(composed(["trainer.attention=dot_product", "trainer.packing=false"]))
    with pytest.raises(ConfigError) as info:
        check(composed(["trainer.attention=flash"]))
    msg = str(info.value)
    assert "trainer.attention='flash'" in msg and "('sdpa', 'dot_product')" in msg
    assert "\n" not in msg
