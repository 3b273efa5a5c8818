"""What the vision-language families' ``config.json`` files share: the decoder's fields
nested in ``text_config``, the tower's in ``vision_config``, the image tokens at the top,
and an ``mrope_section`` in the decoder's RoPE. A family module gives its ``Arch``
:func:`decoder_fields` and a :func:`nest_as` of its own ``model_type``.

Pure logic: no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rl.config.schema import ModelConfig, VisionConfig
from rl.models import hf_fields as f

_TOKENS = ("video_token_id", "vision_start_token_id", "vision_end_token_id")
_TOP = ("architectures", "model_type", "tie_word_embeddings", "torch_dtype", "dtype")


def decoder_fields(hf: dict) -> dict:
    """The config.json with its ``text_config`` fields lifted to the top (for the common
    reader); the top's own fields (the image tokens, ``vision_config``) stay."""
    text = hf.get("text_config")
    if not isinstance(text, dict):
        f.fail(f"text_config={text!r} must be a dict (a vision-language config.json nests it)")
    return {**hf, **{k: v for k, v in text.items() if k not in _TOP}}


def vision_from_hf(hf: dict) -> VisionConfig:
    """``model.vision`` from the (lifted) config.json."""
    tower = hf.get("vision_config")
    if not isinstance(tower, dict):
        f.fail(f"vision_config={tower!r} must be a dict")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if not (isinstance(section, list) and len(section) == 3):
        f.fail(f"rope_parameters.mrope_section={section!r} must list 3 integers")
    return VisionConfig(
        tower={k: v for k, v in tower.items() if k != "transformers_version"},
        image_token_id=f.positive_int("image_token_id", f.required(hf, "image_token_id")),
        mrope_section=[f.positive_int("rope_parameters.mrope_section", s) for s in section],
        **{k: hf.get(k) for k in _TOKENS},
    )


def nest_as(
    model_type: str, rope: dict[str, bool] | None = None
) -> Callable[[dict, ModelConfig], dict]:
    """The ``Arch.nest`` of a family whose config.json's ``model_type`` is ``model_type``
    (its decoder's ``{model_type}_text``, its tower's ``{model_type}_vision``); ``rope``:
    fields the family's writer adds to the decoder's ``rope_parameters``."""

    def nest(flat: dict, m: ModelConfig) -> dict:
        v = m.vision
        if v is None:
            f.fail(f"model.vision is missing: {m.architecture} is a vision-language model")
        text: dict[str, Any] = {k: x for k, x in flat.items() if k not in _TOP}
        text["model_type"] = f"{model_type}_text"
        text["rope_parameters"] = {
            **text["rope_parameters"], "mrope_section": list(v.mrope_section), **(rope or {})
        }  # fmt: skip
        out = {k: flat[k] for k in _TOP if k in flat}
        out.update(
            text_config=text,
            vision_config={**v.tower, "model_type": f"{model_type}_vision"},
            image_token_id=v.image_token_id,
            **{k: getattr(v, k) for k in _TOKENS if getattr(v, k) is not None},
        )
        return out

    return nest


__all__ = ["decoder_fields", "nest_as", "vision_from_hf"]


def _merger(h: int, merge: int, out: int, norm: int) -> int:
    """A patch merger: a norm of ``norm`` parameters, then Linear(h m^2, h m^2) + GELU +
    Linear(h m^2, out), with biases."""
    wide = h * merge * merge
    return norm + wide * wide + wide + wide * out + out


def qwen2_5_vl_tower(v: dict) -> int:
    """Qwen2.5-VL's tower: a bias-free Conv3d patch embedding, blocks of RMSNorm, fused
    QKV and projection with biases and a SwiGLU MLP with biases, an RMSNorm merger."""
    h, i, depth = v["hidden_size"], v["intermediate_size"], v["depth"]
    patch = v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2 * h
    block = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (3 * h * i + 2 * i + h)
    return patch + depth * block + _merger(h, v["spatial_merge_size"], v["out_hidden_size"], h)


def qwen3_vl_tower(v: dict) -> int:
    """Qwen3-VL's tower: a Conv3d patch embedding with bias, learned position embeddings,
    blocks of LayerNorm, fused QKV and projection and a two-layer MLP (all with biases), a
    LayerNorm merger and one deepstack merger (normed after the merge) per deepstack layer."""
    h, i, depth, m = v["hidden_size"], v["intermediate_size"], v["depth"], v["spatial_merge_size"]
    patch = v.get("in_channels", 3) * v["temporal_patch_size"] * v["patch_size"] ** 2 * h + h
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (2 * h * i + i + h)
    out = v["out_hidden_size"]
    deep = len(v.get("deepstack_visual_indexes") or ()) * _merger(h, m, out, 2 * h * m * m)
    pos = v["num_position_embeddings"] * h
    return patch + pos + depth * block + _merger(h, m, out, 2 * h) + deep
