"""Every YAML file under conf/ (new ones included) composes, type-checks and validates, and
holds what the file says: one test per file, so this class grows with conf/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from rl.checks import check
from rl.config import CONF_DIR, compose

CONF_FILES = sorted(CONF_DIR.rglob("*.yaml"))

# Overrides that make a preset fit a real layout (the default trainer is the 2-rank CPU one).
FITTING_OVERRIDES: dict[str, list[str]] = {
    "model/llama3_8b": ["trainer.tp=8"],
    "model/llama3_70b": ["trainer.tp=8"],
    "model/llama3_405b": ["trainer.tp=8"],
    "model/qwen2_5_7b": ["trainer.tp=4"],  # 28 heads and 4 KV heads: TP8 does not divide them
    # GPU presets are sized for their model (TP8 does not divide the tiny model's 6 heads).
    "trainer/gpu_8b": ["model=llama3_8b"],
    "trainer/gpu_70b": ["model=llama3_70b"],
    "trainer/gpu_405b": ["model=llama3_405b"],
    "rollout/gpu_fp8": ["model=llama3_8b", "trainer.tp=8"],
    # Two nodes split training from generation: only a transport that crosses hosts fits.
    "cluster/slurm": ["rollout.weight_sync.transport=p2p"],
    "cluster/slurm_cpu": ["rollout.weight_sync.transport=p2p"],
}


def _conf_id(path: Path) -> str:
    return path.relative_to(CONF_DIR).with_suffix("").as_posix()


def _compose_file(path: Path) -> tuple[DictConfig, list[str]]:
    """Compose ``path`` the way the CLI selects it; return the config and the overrides."""
    rel = path.relative_to(CONF_DIR).with_suffix("")
    if rel.parent == Path("."):
        return compose([], config_name=rel.name), []
    overrides = [f"{rel.parent.as_posix()}={rel.name}", *FITTING_OVERRIDES.get(_conf_id(path), [])]
    if rel.parent.as_posix() != "experiment":  # the group file alone, not what an experiment
        overrides.insert(1, "~experiment")  # on top of it changes
    return compose(overrides), overrides


def _assert_contains(expected: Any, actual: Any, where: str) -> None:  # YAML values
    """Every value the YAML file sets appears, unchanged, in the composed config."""
    if isinstance(expected, dict):
        for key, value in expected.items():
            assert key in actual, f"{where}.{key} missing from the composed config"
            _assert_contains(value, actual[key], f"{where}.{key}")
    else:
        assert actual == expected, f"{where}: composed {actual!r}, file says {expected!r}"


def test_conf_discovery_finds_known_presets() -> None:
    """Guards the glob below: an empty or misplaced conf/ would make the sweep vacuous."""
    ids = {_conf_id(p) for p in CONF_FILES}
    expected = {
        "config",
        "model/tiny",
        "model/llama3_8b",
        "model/llama3_70b",
        "model/llama3_405b",
        "trainer/cpu_tp1",
        "trainer/cpu_tp2",
        "rollout/cpu",
        "algorithm/aipo",
        "algorithm/grpo",
        "cluster/local",
        "experiment/tiny_sft",
        "experiment/tiny_arithmetic",
    }
    assert expected <= ids


@pytest.mark.parametrize("path", CONF_FILES, ids=_conf_id)
def test_every_conf_file_composes_and_validates(path: Path) -> None:
    """Each YAML under conf/ (new ones included) type-checks, composes and validates."""
    cfg, overrides = _compose_file(path)
    check(cfg)

    for override in overrides[1:]:
        if override.startswith("~") or "." not in override.split("=", 1)[0]:
            continue  # a deletion or a group choice (model=...), not a value
        key, value = override.split("=", 1)
        got = OmegaConf.select(cfg, key)
        got = OmegaConf.to_container(got) if isinstance(got, ListConfig) else got
        assert got == yaml.safe_load(value) or str(got) == value

    text = path.read_text()
    data = yaml.safe_load(text) or {}
    body = {k: v for k, v in data.items() if k not in ("defaults", "hydra")}
    container = OmegaConf.to_container(cfg, resolve=False)
    rel = path.relative_to(CONF_DIR)
    if rel.parent == Path(".") or "@package _global_" in text:
        _assert_contains(body, container, "<root>")
    else:
        group = rel.parent.as_posix().replace("/", ".")
        _assert_contains(body, OmegaConf.select(cfg, group), group)
