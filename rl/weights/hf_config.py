"""Map a Hugging Face ``config.json`` to a :class:`ModelConfig` and back.

Pure logic: no torch, no transformers, no Megatron, so a checkpoint's config is checked in
milliseconds, before any weight is read. Only what the Megatron model reproduces exactly is
accepted: a Llama-architecture decoder (RMSNorm, non-interleaved RoPE with optional Llama 3
scaling, SwiGLU with silu, GQA, optional QKV bias and no other bias). Anything else raises
:class:`HFConfigError` with one line naming the field and its value, instead of converting
into a model that silently computes something different.

Both RoPE layouts are read: transformers 5 writes ``rope_parameters`` (with ``rope_type``
and ``rope_theta``), older files a top-level ``rope_theta`` plus an optional
``rope_scaling`` (with ``rope_type`` or the legacy ``type``). The inverse writes the
transformers 5 form.
"""

from __future__ import annotations

from typing import Any, NoReturn

from rl.config.schema import ModelConfig, RopeScalingConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}
_LLAMA3_FIELDS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "original_max_position_embeddings",
)
_DEFAULT_ROPE_THETA = 10000.0


class HFConfigError(ValueError):
    """A config.json value the Megatron model cannot reproduce; names the field and value."""


def _fail(msg: str) -> NoReturn:
    raise HFConfigError(f"config.json: {msg}")


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _required(hf: dict, key: str) -> Any:
    if hf.get(key) is None:
        _fail(f"required key {key!r} is missing")
    return hf[key]


def _positive_int(key: str, v: Any) -> int:
    if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
        _fail(f"{key}={v!r} must be an integer >= 1")
    return v


def _positive_float(key: str, v: Any) -> float:
    if not (_is_number(v) and v > 0):
        _fail(f"{key}={v!r} must be a number > 0")
    return float(v)


def _flag(hf: dict, key: str) -> bool:
    """An optional boolean key; absent or null means False."""
    v = hf.get(key)
    if v is None:
        return False
    if not isinstance(v, bool):
        _fail(f"{key}={v!r} must be true or false")
    return v


def _architecture(hf: dict) -> str:
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    archs = hf.get("architectures")
    if archs is None:
        _fail(f"architectures is missing (supported: {supported})")
    if not isinstance(archs, list) or not archs:
        _fail(f"architectures={archs!r} must be a non-empty list (supported: {supported})")
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        _fail(f"architectures[0]={arch!r} is not supported (supported: {supported})")
    model_type = hf.get("model_type")
    if model_type is not None and model_type != _MODEL_TYPES[arch]:
        # transformers' Auto classes pick the model class from model_type, not architectures.
        _fail(f"model_type={model_type!r} does not match {arch} (need {_MODEL_TYPES[arch]!r})")
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
        _fail(f"{key}={params!r} must be a dict")

    if params.get("rope_theta") is not None:
        theta = _positive_float(f"{key}.rope_theta", params["rope_theta"])
    elif hf.get("rope_theta") is not None:
        theta = _positive_float("rope_theta", hf["rope_theta"])
    else:
        theta = _DEFAULT_ROPE_THETA

    for where, prf in (
        (f"{key}.", params.get("partial_rotary_factor")),
        ("", hf.get("partial_rotary_factor")),
    ):
        if prf is not None and prf != 1.0:
            _fail(f"{where}partial_rotary_factor={prf!r} is not supported (need 1.0)")

    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        _fail(f"{key}.rope_type={rope_type!r} is not supported (need 'default' or 'llama3')")
    values = {}
    for name in _LLAMA3_FIELDS:
        if params.get(name) is None:
            _fail(f"{key}.{name} is missing (required for rope_type 'llama3')")
        values[name] = params[name]
    return theta, RopeScalingConfig(
        factor=_positive_float(f"{key}.factor", values["factor"]),
        low_freq_factor=_positive_float(f"{key}.low_freq_factor", values["low_freq_factor"]),
        high_freq_factor=_positive_float(f"{key}.high_freq_factor", values["high_freq_factor"]),
        original_max_position_embeddings=_positive_int(
            f"{key}.original_max_position_embeddings", values["original_max_position_embeddings"]
        ),
    )


def model_config_from_hf(
    hf: dict, name: str = "hf", make_vocab_size_divisible_by: int = 128
) -> ModelConfig:
    """The :class:`ModelConfig` of an HF ``config.json`` dict; raises :class:`HFConfigError`."""
    arch = _architecture(hf)
    ints = {
        key: _positive_int(key, _required(hf, key))
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
    kv_heads = heads if kv_heads is None else _positive_int("num_key_value_heads", kv_heads)
    norm_eps = _positive_float("rms_norm_eps", _required(hf, "rms_norm_eps"))
    std = hf.get("initializer_range")
    std = 0.02 if std is None else _positive_float("initializer_range", std)

    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        _fail(
            f"head_dim={head_dim!r} is not supported (need hidden_size // num_attention_heads "
            f"= {hidden} // {heads} = {hidden // heads})"
        )
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        _fail(f"hidden_act={act!r} is not supported (need 'silu')")
    if _flag(hf, "mlp_bias"):
        _fail("mlp_bias=True is not supported (need false)")

    if arch == "LlamaForCausalLM":
        if _flag(hf, "attention_bias"):
            _fail("attention_bias=True adds an o_proj bias, which is not supported")
        qkv_bias = False
    else:  # Qwen2: q/k/v biases always, no o_proj bias
        if _flag(hf, "use_sliding_window"):
            _fail("use_sliding_window=True is not supported (need false)")
        qkv_bias = True

    theta, scaling = _rope(hf)
    return ModelConfig(
        name=name,
        num_layers=ints["num_hidden_layers"],
        hidden_size=hidden,
        ffn_hidden_size=ints["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        vocab_size=ints["vocab_size"],
        max_position_embeddings=ints["max_position_embeddings"],
        rotary_base=theta,
        rope_scaling=scaling,
        norm_epsilon=norm_eps,
        qkv_bias=qkv_bias,
        tie_embeddings=_flag(hf, "tie_word_embeddings"),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        init_method_std=std,
    )


def hf_config_from_model(
    m: ModelConfig, architecture: str, dtype: str = "float32", extra: dict | None = None
) -> dict:
    """An HF ``config.json`` dict (transformers 5 layout) for ``m`` as ``architecture``.

    ``vocab_size`` is the unpadded one: conversion to HF strips Megatron's padding rows.
    ``extra`` (e.g. bos/eos token ids) is merged last.
    """
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise HFConfigError(
            f"architecture={architecture!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    llama = architecture == "LlamaForCausalLM"
    if llama and m.qkv_bias:
        raise HFConfigError(
            "model.qkv_bias=True is not supported for LlamaForCausalLM "
            "(its attention_bias=True adds an o_proj bias); use Qwen2ForCausalLM"
        )
    if not llama and not m.qkv_bias:
        raise HFConfigError(
            "model.qkv_bias=False is not supported for Qwen2ForCausalLM "
            "(it always has q/k/v biases); use LlamaForCausalLM"
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

    out: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": _MODEL_TYPES[architecture],
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": float(m.norm_epsilon),
        "hidden_act": "silu",
        "initializer_range": float(m.init_method_std),
        "tie_word_embeddings": bool(m.tie_embeddings),
        "rope_parameters": rope,
    }
    if llama:
        out["head_dim"] = m.hidden_size // m.num_attention_heads
        out["attention_bias"] = False
        out["mlp_bias"] = False
    else:
        out["use_sliding_window"] = False
    out["torch_dtype"] = dtype
    out["dtype"] = dtype
    out.update(extra or {})
    return out
