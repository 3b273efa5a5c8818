"""Qwen2 / Qwen2.5: Llama's layout with q/k/v biases (and no o_proj bias)."""

from rl.models import hf_fields as f
from rl.models.arch import Arch


def _from_hf(hf: dict) -> dict:
    f.refuse_flag(hf, "use_sliding_window")
    return {}


ARCH = Arch(
    name="qwen2",
    hf_class="Qwen2ForCausalLM",
    model_type="qwen2",
    sglang_module="sglang.srt.models.qwen2",
    fixed={"qkv_bias": True, "qk_norm": False, "num_experts": 0},
    from_hf=_from_hf,
    to_hf=lambda m: {"use_sliding_window": False},
    tiny={"qwen2": {"tie_word_embeddings": False}},  # QKV bias
)
