"""Mistral: Llama's layout, an explicit ``head_dim`` (Mistral-Nemo: 128 with 5120 hidden and
32 heads) and sliding-window attention. The Megatron model attends to the whole context,
so a window that covers ``max_position_embeddings`` is ignored (with a warning) and a
shorter one is refused: the two would compute different things."""

import warnings

from rl.models import hf_fields as f
from rl.models.arch import Arch


def _from_hf(hf: dict) -> dict:
    window, context = hf.get("sliding_window"), hf.get("max_position_embeddings")
    if window is not None:
        f.positive_int("sliding_window", window)
        if context is not None and window < context:
            f.fail(
                f"sliding_window={window} is shorter than max_position_embeddings={context}: "
                "sliding-window attention is not supported (need null or >= the context)"
            )
        warnings.warn(
            f"config.json: sliding_window={window} covers the context; ignored", stacklevel=2
        )
    return {}


ARCH = Arch(
    name="mistral",
    hf_class="MistralForCausalLM",
    model_type="mistral",
    sglang_module="sglang.srt.models.mistral",
    fixed={"qkv_bias": False, "qk_norm": False, "num_experts": 0},
    from_hf=_from_hf,
    to_hf=lambda m: {"sliding_window": None},
    tiny={"mistral": {"head_dim": 32, "sliding_window": None, "tie_word_embeddings": False}},
)
