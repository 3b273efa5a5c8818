"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention (QK norm, explicit head_dim)
and a Mixture-of-Experts MLP in every layer: a softmax router, top-k experts with their
weights renormalised (``norm_topk_prob``), no shared expert."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rl.models import hf_fields as f
from rl.models.arch import Arch

if TYPE_CHECKING:
    from rl.config.schema import ModelConfig


def moe_from_hf(hf: dict) -> dict:
    """The MoE fields Qwen2-MoE and Qwen3-MoE share."""
    if hf.get("decoder_sparse_step", 1) != 1:
        f.fail(f"decoder_sparse_step={hf['decoder_sparse_step']!r} is not supported (need 1)")
    if hf.get("mlp_only_layers"):
        f.fail(f"mlp_only_layers={hf['mlp_only_layers']!r} is not supported (need [])")
    # The hub's config.json says num_experts; transformers 5 writes num_local_experts.
    key = "num_experts" if hf.get("num_experts") is not None else "num_local_experts"
    experts = f.positive_int(key, f.required(hf, key))
    topk = f.positive_int("num_experts_per_tok", f.required(hf, "num_experts_per_tok"))
    if topk > experts:
        f.fail(f"num_experts_per_tok={topk} is more than num_experts={experts}")
    coef = hf.get("router_aux_loss_coef")
    return {
        "num_experts": experts,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": f.positive_int(
            "moe_intermediate_size", f.required(hf, "moe_intermediate_size")
        ),
        "moe_norm_topk_prob": f.flag(hf, "norm_topk_prob"),
        "moe_aux_loss_coeff": 0.001
        if coef is None
        else f.non_negative_float("router_aux_loss_coef", coef),
    }


def moe_to_hf(m: ModelConfig) -> dict:
    return {
        "num_experts": m.num_experts,
        "num_experts_per_tok": m.moe_router_topk,
        "moe_intermediate_size": m.moe_ffn_hidden_size,
        "norm_topk_prob": bool(m.moe_norm_topk_prob),
        "router_aux_loss_coef": float(m.moe_aux_loss_coeff),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _from_hf(hf: dict) -> dict:
    f.refuse_flag(hf, "attention_bias", "it adds q/k/v and o_proj biases")
    f.refuse_flag(hf, "use_sliding_window")
    return moe_from_hf(hf)


ARCH = Arch(
    name="qwen3_moe",
    hf_class="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    sglang_module="sglang.srt.models.qwen3_moe",
    fixed={"qkv_bias": False, "qk_norm": True, "shared_expert_ffn_hidden_size": 0},
    from_hf=_from_hf,
    to_hf=lambda m: {**moe_to_hf(m), "attention_bias": False, "use_sliding_window": False},
    moe=True,
    tiny={"qwen3_moe": {"norm_topk_prob": True, "tie_word_embeddings": False}},
)
