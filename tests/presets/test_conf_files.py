"""Every YAML file under conf/ (new ones included) composes, type-checks and validates, and
holds what the file says: one test per file, so this class grows with conf/."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from rl.checks import check
from rl.compose import compose
from rl.config import CONF_DIR
from rl.config.errors import ConfigError

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
    # A critic learns GAE's returns: PPO's estimator, one sample per prompt.
    "critic/tiny": ["algorithm/advantage=gae", "algorithm.group_size=1", "rl.prompts_per_step=64"],
    "critic/gpu": ["algorithm/advantage=gae"],
    # The frozen models need their HF directory ({reward_model}, {teacher}: made by the
    # hf_dirs fixture) and a use.
    "reward_model/cpu": ["reward_model.hf_checkpoint={reward_model}", "reward.fn=model"],
    "reward_model/gpu": ["reward_model.hf_checkpoint={reward_model}", "reward.fn=model"],
    "teacher/cpu": ["teacher.hf_checkpoint={teacher}", "algorithm.distill_coef=1"],
    "teacher/gpu": ["teacher.hf_checkpoint={teacher}", "algorithm.distill_coef=1"],
}  # fmt: skip


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    """A tiny reward model and teacher with the tiny policy's vocabulary (the teacher with
    8 heads and 8 KV heads: the GPU preset's TP8 divides them)."""
    from tests.helpers.hf_models import make_model

    root, tiny = tmp_path_factory.mktemp("hf"), {"vocab_size": 32, "num_hidden_layers": 2}
    return {
        "reward_model": str(make_model("llama", root / "rm", score=True, extra=tiny)),
        "teacher": str(
            make_model(
                "llama",
                root / "teacher",
                extra={**tiny, "num_attention_heads": 8, "num_key_value_heads": 8},
            )
        ),
    }


def _conf_id(path: Path) -> str:
    return path.relative_to(CONF_DIR).with_suffix("").as_posix()


def _compose_file(path: Path, dirs: dict[str, str]) -> tuple[DictConfig, list[str]]:
    """Compose ``path`` the way the CLI selects it; return the config and the overrides."""
    rel = path.relative_to(CONF_DIR).with_suffix("")
    if rel.parent == Path("."):
        return compose([], config_name=rel.name), []
    fitting = [o.format(**dirs) for o in FITTING_OVERRIDES.get(_conf_id(path), [])]
    overrides = [f"{rel.parent.as_posix()}={rel.name}", *fitting]
    if rel.parent.as_posix() != "experiment":  # the group file alone, not what an experiment
        overrides.insert(1, "~experiment")  # on top of it changes
    return compose(overrides), overrides


def _assert_contains(expected: Any, actual: Any, where: str, cfg: DictConfig) -> None:
    """Every value the YAML file sets appears, unchanged, in the composed config (a
    ``${key}`` value as the value of ``key``)."""
    if isinstance(expected, dict):
        for key, value in expected.items():
            assert key in actual, f"{where}.{key} missing from the composed config"
            _assert_contains(value, actual[key], f"{where}.{key}", cfg)
        return
    if expected == "???":  # a value the user must give (the test's override gave it)
        return
    if isinstance(expected, str) and expected.startswith("${") and expected.endswith("}"):
        expected = OmegaConf.select(cfg, expected[2:-1])
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
def test_every_conf_file_composes_and_validates(path: Path, hf_dirs: dict[str, str]) -> None:
    """Each YAML under conf/ (new ones included) type-checks, composes and validates."""
    cfg, overrides = _compose_file(path, hf_dirs)
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
        _assert_contains(body, container, "<root>", cfg)
    else:
        group = rel.parent.as_posix().replace("/", ".")
        _assert_contains(body, OmegaConf.select(cfg, group), group, cfg)


def _registered() -> list[tuple[str, str, type]]:
    """Every choice a registry adds to a config group (rl/compose.py): group, name and
    its config dataclass."""
    from rl import tasks
    from rl.algorithms import registry

    groups = {"task": tasks.registry(), "algorithm/objective": registry.objectives(),
              "algorithm/correction": registry.corrections(),
              "algorithm/advantage": registry.estimators()}  # fmt: skip
    return [(g, name, c.config) for g, choices in groups.items() for name, c in choices.items()]


# What a choice needs beside it to pass the checks: PPO's and GSPO's clips are their own
# corrections.
BESIDE = {"algorithm/objective=ppo_clip": ["algorithm/correction=none"],
          "algorithm/objective=gspo": ["algorithm/correction=none"]}  # fmt: skip
# What no config of conf/ can give an estimator yet, and the line that refuses it.
REFUSED = {"gae": "algorithm/advantage=gae needs a critic's value for every token"}


@pytest.mark.parametrize(
    ("group", "name", "config"), _registered(), ids=[f"{g}={n}" for g, n, _ in _registered()]
)
def test_every_registered_choice_composes_typed_and_validates(
    group: str, name: str, config: type
) -> None:
    """Each task, objective and correction, picked by its group, composes with its own
    config dataclass (the defaults it declares) and passes the checks."""
    choice = f"{group}={name}"
    cfg = compose([choice, "~experiment", *BESIDE.get(choice, [])])
    node = OmegaConf.select(cfg, group.replace("/", "."))
    assert OmegaConf.get_type(node) is config and node.name == name
    assert OmegaConf.to_container(node) == OmegaConf.to_container(OmegaConf.structured(config))
    if group == "algorithm/advantage" and name in REFUSED:
        with pytest.raises(ConfigError, match=f"^{REFUSED[name]}"):
            check(cfg)
    elif group != "task":  # a task of files is checked against its files (tests/unit)
        check(cfg)


EXPERIMENTS = [p for p in CONF_FILES if p.parent.name == "experiment"]


@pytest.mark.parametrize("path", EXPERIMENTS, ids=_conf_id)
def test_every_experiment_takes_every_estimator_that_fits_it(path: Path) -> None:
    """Each experiment (its algorithm preset) with each advantage estimator: it passes
    the checks, or is refused in one line naming what the estimator lacks."""
    from rl.algorithms.registry import estimators

    _, overrides = _compose_file(path, {})
    for name in estimators():
        cfg = compose([*overrides, f"algorithm/advantage={name}"])
        if name in REFUSED:
            with pytest.raises(ConfigError, match=f"^{REFUSED[name]}") as info:
                check(cfg)
            assert "\n" not in str(info.value)
        else:
            check(cfg)
