"""Llama 2/3.x (and SmolLM2): GQA, no biases, optional Llama 3 RoPE scaling."""

from rl.models import hf_fields as f
from rl.models.arch import Arch


def _from_hf(hf: dict) -> dict:
    f.refuse_flag(hf, "attention_bias", "it adds an o_proj bias")
    return {}


# Llama 3.1's RoPE scaling, as its config.json states it (a tiny test model carries it).
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

ARCH = Arch(
    name="llama",
    hf_class="LlamaForCausalLM",
    model_type="llama",
    sglang_module="sglang.srt.models.llama",
    fixed={"qkv_bias": False, "qk_norm": False, "num_experts": 0},
    from_hf=_from_hf,
    to_hf=lambda m: {"attention_bias": False, "mlp_bias": False},
    tiny={
        "llama": {"tie_word_embeddings": False},  # GQA, untied
        "llama_tied": {"tie_word_embeddings": True, "rope_parameters": _LLAMA3_ROPE},
        "llama_mha": {"num_key_value_heads": 4},  # Megatron TP=4 holds whole query groups
    },
)
