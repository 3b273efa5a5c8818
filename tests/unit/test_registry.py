"""The architecture registry: each family declared once, and what it declares is true.

Checked against transformers for every family: the tensor names and shapes it writes to
disk, its parameter count, and its config.json both ways. Then the one-line refusals of
configurations an architecture cannot hold, and that no code outside the family modules
branches on a family.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import transformers
from safetensors import safe_open

from rl.checks import check
from rl.config import ConfigError
from rl.models import registry
from rl.models.arch import Dims
from rl.models.registry import active_count
from rl.models.shapes import param_count
from rl.weights import keymap as km
from rl.weights.hf_config import HFConfigError, hf_config_from_model, model_config_from_hf
from tests.helpers.configs import composed
from tests.helpers.hf_models import make_model, tiny_models

ROOT = Path(__file__).resolve().parents[2]
# Every family's tiny test models (Arch.tiny), by kind: the registry's own list.
KINDS = {kind: arch.hf_class for kind, arch in tiny_models().items()}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {k: make_model(k, root / k) for k in KINDS}


def _on_disk(path: Path) -> dict[str, tuple[int, ...]]:
    out = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            out[name] = tuple(f.get_slice(name).get_shape())
    return out


def test_every_family_module_is_registered_once() -> None:
    modules = sorted(p.stem for p in (ROOT / "rl/models/families").glob("*.py"))
    modules.remove("__init__")
    archs = registry.architectures()
    assert sorted(a.name for a in archs.values()) == modules
    vision = {a.hf_class for a in tiny_models(vision=True).values()}
    assert set(KINDS.values()) | vision == set(archs)
    assert len({a.model_type for a in archs.values()}) == len(archs)


@pytest.mark.parametrize("kind", list(KINDS))
def test_family_matches_transformers(models, kind: str) -> None:
    """Names and shapes on disk, the parameter count, and config.json both ways."""
    path = models[kind]
    hf = json.loads((path / "config.json").read_text())
    m = model_config_from_hf(hf, name=kind)
    assert m.architecture == KINDS[kind]
    d = Dims.of(m)
    assert km.hf_shapes(d) == _on_disk(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert param_count(m) == sum(p.numel() for p in model.parameters())
    # The inverse writes a config transformers reads back as the same model.
    back = hf_config_from_model(m, extra={"bos_token_id": 1, "eos_token_id": 2})
    cfg = transformers.CONFIG_MAPPING[back["model_type"]].from_dict(back)
    assert type(transformers.AutoModelForCausalLM.from_config(cfg)).__name__ == KINDS[kind]
    assert model_config_from_hf(cfg.to_dict(), name=kind) == m


def test_moe_active_parameters_count_top_k_experts(models) -> None:
    m = model_config_from_hf(json.loads((models["qwen3_moe"] / "config.json").read_text()))
    d = Dims.of(m)
    expert = 3 * m.moe_ffn_hidden_size * m.hidden_size
    assert active_count(d, m.moe_router_topk) == active_count(d, m.num_experts) - 2 * expert


# ------------------------------------------------------------------ refusals, one line
def _refused(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        check(composed(overrides))
    msg = str(e.value)
    assert "\n" not in msg
    return msg


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        (["model=tiny_moe", "trainer.tp=4"], ["trainer.tp=4", "num_query_groups=2"]),
        (["model=tiny_moe", "trainer.dp=3", "trainer.ep=3"], ["trainer.ep=3", "num_experts=4"]),
        (["model=tiny_moe", "trainer.ep=2"], ["trainer.ep=2", "trainer.dp=1"]),
        (["trainer.ep=2", "trainer.dp=2"], ["trainer.ep=2", "Mixture-of-Experts"]),
        (["model.architecture=GPT2LMHeadModel"], ["model.architecture='GPT2LMHeadModel'"]),
        (["model=tiny_moe", "model.qk_norm=false"], ["model.qk_norm=False", "Qwen3Moe"]),
        (["model=tiny_moe", "model.moe_router_topk=5"], ["model.moe_router_topk=5"]),
        (["model=tiny_moe", "model.num_experts=0"], ["model.num_experts=0", "Mixture"]),
        (["algorithm.routing_replay=true"], ["algorithm.routing_replay=true", "dense model"]),
        (
            [
                "model=tiny_moe",
                "algorithm.routing_replay=true",
                "trainer.pp=2",
                "trainer.recompute=full",
            ],
            ["trainer.recompute=full needs trainer.pp=1"],
        ),
    ],
)
def test_unsupported_configurations_are_named(overrides: list[str], fragments: list[str]) -> None:
    msg = _refused(overrides)
    for f in fragments:
        assert f in msg, msg


def test_unknown_model_type_in_config_json_is_named(models) -> None:
    hf = json.loads((models["qwen3"] / "config.json").read_text())
    with pytest.raises(HFConfigError, match="model_type='qwen9'"):
        model_config_from_hf({**hf, "model_type": "qwen9"})
    mistral = json.loads((models["mistral"] / "config.json").read_text())
    with pytest.raises(HFConfigError, match="sliding_window=64 is shorter"):
        model_config_from_hf({**mistral, "sliding_window": 64})  # the context is 128
    with pytest.warns(UserWarning, match="sliding_window=128 covers the context"):
        model_config_from_hf({**mistral, "sliding_window": 128})


# ------------------------------------------------------------------ one place per family
_DEFAULTS = {  # the default family, named as a default value, is not a branch
    ("rl/config/schema.py", 'architecture: str = "LlamaForCausalLM"'),
    ("rl/models/arch.py", 'arch: str = "LlamaForCausalLM"'),
    ("rl/config/ckpt_check.py", '"architecture": "LlamaForCausalLM",'),
}


def test_no_code_outside_the_registry_names_a_family() -> None:
    archs = registry.architectures().values()
    names = [a.hf_class for a in archs] + [a.model_type for a in archs]
    pattern = re.compile("[\"'](" + "|".join(map(re.escape, names)) + ")[\"']")
    found = set()
    for f in (ROOT / "rl").rglob("*.py"):
        rel = str(f.relative_to(ROOT))
        if rel.startswith("rl/models/families/"):
            continue
        for line in f.read_text().splitlines():
            if pattern.search(line):
                found.add((rel, line.strip()))
    assert found == _DEFAULTS
