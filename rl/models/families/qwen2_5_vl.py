"""Qwen2.5-VL: a Qwen2 decoder with multimodal RoPE, and transformers' own vision tower.

The decoder's tensors are Qwen2's, under the same HF names (``model.layers.{i}.``); the
tower's are ``visual.*``, held whole by the trainer (rl/models/vision). The config.json
nests the decoder's fields in ``text_config`` and the tower's in ``vision_config``; the
decoder's RoPE has an ``mrope_section`` (temporal, height, width frequency pairs).
"""

from typing import Any

from rl.config.schema import ModelConfig, VisionConfig
from rl.models import hf_fields as f
from rl.models.arch import Arch, VisionArch

_TOKENS = ("video_token_id", "vision_start_token_id", "vision_end_token_id")
_TEXT_ONLY = ("model_type", "architectures", "torch_dtype", "dtype")


def _decoder_fields(hf: dict) -> dict:
    text = hf.get("text_config")
    if not isinstance(text, dict):
        f.fail(f"text_config={text!r} must be a dict (a Qwen2.5-VL config.json nests it)")
    return {**hf, **{k: v for k, v in text.items() if k not in _TEXT_ONLY}}


def _from_hf(hf: dict) -> dict:
    f.refuse_flag(hf, "use_sliding_window")
    tower = hf.get("vision_config")
    if not isinstance(tower, dict):
        f.fail(f"vision_config={tower!r} must be a dict")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if not (isinstance(section, list) and len(section) == 3):
        f.fail(f"rope_parameters.mrope_section={section!r} must list 3 integers")
    vision = VisionConfig(
        tower={k: v for k, v in tower.items() if k != "transformers_version"},
        image_token_id=f.positive_int("image_token_id", f.required(hf, "image_token_id")),
        mrope_section=[f.positive_int("rope_parameters.mrope_section", s) for s in section],
        **{k: hf.get(k) for k in _TOKENS},
    )
    return {"vision": vision}


def _to_hf(m: ModelConfig) -> dict:
    return {"use_sliding_window": False}


def _nest(flat: dict, m: ModelConfig) -> dict:
    """The flat decoder fields as transformers 5 writes a Qwen2.5-VL config.json."""
    v = m.vision
    if v is None:
        f.fail(f"model.vision is missing: {m.architecture} is a vision-language model")
    top = ("architectures", "model_type", "tie_word_embeddings", "torch_dtype", "dtype")
    text: dict[str, Any] = {k: x for k, x in flat.items() if k not in top}
    text["model_type"] = "qwen2_5_vl_text"
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(v.mrope_section)}
    out = {k: flat[k] for k in top if k in flat}
    out.update(
        text_config=text,
        vision_config={**v.tower, "model_type": "qwen2_5_vl_vision"},
        image_token_id=v.image_token_id,
        **{k: getattr(v, k) for k in _TOKENS if getattr(v, k) is not None},
    )
    return out


# The tests' tiny model (tests/helpers/vision_models.py): small enough for CPU ranks, with
# a vision tower of two blocks (one windowed) and a non-default mrope_section.
# fmt: off
_TINY: dict[str, object] = {
    "text_config": {
        "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 160,
        "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [2, 3, 3]},
    },
    "vision_config": {
        "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "window_size": 56, "fullatt_block_indexes": [1],
    },
    "image_token_id": 150, "video_token_id": 151,
    "vision_start_token_id": 148, "vision_end_token_id": 149,
}
# fmt: on


ARCH = Arch(
    name="qwen2_5_vl",
    hf_class="Qwen2_5_VLForConditionalGeneration",
    model_type="qwen2_5_vl",
    sglang_module="sglang.srt.models.qwen2_5_vl",
    fixed={"qkv_bias": True, "qk_norm": False, "num_experts": 0},
    from_hf=_from_hf,
    to_hf=_to_hf,
    vision=VisionArch(
        tower_class="Qwen2_5_VisionTransformerPretrainedModel",
        config_class="Qwen2_5_VLVisionConfig",
    ),
    decoder_fields=_decoder_fields,
    nest=_nest,
    tiny={"qwen2_5_vl": _TINY},
)
