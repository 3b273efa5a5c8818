"""Map a Hugging Face ``config.json`` to a :class:`ModelConfig` and back.

Pure logic: no torch, no transformers, no Megatron, so a checkpoint's config is checked in
milliseconds, before any weight is read. Only what the Megatron model reproduces exactly is
accepted: a decoder of a registered family (rl/models/families: RMSNorm, non-interleaved
RoPE with optional Llama 3 scaling, SwiGLU with silu, GQA, and what the family adds: QKV
bias, QK norm, explicit head_dim, experts). This module reads the fields every family shares;
the family module reads its own. Anything else raises :class:`HFConfigError` with one line
naming the field and its value, instead of converting into a model that silently computes
something different.

Both RoPE layouts are read: transformers 5 writes ``rope_parameters`` (with ``rope_type``
and ``rope_theta``), older files a top-level ``rope_theta`` plus an optional
``rope_scaling`` (with ``rope_type`` or the legacy ``type``). The inverse writes the
transformers 5 form.
"""

from __future__ import annotations

from typing import Any

from rl.config.schema import ModelConfig, RopeScalingConfig
from rl.models import registry
from rl.models.arch import Arch, has_score_head
from rl.models.hf_fields import HFConfigError, fail, flag, positive_float, positive_int, required

__all__ = ["HFConfigError", "hf_config_from_model", "model_config_from_hf", "supported"]

_LLAMA3_FIELDS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)
_DEFAULT_ROPE_THETA = 10000.0


def supported() -> str:
    return registry.supported()


def _architecture(hf: dict) -> Arch:
    """The family, from ``architectures`` (what SGLang reads) and ``model_type`` (what
    transformers' Auto classes read); both must name the same family."""
    archs = hf.get("architectures")
    model_type = hf.get("model_type")
    by_type = None
    if model_type is not None:
        try:
            by_type = registry.by_model_type(model_type)
        except registry.UnknownArchitecture as e:
            fail(str(e))
    if archs is None:  # SGLang picks the model class from it
        fail(f"architectures is missing (supported: {supported()})")
    if not isinstance(archs, list) or not archs:
        fail(f"architectures={archs!r} must be a non-empty list (supported: {supported()})")
    try:
        arch = registry.get(archs[0], "architectures[0]")
    except registry.UnknownArchitecture as e:
        fail(str(e))
    if by_type is not None and by_type is not arch:
        fail(f"model_type={model_type!r} does not match {arch.hf_class} (need {arch.model_type!r})")
    return arch


def _rope(hf: dict) -> tuple[float, RopeScalingConfig | None]:
    """(rope_theta, scaling) from either the transformers 5 or the legacy layout."""
    if hf.get("rope_parameters") is not None:
        key = "rope_parameters"
    elif hf.get("rope_scaling") is not None:
        key = "rope_scaling"
    else:
        key = None
    params = hf[key] if key else {}
    if not isinstance(params, dict):
        fail(f"{key}={params!r} must be a dict")

    if params.get("rope_theta") is not None:
        theta = positive_float(f"{key}.rope_theta", params["rope_theta"])
    elif hf.get("rope_theta") is not None:
        theta = positive_float("rope_theta", hf["rope_theta"])
    else:
        theta = _DEFAULT_ROPE_THETA

    for where, prf in (
        (f"{key}.", params.get("partial_rotary_factor")),
        ("", hf.get("partial_rotary_factor")),
    ):
        if prf is not None and prf != 1.0:
            fail(f"{where}partial_rotary_factor={prf!r} is not supported (need 1.0)")

    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        fail(f"{key}.rope_type={rope_type!r} is not supported (need 'default' or 'llama3')")
    values = {}
    for name in _LLAMA3_FIELDS:
        if params.get(name) is None:
            fail(f"{key}.{name} is missing (required for rope_type 'llama3')")
        values[name] = params[name]
    return theta, RopeScalingConfig(
        factor=positive_float(f"{key}.factor", values["factor"]),
        low_freq_factor=positive_float(f"{key}.low_freq_factor", values["low_freq_factor"]),
        high_freq_factor=positive_float(f"{key}.high_freq_factor", values["high_freq_factor"]),
        original_max_position_embeddings=positive_int(
            f"{key}.original_max_position_embeddings", values["original_max_position_embeddings"]
        ),
    )


def _head(hf: dict, arch: Arch) -> str:
    """The model's HF class: the family's causal LM, or its scalar-head class, whose one
    label is the score (HF's default of two labels is a classifier, not a reward model)."""
    if not has_score_head(hf["architectures"][0]):
        return arch.hf_class
    labels = hf.get("id2label") or {}
    n = len(labels) if isinstance(labels, dict) and labels else hf.get("num_labels", 2)
    if n != 1:
        fail(
            f"num_labels={n} (id2label) is not supported for {arch.score_class}: a reward "
            "model or critic has one label, its score (num_labels=1)"
        )
    return arch.score_class


def model_config_from_hf(
    hf: dict, name: str = "hf", make_vocab_size_divisible_by: int = 128
) -> ModelConfig:
    """The :class:`ModelConfig` of an HF ``config.json`` dict; raises :class:`HFConfigError`."""
    arch = _architecture(hf)
    hf = arch.decoder_fields(hf)
    ints = {
        key: positive_int(key, required(hf, key))
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
            "max_position_embeddings",
        )
    }
    hidden, heads = ints["hidden_size"], ints["num_attention_heads"]
    kv_heads = hf.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else positive_int("num_key_value_heads", kv_heads)
    norm_eps = positive_float("rms_norm_eps", required(hf, "rms_norm_eps"))
    std = hf.get("initializer_range")
    std = 0.02 if std is None else positive_float("initializer_range", std)
    head_dim = hf.get("head_dim")
    if head_dim is not None:
        head_dim = positive_int("head_dim", head_dim)
        if head_dim == hidden // heads and hidden % heads == 0:
            head_dim = None  # the implicit one
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        fail(f"hidden_act={act!r} is not supported (need 'silu')")
    if flag(hf, "mlp_bias"):
        fail("mlp_bias=True is not supported (need false)")

    theta, scaling = _rope(hf)
    fields: dict[str, Any] = dict(
        name=name,
        architecture=_head(hf, arch),
        num_layers=ints["num_hidden_layers"],
        hidden_size=hidden,
        ffn_hidden_size=ints["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        head_dim=head_dim,
        vocab_size=ints["vocab_size"],
        max_position_embeddings=ints["max_position_embeddings"],
        rotary_base=theta,
        rope_scaling=scaling,
        norm_epsilon=norm_eps,
        tie_embeddings=flag(hf, "tie_word_embeddings"),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        init_method_std=std,
    )
    fields.update(arch.from_hf(hf))
    fields.update(arch.fixed)
    return ModelConfig(**fields)


def hf_config_from_model(
    m: ModelConfig,
    architecture: str | None = None,
    dtype: str = "float32",
    extra: dict | None = None,
) -> dict:
    """An HF ``config.json`` dict (transformers 5 layout) for ``m`` as ``architecture``
    (default: the model's own).

    ``vocab_size`` is the unpadded one: conversion to HF strips Megatron's padding rows.
    ``extra`` (e.g. bos/eos token ids) is merged last.
    """
    try:
        arch = registry.get(architecture or m.architecture, "architecture")
    except registry.UnknownArchitecture as e:
        raise HFConfigError(str(e)) from None
    for key, want in arch.fixed.items():
        if getattr(m, key) != want:
            raise HFConfigError(
                f"model.{key}={getattr(m, key)!r} is not supported for {arch.hf_class} "
                f"(the family fixes {want!r})"
            )

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(m.rotary_base)}
    if m.rope_scaling is not None:
        rs = m.rope_scaling
        rope = {
            "rope_type": "llama3",
            "rope_theta": float(m.rotary_base),
            "factor": float(rs.factor),
            "low_freq_factor": float(rs.low_freq_factor),
            "high_freq_factor": float(rs.high_freq_factor),
            "original_max_position_embeddings": int(rs.original_max_position_embeddings),
        }

    head = architecture or m.architecture
    out: dict[str, Any] = {
        "architectures": [arch.score_class if has_score_head(head) else arch.hf_class],
        "model_type": arch.model_type,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.head_dim or m.hidden_size // m.num_attention_heads,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": float(m.norm_epsilon),
        "hidden_act": "silu",
        "initializer_range": float(m.init_method_std),
        "tie_word_embeddings": bool(m.tie_embeddings),
        "rope_parameters": rope,
        **arch.to_hf(m),
    }
    if has_score_head(head):
        out.update(id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    out["torch_dtype"] = dtype
    out["dtype"] = dtype
    out = arch.nest(out, m)
    out.update(extra or {})
    return out
