"""Qwen3 dense: RMSNorm on every head's q and k (Megatron ``qk_layernorm``), no biases, and
a ``head_dim`` that need not be hidden / heads (Qwen3-0.6B: 1024 hidden, 16 heads of 128)."""

from rl.models import hf_fields as f
from rl.models.arch import Arch


def _from_hf(hf: dict) -> dict:
    f.refuse_flag(hf, "attention_bias", "it adds q/k/v and o_proj biases")
    f.refuse_flag(hf, "use_sliding_window")
    return {}


ARCH = Arch(
    name="qwen3",
    hf_class="Qwen3ForCausalLM",
    model_type="qwen3",
    sglang_module="sglang.srt.models.qwen3",
    fixed={"qkv_bias": False, "qk_norm": True, "num_experts": 0},
    from_hf=_from_hf,
    to_hf=lambda m: {"attention_bias": False, "use_sliding_window": False},
    tiny={
        "qwen3": {"head_dim": 32, "tie_word_embeddings": False},  # head_dim != hidden/heads
        "qwen3_kv1": {"head_dim": 32, "num_key_value_heads": 1, "tie_word_embeddings": True},
    },
)
