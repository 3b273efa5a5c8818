"""Sanity of tests/sglang_reference.py: SGLang's own loaders, faked to TP rank r, must produce
the per-rank layout SGLang is known to use, so the resharding tests compare against the real
thing and not against a harness bug (e.g. every rank silently loading rank 0's slice)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.hf_models import SHAPES, make_model
from tests.sglang_reference import sglang_rank_params

HEAD_DIM = SHAPES["hidden_size"] // SHAPES["num_attention_heads"]  # 16
N_HEADS, N_KV = SHAPES["num_attention_heads"], SHAPES["num_key_value_heads"]  # 4, 2
FFN, VOCAB = SHAPES["intermediate_size"], SHAPES["vocab_size"]  # 176, 99
# SGLang pads the vocabulary to a multiple of 64 (times tp if that is not divisible by tp):
# 99 -> 128 for tp 1, 2 and 4.
PADDED_VOCAB = 128


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sglang_ref")
    return {k: make_model(k, root / k) for k in ("llama", "llama_tied", "qwen2")}


def _hf(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _heads(w: torch.Tensor, first: int, count: int) -> torch.Tensor:
    return w[first * HEAD_DIM : (first + count) * HEAD_DIM]


def _kv_head_of(rank: int, tp: int) -> tuple[int, int]:
    """(first KV head, KV heads per rank): split when tp <= N_KV, else replicated."""
    if tp <= N_KV:
        return rank * (N_KV // tp), N_KV // tp
    return rank // (tp // N_KV), 1


def _check_vocab(t: torch.Tensor, full: torch.Tensor, tp: int, rank: int) -> None:
    per = PADDED_VOCAB // tp
    assert t.shape == (per, SHAPES["hidden_size"])
    real = full[rank * per : (rank + 1) * per]
    torch.testing.assert_close(t[: len(real)], real, rtol=0, atol=0)
    assert torch.equal(t[len(real) :], torch.zeros_like(t[len(real) :])), "padding rows"


def test_llama_tp2_names(ckpts):
    names = list(sglang_rank_params(ckpts["llama"], 2, 0))
    layer = [
        "self_attn.qkv_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    want = ["model.embed_tokens.weight"]
    want += [f"model.layers.{i}.{n}" for i in range(SHAPES["num_hidden_layers"]) for n in layer]
    want += ["model.norm.weight", "lm_head.weight"]
    assert names == want


def test_tp1_fuses_hf_tensors(ckpts):
    hf = _hf(ckpts["qwen2"])
    got = sglang_rank_params(ckpts["qwen2"], 1, 0)
    for i in range(SHAPES["num_hidden_layers"]):
        a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        for kind in ("weight", "bias"):
            qkv = torch.cat([hf[f"{a}.{p}_proj.{kind}"] for p in "qkv"])
            torch.testing.assert_close(got[f"{a}.qkv_proj.{kind}"], qkv, rtol=0, atol=0)
        gate_up = torch.cat([hf[f"{m}.gate_proj.weight"], hf[f"{m}.up_proj.weight"]])
        torch.testing.assert_close(got[f"{m}.gate_up_proj.weight"], gate_up, rtol=0, atol=0)
        for n in (f"{a}.o_proj.weight", f"{m}.down_proj.weight"):
            torch.testing.assert_close(got[n], hf[n], rtol=0, atol=0)
    for n in ("model.embed_tokens.weight", "lm_head.weight"):
        _check_vocab(got[n], hf[n], 1, 0)
    assert not any(t.isnan().any() for t in got.values())


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("tp", [2, 4])
def test_rank_shards(ckpts, kind, tp):
    hf = _hf(ckpts[kind])
    seen_kv = []
    for rank in range(tp):
        got = sglang_rank_params(ckpts[kind], tp, rank)
        assert not any(t.isnan().any() for t in got.values()), "element never written"
        q_first, q_n = rank * N_HEADS // tp, N_HEADS // tp
        kv_first, kv_n = _kv_head_of(rank, tp)
        seen_kv.append(kv_first)
        f = FFN // tp
        for i in range(SHAPES["num_hidden_layers"]):
            a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            kinds = ("weight", "bias") if kind == "qwen2" else ("weight",)
            for k in kinds:
                want = torch.cat(
                    [
                        _heads(hf[f"{a}.q_proj.{k}"], q_first, q_n),
                        _heads(hf[f"{a}.k_proj.{k}"], kv_first, kv_n),
                        _heads(hf[f"{a}.v_proj.{k}"], kv_first, kv_n),
                    ]
                )
                torch.testing.assert_close(got[f"{a}.qkv_proj.{k}"], want, rtol=0, atol=0)
            cols = slice(rank * q_n * HEAD_DIM, (rank + 1) * q_n * HEAD_DIM)
            o = got[f"{a}.o_proj.weight"]
            torch.testing.assert_close(o, hf[f"{a}.o_proj.weight"][:, cols], rtol=0, atol=0)
            rows = slice(rank * f, (rank + 1) * f)
            gate_up = torch.cat(
                [hf[f"{m}.gate_proj.weight"][rows], hf[f"{m}.up_proj.weight"][rows]]
            )
            torch.testing.assert_close(got[f"{m}.gate_up_proj.weight"], gate_up, rtol=0, atol=0)
            down = got[f"{m}.down_proj.weight"]
            torch.testing.assert_close(down, hf[f"{m}.down_proj.weight"][:, rows], rtol=0, atol=0)
            for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                n = f"model.layers.{i}.{n}"
                torch.testing.assert_close(got[n], hf[n], rtol=0, atol=0)
        for n in ("model.embed_tokens.weight", "lm_head.weight"):
            _check_vocab(got[n], hf[n], tp, rank)
    # KV heads: split at tp=2, replicated to consecutive rank pairs at tp=4 (2 KV heads).
    assert seen_kv == ([0, 1] if tp == 2 else [0, 0, 1, 1])


def test_tied_has_no_lm_head(ckpts):
    hf = _hf(ckpts["llama_tied"])
    assert "lm_head.weight" not in hf
    for rank in range(2):
        got = sglang_rank_params(ckpts["llama_tied"], 2, rank)
        assert "lm_head.weight" not in got
        _check_vocab(got["model.embed_tokens.weight"], hf["model.embed_tokens.weight"], 2, rank)


def test_leaves_process_state_alone(ckpts, tmp_path):
    """A fresh load (new checkpoint path, so no cache) must not leak SGLang's context, the
    vllm stub, or ServerArgs' environment variables into the rest of the test process."""
    from sglang.srt.runtime_context import get_context, get_parallel

    path = make_model("llama", tmp_path / "m", seed=1)
    env, syspath = dict(os.environ), list(sys.path)
    vllm = {k for k in sys.modules if k == "vllm" or k.startswith("vllm.")}
    context, parallel = get_context(), get_parallel()
    published, overrides = context._server_args, dict(parallel._overrides)
    got = sglang_rank_params(path, 2, 1)
    assert dict(os.environ) == env and sys.path == syspath
    assert {k for k in sys.modules if k == "vllm" or k.startswith("vllm.")} == vllm
    assert get_context() is context and get_parallel() is parallel
    assert context._server_args is published and parallel._overrides == overrides
    # Returned tensors are copies: mutating them does not change the next answer.
    got["model.norm.weight"].fill_(7.0)
    again = sglang_rank_params(path, 2, 1)["model.norm.weight"]
    assert not torch.equal(again, got["model.norm.weight"])
