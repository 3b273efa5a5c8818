"""HF config.json <-> ModelConfig, checked against real transformers configs and models."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import transformers
from omegaconf import OmegaConf

from rl.config.schema import ModelConfig, RopeScalingConfig
from rl.models import registry
from rl.models.shapes import param_count
from rl.weights.hf_config import HFConfigError, hf_config_from_model, model_config_from_hf
from tests.helpers.hf_models import LLAMA3_ROPE

# The text families (a vision-language family's config.json: tests/unit/test_vision_config.py).
SUPPORTED_ARCHITECTURES = tuple(a for a, x in registry.architectures().items() if x.vision is None)

ROOT = Path(__file__).resolve().parents[2]
LLAMA, QWEN2 = "LlamaForCausalLM", "Qwen2ForCausalLM"
LLAMA3_SCALING = RopeScalingConfig(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
)
# Small GQA shapes: head dim 16, 4 query heads in 2 groups, vocab not a multiple of anything.
SMALL = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=176,
    num_hidden_layers=2,
    vocab_size=99,
)


def _hf(arch: str, **kwargs: Any) -> dict:
    """A config.json dict as transformers itself writes it, for ``arch``."""
    cls = transformers.CONFIG_MAPPING[registry.get(arch).model_type]
    window = {"sliding_window": None} if "sliding_window" in cls().to_dict() else {}
    return cls(architectures=[arch], **{**SMALL, **window, **kwargs}).to_dict()


def _model(**changes: Any) -> ModelConfig:
    base = ModelConfig(
        name="small",
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=176,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=99,
        max_position_embeddings=256,
        rotary_base=10000.0,
        norm_epsilon=1e-5,
        make_vocab_size_divisible_by=128,
        init_method_std=0.02,
    )
    return dataclasses.replace(base, **changes)


# --- HF -> ModelConfig, from real transformers configs ----------------------------------


def test_llama_maps_every_field() -> None:
    hf = _hf(
        LLAMA,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        initializer_range=0.01,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
    )
    m = model_config_from_hf(hf, name="tiny-llama", make_vocab_size_divisible_by=64)
    assert m == ModelConfig(
        name="tiny-llama",
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=176,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=99,
        max_position_embeddings=256,
        rotary_base=20000.0,
        rope_scaling=None,
        norm_epsilon=1e-5,
        qkv_bias=False,
        tie_embeddings=False,
        make_vocab_size_divisible_by=64,
        init_method_std=0.01,
    )


def test_qwen2_maps_every_field_with_qkv_bias() -> None:
    hf = _hf(
        QWEN2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    )
    m = model_config_from_hf(hf)
    assert m == ModelConfig(
        architecture=QWEN2,
        name="hf",
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=176,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=99,
        max_position_embeddings=512,
        rotary_base=1000000.0,
        rope_scaling=None,
        norm_epsilon=1e-6,
        qkv_bias=True,
        tie_embeddings=False,
        make_vocab_size_divisible_by=128,
        init_method_std=0.02,
    )


def test_llama3_rope_scaling() -> None:
    hf = _hf(LLAMA, max_position_embeddings=131072, rope_parameters=dict(LLAMA3_ROPE))
    # transformers 5 keeps the scaling in rope_parameters, not rope_scaling/rope_theta.
    assert hf["rope_parameters"]["rope_type"] == "llama3"
    m = model_config_from_hf(hf)
    assert m.rotary_base == 500000.0
    assert m.rope_scaling == LLAMA3_SCALING
    assert isinstance(m.rope_scaling.original_max_position_embeddings, int)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_tied_embeddings(arch: str) -> None:
    assert model_config_from_hf(_hf(arch, tie_word_embeddings=True)).tie_embeddings is True
    assert model_config_from_hf(_hf(arch, tie_word_embeddings=False)).tie_embeddings is False


def test_missing_optional_keys_take_transformers_defaults() -> None:
    """Absent optional keys map to what transformers itself assumes for them."""
    minimal = {
        "architectures": [LLAMA],
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "vocab_size": 99,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
    }
    m = model_config_from_hf(minimal)
    assert m.num_query_groups == 4  # MHA
    assert (m.rotary_base, m.rope_scaling) == (10000.0, None)
    assert (m.tie_embeddings, m.qkv_bias, m.init_method_std) == (False, False, 0.02)
    ref = transformers.LlamaConfig.from_dict(minimal)
    assert m.num_query_groups == ref.num_key_value_heads
    assert m.rotary_base == ref.rope_parameters["rope_theta"]
    assert m.tie_embeddings == ref.tie_word_embeddings
    assert m.init_method_std == ref.initializer_range
    assert ref.hidden_act == "silu" and ref.attention_bias is False and ref.mlp_bias is False


# --- Legacy layout: top-level rope_theta + rope_scaling ---------------------------------


def test_legacy_rope_scaling_with_type_maps_the_same() -> None:
    new = _hf(LLAMA, max_position_embeddings=131072, rope_parameters=dict(LLAMA3_ROPE))
    legacy = {k: v for k, v in new.items() if k != "rope_parameters"}
    legacy["rope_theta"] = 500000.0
    legacy["rope_scaling"] = {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert model_config_from_hf(legacy) == model_config_from_hf(new)
    assert model_config_from_hf(legacy).rope_scaling == LLAMA3_SCALING
    # transformers reads the legacy file the same way.
    ref = transformers.LlamaConfig.from_dict(legacy).rope_parameters
    assert {k: ref[k] for k in LLAMA3_ROPE} == LLAMA3_ROPE


def test_legacy_rope_theta_without_scaling() -> None:
    new = _hf(QWEN2, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    legacy = {k: v for k, v in new.items() if k != "rope_parameters"}
    legacy["rope_theta"] = 1000000.0
    legacy["rope_scaling"] = None
    m = model_config_from_hf(legacy)
    assert m == model_config_from_hf(new)
    assert (m.rotary_base, m.rope_scaling) == (1000000.0, None)


def test_published_llama31_8b_matches_the_preset() -> None:
    """The published Llama-3.1-8B config.json (legacy layout) is conf/model/llama3_8b.yaml."""
    published = {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 14336,
        "max_position_embeddings": 131072,
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "pretraining_tp": 1,
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": 128256,
    }
    preset = OmegaConf.load(ROOT / "conf" / "model" / "llama3_8b.yaml")
    preset.pop("defaults")
    expected = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), preset))
    m = model_config_from_hf(
        published,
        name="llama3_8b",
        make_vocab_size_divisible_by=expected.make_vocab_size_divisible_by,
    )
    assert m == expected
    assert param_count(m) == 8_030_261_248  # Llama-3.1-8B's published parameter count


# --- ModelConfig -> HF, loaded by transformers ------------------------------------------

CASES = [
    pytest.param(LLAMA, {}, id="llama"),
    pytest.param(
        LLAMA,
        dict(rotary_base=500000.0, rope_scaling=LLAMA3_SCALING, max_position_embeddings=16384),
        id="llama-llama3-rope",
    ),
    pytest.param(LLAMA, dict(tie_embeddings=True, norm_epsilon=1e-6), id="llama-tied"),
    pytest.param(QWEN2, dict(qkv_bias=True, rotary_base=1e6), id="qwen2"),
    pytest.param(QWEN2, dict(qkv_bias=True, tie_embeddings=True), id="qwen2-tied"),
]


@pytest.mark.parametrize(("arch", "changes"), CASES)
def test_round_trip(arch: str, changes: dict) -> None:
    m = _model(architecture=arch, **changes)
    hf = hf_config_from_model(m, arch)
    back = model_config_from_hf(hf, name=m.name, make_vocab_size_divisible_by=128)
    assert back == m


@pytest.mark.parametrize(("arch", "changes"), CASES)
def test_loads_in_transformers_with_the_same_param_count(
    arch: str, changes: dict, tmp_path: Path
) -> None:
    m = _model(architecture=arch, **changes)
    hf = hf_config_from_model(m, arch, extra={"bos_token_id": 1, "eos_token_id": 2})
    (tmp_path / "config.json").write_text(json.dumps(hf, indent=2))

    cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    want_cfg = transformers.LlamaConfig if arch == LLAMA else transformers.Qwen2Config
    assert type(cfg) is want_cfg
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    # What transformers read back is the same model.
    assert model_config_from_hf(cfg.to_dict(), name=m.name) == m

    model = transformers.AutoModelForCausalLM.from_config(cfg)
    assert type(model).__name__ == arch
    n = sum(p.numel() for p in model.parameters())
    assert n == param_count(m)
    attn = model.model.layers[0].self_attn
    assert (attn.q_proj.bias is not None) == m.qkv_bias
    assert (attn.k_proj.bias is not None) == m.qkv_bias
    assert attn.o_proj.bias is None
    mlp = model.model.layers[0].mlp
    assert mlp.gate_proj.bias is None and mlp.down_proj.bias is None
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == m.tie_embeddings


def test_hf_config_from_model_fields() -> None:
    hf = hf_config_from_model(
        _model(rotary_base=500000.0, rope_scaling=LLAMA3_SCALING, vocab_size=99),
        LLAMA,
        dtype="bfloat16",
        extra={"eos_token_id": 7, "hidden_act": "silu"},
    )
    assert hf["architectures"] == [LLAMA] and hf["model_type"] == "llama"
    assert hf["vocab_size"] == 99  # unpadded, although make_vocab_size_divisible_by=128
    assert hf["rope_parameters"] == LLAMA3_ROPE
    assert hf["head_dim"] == 16
    assert (hf["attention_bias"], hf["mlp_bias"]) == (False, False)
    assert (hf["torch_dtype"], hf["dtype"]) == ("bfloat16", "bfloat16")
    assert hf["eos_token_id"] == 7
    q = hf_config_from_model(_model(qkv_bias=True), QWEN2)
    assert q["model_type"] == "qwen2" and q["use_sliding_window"] is False
    assert q["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    assert "attention_bias" not in q
    json.dumps(q)  # serialisable as config.json


@pytest.mark.parametrize(
    ("arch", "changes", "needles"),
    [
        ("GPT2LMHeadModel", {}, ["architecture='GPT2LMHeadModel'", LLAMA, QWEN2]),
        (LLAMA, dict(qkv_bias=True), ["qkv_bias=True", LLAMA]),
        (QWEN2, dict(qkv_bias=False), ["qkv_bias=False", QWEN2]),
    ],
)
def test_hf_config_from_model_rejects(arch: str, changes: dict, needles: list[str]) -> None:
    with pytest.raises(HFConfigError) as e:
        hf_config_from_model(_model(**changes), arch)
    for needle in needles:
        assert needle in str(e.value)


# --- Rejections --------------------------------------------------------------------------


def _without(hf: dict, key: str) -> dict:
    return {k: v for k, v in hf.items() if k != key}


REJECTIONS = [
    pytest.param(
        lambda: {**_hf(LLAMA), "architectures": ["GPT2LMHeadModel"], "model_type": None},
        ["architectures[0]='GPT2LMHeadModel'", LLAMA, QWEN2],
        id="unsupported-architecture",
    ),
    pytest.param(
        lambda: {**_hf(LLAMA), "model_type": "gpt2"},
        ["model_type='gpt2'", "llama", "qwen3_moe"],
        id="unknown-model-type",
    ),
    pytest.param(
        lambda: _without(_hf(LLAMA), "architectures"), ["architectures"], id="no-architectures"
    ),
    pytest.param(lambda: {**_hf(LLAMA), "architectures": None}, ["architectures"], id="arch-null"),
    pytest.param(
        lambda: {**_hf(LLAMA), "architectures": "LlamaForCausalLM"},
        ["architectures='LlamaForCausalLM'", "list"],
        id="arch-not-a-list",
    ),
    pytest.param(
        lambda: {**_hf(LLAMA), "model_type": "qwen2"},
        ["model_type='qwen2'", "'llama'"],
        id="model-type-mismatch",
    ),
    pytest.param(
        lambda: _without(_hf(LLAMA), "intermediate_size"),
        ["'intermediate_size'", "missing"],
        id="missing-intermediate-size",
    ),
    pytest.param(
        lambda: _without(_hf(QWEN2), "rms_norm_eps"),
        ["'rms_norm_eps'", "missing"],
        id="missing-rms-norm-eps",
    ),
    pytest.param(
        lambda: {**_hf(LLAMA), "hidden_size": 64.0},
        ["hidden_size=64.0", "integer"],
        id="float-hidden-size",
    ),
    pytest.param(lambda: _hf(LLAMA, hidden_act="gelu"), ["hidden_act='gelu'", "'silu'"], id="gelu"),
    pytest.param(
        lambda: _hf(LLAMA, attention_bias=True),
        ["attention_bias=True", "o_proj"],
        id="llama-attention-bias",
    ),
    pytest.param(
        lambda: _hf(QWEN2, use_sliding_window=True, sliding_window=32),
        ["use_sliding_window=True"],
        id="qwen2-sliding-window",
    ),
    pytest.param(
        lambda: _hf(
            LLAMA,
            max_position_embeddings=16384,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 4096,
            },
        ),
        ["rope_parameters.rope_type='yarn'"],
        id="yarn",
    ),
    pytest.param(
        lambda: {
            **_without(_hf(LLAMA), "rope_parameters"),
            "rope_theta": 10000.0,
            "rope_scaling": {"type": "linear", "factor": 2.0},
        },
        ["rope_scaling.rope_type='linear'"],
        id="legacy-linear",
    ),
    pytest.param(
        lambda: {
            **_hf(LLAMA),
            "rope_parameters": {k: v for k, v in LLAMA3_ROPE.items() if k != "low_freq_factor"},
        },
        ["rope_parameters.low_freq_factor", "missing"],
        id="llama3-missing-field",
    ),
    pytest.param(
        lambda: {
            **_hf(LLAMA),
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
            },
        },
        ["partial_rotary_factor=0.5"],
        id="partial-rotary",
    ),
    pytest.param(lambda: _hf(LLAMA, mlp_bias=True), ["mlp_bias=True"], id="mlp-bias"),
    pytest.param(lambda: {**_hf(QWEN2), "mlp_bias": True}, ["mlp_bias=True"], id="qwen2-mlp-bias"),
]


@pytest.mark.parametrize(("make", "needles"), REJECTIONS)
def test_rejects(make: Any, needles: list[str]) -> None:
    hf = make()
    with pytest.raises(HFConfigError) as e:
        model_config_from_hf(hf)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config.json: ")
    for needle in needles:
        assert needle in msg, msg


def test_error_is_a_value_error() -> None:
    assert issubclass(HFConfigError, ValueError)


def test_module_is_pure() -> None:
    """No torch, transformers or Megatron: the config is checked before any weight is read."""
    tree = ast.parse((ROOT / "rl" / "weights" / "hf_config.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module)
    allowed = {"__future__", "json", "dataclasses", "typing", "rl.config.schema", "rl.models"}
    assert imported <= allowed | {"rl.models.arch", "rl.models.hf_fields"}
