"""Qwen2.5-VL: a Qwen2 decoder with multimodal RoPE, and transformers' own vision tower.

The decoder's tensors are Qwen2's, under the same HF names (``model.layers.{i}.``); the
tower's are ``visual.*``, held whole by the trainer (rl/models/vision). The config.json
nests the decoder's fields in ``text_config`` and the tower's in ``vision_config``; the
decoder's RoPE has an ``mrope_section`` (temporal, height, width frequency pairs).
"""

from rl.config.schema import ModelConfig
from rl.models import hf_fields as f
from rl.models import vl_fields
from rl.models.arch import Arch, VisionArch


def _from_hf(hf: dict) -> dict:
    f.refuse_flag(hf, "use_sliding_window")
    return {"vision": vl_fields.vision_from_hf(hf)}


def _to_hf(m: ModelConfig) -> dict:
    return {"use_sliding_window": False}


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
        params=vl_fields.qwen2_5_vl_tower,
    ),
    decoder_fields=vl_fields.decoder_fields,
    nest=vl_fields.nest_as("qwen2_5_vl"),
    tiny={"qwen2_5_vl": _TINY},
)
