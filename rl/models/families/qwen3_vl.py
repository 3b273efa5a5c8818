"""Qwen3-VL: a Qwen3 decoder (QK norm, explicit head_dim) with interleaved multimodal RoPE
and deepstack, and transformers' own vision tower.

The decoder's HF names sit under ``model.language_model.`` and the tower's under
``model.visual.``. Its RoPE interleaves the temporal, height and width frequencies, and
the tower's deepstack mergers give one embedding per image token for each of the first
decoder layers, added to those layers' outputs at the image positions
(rl/models/vision/model.py).
"""

from rl.config.schema import ModelConfig
from rl.models import hf_fields as f
from rl.models import vl_fields
from rl.models.arch import Arch, VisionArch


def _from_hf(hf: dict) -> dict:
    f.refuse_flag(hf, "attention_bias", "it adds q/k/v and o_proj biases")
    return {"vision": vl_fields.vision_from_hf(hf)}


def _to_hf(m: ModelConfig) -> dict:
    return {"attention_bias": False}


# The tests' tiny model (tests/helpers/vision_models.py): four decoder layers, so PP=2
# keeps both deepstack layers on the first stage with the tower.
# fmt: off
_TINY: dict[str, object] = {
    "text_config": {
        "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 160, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
        "bos_token_id": 1, "eos_token_id": 2,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "mrope_section": [4, 6, 6], "mrope_interleaved": True},
    },
    "vision_config": {
        "depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
        "out_hidden_size": 64, "patch_size": 16, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "deepstack_visual_indexes": [0, 1],
        "num_position_embeddings": 64,
    },
    "image_token_id": 150, "video_token_id": 151,
    "vision_start_token_id": 148, "vision_end_token_id": 149, "tie_word_embeddings": False,
}
# fmt: on


ARCH = Arch(
    name="qwen3_vl",
    hf_class="Qwen3VLForConditionalGeneration",
    model_type="qwen3_vl",
    sglang_module="sglang.srt.models.qwen3_vl",
    fixed={"qkv_bias": False, "qk_norm": True, "num_experts": 0},
    from_hf=_from_hf,
    to_hf=_to_hf,
    vision=VisionArch(
        tower_class="Qwen3VLVisionModel",
        config_class="Qwen3VLVisionConfig",
        prefix="model.visual.",
        interleaved=True,
        params=vl_fields.qwen3_vl_tower,
    ),
    hf_decoder="model.language_model.",
    decoder_fields=vl_fields.decoder_fields,
    nest=vl_fields.nest_as("qwen3_vl", rope={"mrope_interleaved": True}),
    tiny={"qwen3_vl": _TINY},
)
