"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2 attention (q/k/v biases) and in every
layer routed experts plus one shared expert whose output a sigmoid gate scales, in the style
of DeepSeek-MoE. Megatron-Core's ``moe_shared_expert_gate`` is that gate."""

from rl.models import hf_fields as f
from rl.models.arch import Arch
from rl.models.families.qwen3_moe import moe_from_hf, moe_to_hf


def _from_hf(hf: dict) -> dict:
    f.refuse_flag(hf, "use_sliding_window")
    shared = f.positive_int(
        "shared_expert_intermediate_size", f.required(hf, "shared_expert_intermediate_size")
    )
    return {**moe_from_hf(hf), "shared_expert_ffn_hidden_size": shared}


ARCH = Arch(
    name="qwen2_moe",
    hf_class="Qwen2MoeForCausalLM",
    model_type="qwen2_moe",
    sglang_module="sglang.srt.models.qwen2_moe",
    fixed={"qkv_bias": True, "qk_norm": False, "shared_expert_gate": True},
    from_hf=_from_hf,
    to_hf=lambda m: {
        **moe_to_hf(m),
        "shared_expert_intermediate_size": m.shared_expert_ffn_hidden_size,
        "use_sliding_window": False,
    },
    moe=True,
    tiny={  # a sigmoid-gated shared expert, top-k not renormalised
        "qwen2_moe": {
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
            "tie_word_embeddings": False,
        },
    },
)
