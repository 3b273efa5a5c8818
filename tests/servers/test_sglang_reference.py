"""Sanity of tests/helpers/sglang_reference.py: SGLang's own loaders, faked to TP rank r,
must produce the per-rank layout SGLang is known to use, so the resharding tests compare
against the real thing and not against a harness bug (e.g. every rank silently loading
rank 0's slice)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.hf_models import SHAPES, hf_logits, make_model
from tests.helpers.sglang_reference import sglang_rank_params

N_KV = SHAPES["num_key_value_heads"]  # 2
FFN, VOCAB = SHAPES["intermediate_size"], SHAPES["vocab_size"]  # 176, 99
# SGLang pads the vocabulary to a multiple of 64 (times tp if that is not divisible by tp):
# 99 -> 128 for tp 1, 2 and 4.
PADDED_VOCAB = 128


DENSE = ("llama", "qwen2", "qwen3", "qwen3_kv1", "mistral")
MOE = ("qwen3_moe", "qwen2_moe")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sglang_ref")
    return {k: make_model(k, root / k) for k in ("llama_tied", *DENSE, *MOE)}


@dataclass(frozen=True)
class Arch:
    """What a checkpoint's config.json says about the shapes SGLang must cut."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    experts: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0


def _arch(path: Path) -> Arch:
    c = json.loads((path / "config.json").read_text())
    return Arch(
        layers=c["num_hidden_layers"],
        heads=c["num_attention_heads"],
        kv_heads=c["num_key_value_heads"],
        head_dim=c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"],
        tied=c["tie_word_embeddings"],
        # transformers 5 writes Qwen3-MoE's expert count as num_local_experts (its config
        # maps num_experts to it), Qwen2-MoE's as num_experts.
        experts=c.get("num_experts") or c.get("num_local_experts", 0),
        moe_ffn=c.get("moe_intermediate_size", 0),
        shared_ffn=c.get("shared_expert_intermediate_size", 0),
    )


def _hf(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def _kv_head_of(rank: int, tp: int, n_kv: int = N_KV) -> tuple[int, int]:
    """(first KV head, KV heads per rank): split when tp <= n_kv, else replicated."""
    if tp <= n_kv:
        return rank * (n_kv // tp), n_kv // tp
    return rank // (tp // n_kv), 1


def _all_finite(got: dict[str, torch.Tensor]) -> None:
    bad = [n for n, t in got.items() if not t.isfinite().all()]
    assert not bad, f"elements never written (still NaN) or not finite: {bad}"


def _eq(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _check_attention(got, hf, a: str, arch: Arch, tp: int, rank: int) -> int:
    """qkv_proj (weight, and bias when HF has one), o_proj and QK-norms of one layer on one
    rank; returns the rank's first KV head."""
    hd = arch.head_dim
    q_first, q_n = rank * arch.heads // tp, arch.heads // tp
    kv_first, kv_n = _kv_head_of(rank, tp, arch.kv_heads)
    for k in ("weight", "bias"):
        if f"{a}.q_proj.{k}" not in hf:
            assert f"{a}.qkv_proj.{k}" not in got
            continue
        want = torch.cat(
            [
                hf[f"{a}.q_proj.{k}"][q_first * hd : (q_first + q_n) * hd],
                hf[f"{a}.k_proj.{k}"][kv_first * hd : (kv_first + kv_n) * hd],
                hf[f"{a}.v_proj.{k}"][kv_first * hd : (kv_first + kv_n) * hd],
            ]
        )
        _eq(got[f"{a}.qkv_proj.{k}"], want)
    cols = slice(q_first * hd, (q_first + q_n) * hd)
    _eq(got[f"{a}.o_proj.weight"], hf[f"{a}.o_proj.weight"][:, cols])
    for n in ("q_norm.weight", "k_norm.weight"):  # Qwen3: replicated, head_dim wide
        if f"{a}.{n}" in hf:
            assert got[f"{a}.{n}"].shape == (hd,)
            _eq(got[f"{a}.{n}"], hf[f"{a}.{n}"])
        else:
            assert f"{a}.{n}" not in got
    return kv_first


def _check_gated_mlp(got, hf, sg: str, hf_prefix: str, ffn: int, tp: int, rank: int) -> None:
    """Merged gate_up (each rank [gate_r ; up_r]) and row-parallel down of a dense MLP."""
    f = ffn // tp
    rows = slice(rank * f, (rank + 1) * f)
    gate_up = torch.cat(
        [hf[f"{hf_prefix}.gate_proj.weight"][rows], hf[f"{hf_prefix}.up_proj.weight"][rows]]
    )
    _eq(got[f"{sg}.gate_up_proj.weight"], gate_up)
    _eq(got[f"{sg}.down_proj.weight"], hf[f"{hf_prefix}.down_proj.weight"][:, rows])


def _check_common(got, hf, arch: Arch, tp: int, rank: int) -> None:
    """Embedding, LM head (absent when tied), final and per-layer norms."""
    _check_vocab(got["model.embed_tokens.weight"], hf["model.embed_tokens.weight"], tp, rank)
    if arch.tied:
        assert "lm_head.weight" not in hf and "lm_head.weight" not in got
    else:
        _check_vocab(got["lm_head.weight"], hf["lm_head.weight"], tp, rank)
    names = ["model.norm.weight"] + [
        f"model.layers.{i}.{n}"
        for i in range(arch.layers)
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight")
    ]
    for n in names:
        _eq(got[n], hf[n])


def _check_vocab(t: torch.Tensor, full: torch.Tensor, tp: int, rank: int) -> None:
    per = PADDED_VOCAB // tp
    assert t.shape == (per, SHAPES["hidden_size"])
    real = full[rank * per : (rank + 1) * per]
    torch.testing.assert_close(t[: len(real)], real, rtol=0, atol=0)
    assert torch.equal(t[len(real) :], torch.zeros_like(t[len(real) :])), "padding rows"


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


# First KV head held by each rank, by (KV heads, tp): split while tp <= KV heads, then
# replicated to consecutive ranks (a single KV head lives on every rank).
KV_PLACEMENT = {
    (2, 1): [0],
    (2, 2): [0, 1],
    (2, 4): [0, 0, 1, 1],
    (1, 1): [0],
    (1, 2): [0, 0],
    (1, 4): [0, 0, 0, 0],
}


@pytest.mark.parametrize("kind", DENSE)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rank_shards(ckpts, kind, tp):
    hf, arch = _hf(ckpts[kind]), _arch(ckpts[kind])
    seen_kv = []
    for rank in range(tp):
        got = sglang_rank_params(ckpts[kind], tp, rank)
        _all_finite(got)
        for i in range(arch.layers):
            a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            kv_first = _check_attention(got, hf, a, arch, tp, rank)
            _check_gated_mlp(got, hf, m, m, FFN, tp, rank)
        _check_common(got, hf, arch, tp, rank)
        seen_kv.append(kv_first)
    assert seen_kv == KV_PLACEMENT[(arch.kv_heads, tp)]


def test_wide_head_dim_shapes(ckpts):
    """Qwen3 / Mistral with head_dim 32 != hidden/heads: SGLang sizes q/k/v and o_proj by the
    explicit head_dim (4 q heads * 32 = 128 > hidden 64), and does not pad it."""
    for kind in ("qwen3", "qwen3_kv1", "mistral"):
        arch = _arch(ckpts[kind])
        assert arch.head_dim == 32 != SHAPES["hidden_size"] // arch.heads
        for tp in (1, 2, 4):
            got = sglang_rank_params(ckpts[kind], tp, 0)
            kv_n = _kv_head_of(0, tp, arch.kv_heads)[1]
            qkv = got["model.layers.0.self_attn.qkv_proj.weight"]
            assert qkv.shape == ((arch.heads // tp + 2 * kv_n) * 32, SHAPES["hidden_size"])
            o = got["model.layers.0.self_attn.o_proj.weight"]
            assert o.shape == (SHAPES["hidden_size"], arch.heads // tp * 32)


@pytest.mark.parametrize("kind", MOE)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_moe_rank_shards(ckpts, kind, tp):
    """FusedMoE: w13_weight (E, 2*I/tp, H) holds, per expert, [gate_e rows of rank ; up_e rows
    of rank]; w2_weight (E, H, I/tp) holds down_e's columns of the rank (MoE-TP = TP, EP 1,
    so every rank holds every expert). The router is replicated; so is Qwen2-MoE's
    shared_expert_gate, while its shared expert is an ordinary TP-split gated MLP."""
    hf, arch = _hf(ckpts[kind]), _arch(ckpts[kind])
    hidden, i_full = SHAPES["hidden_size"], arch.moe_ffn
    per = i_full // tp
    rows = [slice(r * per, (r + 1) * per) for r in range(tp)]
    w13_all, w2_all = [], []
    for rank in range(tp):
        got = sglang_rank_params(ckpts[kind], tp, rank)
        _all_finite(got)
        _check_common(got, hf, arch, tp, rank)
        for i in range(arch.layers):
            a, m = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
            _check_attention(got, hf, a, arch, tp, rank)
            w13, w2 = got[f"{m}.experts.w13_weight"], got[f"{m}.experts.w2_weight"]
            assert w13.shape == (arch.experts, 2 * per, hidden)
            assert w2.shape == (arch.experts, hidden, per)
            for e in range(arch.experts):
                x = f"{m}.experts.{e}"
                gate_up = torch.cat(
                    [
                        hf[f"{x}.gate_proj.weight"][rows[rank]],
                        hf[f"{x}.up_proj.weight"][rows[rank]],
                    ]
                )
                _eq(w13[e], gate_up)
                _eq(w2[e], hf[f"{x}.down_proj.weight"][:, rows[rank]])
            _eq(got[f"{m}.gate.weight"], hf[f"{m}.gate.weight"])
            assert got[f"{m}.gate.weight"].shape == (arch.experts, hidden)
            if arch.shared_ffn:
                _check_gated_mlp(
                    got, hf, f"{m}.shared_expert", f"{m}.shared_expert", arch.shared_ffn, tp, rank
                )
                _eq(got[f"{m}.shared_expert_gate.weight"], hf[f"{m}.shared_expert_gate.weight"])
            else:
                assert not any(".shared_expert" in n for n in got)
            if i == 0:
                w13_all.append(w13)
                w2_all.append(w2)
    # The ranks' w2 shards concatenate back to the full down_proj of every expert; the w13
    # shards do NOT (each is [gate_r ; up_r]), they must be de-interleaved.
    x = "model.layers.0.mlp.experts"
    full_down = torch.stack([hf[f"{x}.{e}.down_proj.weight"] for e in range(arch.experts)])
    _eq(torch.cat(w2_all, dim=2), full_down)
    gate = torch.cat([w[:, :per] for w in w13_all], dim=1)
    up = torch.cat([w[:, per:] for w in w13_all], dim=1)
    _eq(gate, torch.stack([hf[f"{x}.{e}.gate_proj.weight"] for e in range(arch.experts)]))
    _eq(up, torch.stack([hf[f"{x}.{e}.up_proj.weight"] for e in range(arch.experts)]))


def test_moe_tp1_equals_hf_tensors(ckpts):
    """At TP 1, w13_weight[e] is exactly cat(gate_e, up_e), w2_weight[e] is down_e and the
    router is HF's gate."""
    for kind in MOE:
        hf, arch = _hf(ckpts[kind]), _arch(ckpts[kind])
        got = sglang_rank_params(ckpts[kind], 1, 0)
        for i in range(arch.layers):
            m = f"model.layers.{i}.mlp"
            for e in range(arch.experts):
                x = f"{m}.experts.{e}"
                want = torch.cat([hf[f"{x}.gate_proj.weight"], hf[f"{x}.up_proj.weight"]])
                _eq(got[f"{m}.experts.w13_weight"][e], want)
                _eq(got[f"{m}.experts.w2_weight"][e], hf[f"{x}.down_proj.weight"])
            _eq(got[f"{m}.gate.weight"], hf[f"{m}.gate.weight"])


@pytest.mark.parametrize(
    ("kind", "layer"),
    [
        (
            "llama",
            [
                "self_attn.qkv_proj.weight",
                "self_attn.o_proj.weight",
                "mlp.gate_up_proj.weight",
                "mlp.down_proj.weight",
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
            ],
        ),
        (
            "qwen3",
            [
                "self_attn.q_norm.weight",
                "self_attn.k_norm.weight",
                "self_attn.qkv_proj.weight",
                "self_attn.o_proj.weight",
                "mlp.gate_up_proj.weight",
                "mlp.down_proj.weight",
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
            ],
        ),
        (
            "qwen3_moe",
            [
                "self_attn.qkv_proj.weight",
                "self_attn.o_proj.weight",
                "self_attn.q_norm.weight",
                "self_attn.k_norm.weight",
                "mlp.experts.w13_weight",
                "mlp.experts.w2_weight",
                "mlp.gate.weight",
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
            ],
        ),
        (
            "qwen2_moe",
            [
                "self_attn.qkv_proj.weight",
                "self_attn.qkv_proj.bias",
                "self_attn.o_proj.weight",
                "mlp.experts.w13_weight",
                "mlp.experts.w2_weight",
                "mlp.gate.weight",
                "mlp.shared_expert.gate_up_proj.weight",
                "mlp.shared_expert.down_proj.weight",
                "mlp.shared_expert_gate.weight",
                "input_layernorm.weight",
                "post_attention_layernorm.weight",
            ],
        ),
    ],
)
def test_tp2_names(ckpts, kind, layer):
    names = list(sglang_rank_params(ckpts[kind], 2, 0))
    want = ["model.embed_tokens.weight"]
    want += [f"model.layers.{i}.{n}" for i in range(_arch(ckpts[kind]).layers) for n in layer]
    want += ["model.norm.weight", "lm_head.weight"]
    assert names == want


def test_tied_has_no_lm_head(ckpts):
    hf = _hf(ckpts["llama_tied"])
    assert "lm_head.weight" not in hf
    for rank in range(2):
        got = sglang_rank_params(ckpts["llama_tied"], 2, rank)
        assert "lm_head.weight" not in got
        _check_vocab(got["model.embed_tokens.weight"], hf["model.embed_tokens.weight"], 2, rank)


def test_hf_checkpoints(ckpts):
    """tests/helpers/hf_models.py: transformers 5 keeps MoE experts as stacked gate_up_proj /
    down_proj parameters in memory but save_pretrained writes them per expert; they are
    random, not zero; the explicit head_dim reaches the QK-norms; hf_logits runs for every
    kind."""
    tokens = torch.tensor([[1, 5, 7, 9, 3]])
    for kind, path in ckpts.items():
        hf, arch = _hf(path), _arch(path)
        assert not [n for n, t in hf.items() if not t.any()], f"{kind}: an all-zero tensor"
        assert not any("gate_up_proj" in n for n in hf), "fused names must not reach disk"
        for e in range(arch.experts):
            x = f"model.layers.0.mlp.experts.{e}"
            assert hf[f"{x}.gate_proj.weight"].shape == (arch.moe_ffn, SHAPES["hidden_size"])
            assert hf[f"{x}.up_proj.weight"].shape == (arch.moe_ffn, SHAPES["hidden_size"])
            assert hf[f"{x}.down_proj.weight"].shape == (SHAPES["hidden_size"], arch.moe_ffn)
        if "model.layers.0.self_attn.q_norm.weight" in hf:
            assert hf["model.layers.0.self_attn.q_norm.weight"].shape == (arch.head_dim,)
        logits = hf_logits(path, tokens)
        assert logits.shape == (1, 5, VOCAB) and logits.isfinite().all()


@pytest.mark.parametrize("kind", ["llama", "qwen2_moe"])
def test_leaves_process_state_alone(ckpts, tmp_path, kind):
    """A fresh load (new checkpoint path, so no cache) must not leak SGLang's context, its
    MoE backend flags, the vllm stub, or ServerArgs' environment variables into the rest of
    the test process."""
    from sglang.srt.runtime_context import get_context, get_flags, get_parallel

    path = make_model(kind, tmp_path / "m", seed=1)
    env, syspath = dict(os.environ), list(sys.path)
    vllm = {k for k in sys.modules if k == "vllm" or k.startswith("vllm.")}
    context, parallel = get_context(), get_parallel()
    published, overrides = context._server_args, dict(parallel._overrides)
    flags = repr(get_flags())
    got = sglang_rank_params(path, 2, 1)
    assert dict(os.environ) == env and sys.path == syspath
    assert {k for k in sys.modules if k == "vllm" or k.startswith("vllm.")} == vllm
    assert get_context() is context and get_parallel() is parallel
    assert context._server_args is published and parallel._overrides == overrides
    assert repr(get_flags()) == flags
    # Returned tensors are copies: mutating them does not change the next answer.
    got["model.norm.weight"].fill_(7.0)
    again = sglang_rank_params(path, 2, 1)["model.norm.weight"]
    assert not torch.equal(again, got["model.norm.weight"])
