"""Llama 2/3.x (and SmolLM2): GQA, no biases, optional Llama 3 RoPE scaling."""

from rl.models import hf_fields as f
from rl.models.arch import Arch


def _from_hf(hf: dict) -> dict:
    f.refuse_flag(hf, "attention_bias", "it adds an o_proj bias")
    return {}


ARCH = Arch(
    name="llama",
    hf_class="LlamaForCausalLM",
    model_type="llama",
    sglang_module="sglang.srt.models.llama",
    fixed={"qkv_bias": False, "qk_norm": False, "num_experts": 0},
    from_hf=_from_hf,
    to_hf=lambda m: {"attention_bias": False, "mlp_bias": False},
)
