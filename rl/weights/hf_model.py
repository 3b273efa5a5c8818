"""``model.hf_checkpoint``: the architecture comes from the checkpoint's own config.json.

Nobody should copy a model's shape into YAML by hand: when ``model.hf_checkpoint`` names a
Hugging Face directory, every architecture field of ``cfg.model`` is replaced, at launch
and before validation, by what its config.json says (rl/weights/hf_config.py maps it and
refuses what the Megatron model cannot reproduce). Only ``make_vocab_size_divisible_by``
and the vision-language choices ``train_vision`` and ``max_pixels`` (training choices, not
properties of the checkpoint) are kept from the config.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

from omegaconf import OmegaConf

from rl.config.errors import ConfigError
from rl.weights.hf_config import HFConfigError, model_config_from_hf

if TYPE_CHECKING:
    from rl.config.schema import ModelConfig, RootConfig


def hf_model_config(path: str, make_vocab_size_divisible_by: int = 1) -> ModelConfig:
    """The ModelConfig of the HF directory ``path`` (one-line ConfigError if unusable)."""
    field = f"model.hf_checkpoint={path!r}"
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{field} does not exist")
    if not p.is_dir():
        raise ConfigError(f"{field} is not a directory")
    if not (p / "config.json").is_file():
        raise ConfigError(f"{field} has no config.json")
    if not list(p.glob("*.safetensors")):
        raise ConfigError(f"{field} has no *.safetensors weights")
    try:
        hf = json.loads((p / "config.json").read_text())
        m = model_config_from_hf(hf, p.resolve().name, make_vocab_size_divisible_by)
    except (json.JSONDecodeError, HFConfigError) as e:
        raise ConfigError(f"{field}: {e}") from None
    return replace(m, hf_checkpoint=str(p))


def resolve_model(cfg: RootConfig) -> None:
    """Fill ``cfg.model`` from ``model.hf_checkpoint``'s config.json, in place."""
    path = cfg.model.hf_checkpoint
    if not path:
        return
    c = cfg.model
    m = hf_model_config(path, c.make_vocab_size_divisible_by)
    # The training choices are the config's, not the checkpoint's.
    m = replace(m, train_vision=c.train_vision, max_pixels=c.max_pixels)
    # A DictConfig of the schema's fields, as cfg.model was (every one of them is set by
    # ``m``; a merge into the old one would refuse the vision tower's new keys).
    cfg.model = cast("ModelConfig", OmegaConf.structured(m))
