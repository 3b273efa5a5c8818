"""Checks of the files and directories a config names, run in the launcher before any rank.

Why: each of these used to surface on some rank a minute or more into the run, as a long
traceback: a server that cannot find its model, a checkpoint shard cut short (a bare
``EOFError``), an output directory that cannot be written. Reading a few small files
finds them in milliseconds. Every check raises :class:`ConfigError` with one line naming
the field and its value.

The run directory is special: Hydra creates it (``hydra.run.dir`` is ``run.output_dir``)
before it calls the job's main, so every check runs earlier, in a Hydra callback
(rl/checks.py: ``PrelaunchCheck``, registered in conf/config.yaml), and the run directory
is checked without being created: a config that cannot work writes nothing.

Pure config layer: pathlib, json and rl/config/ckpt_check.py; no torch, Megatron or SGLang.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from omegaconf import DictConfig, OmegaConf

from rl.config import ckpt_check, lora_base
from rl.config.errors import ConfigError, require

if TYPE_CHECKING:
    from rl.config.schema import RootConfig

WEIGHT_GLOBS = ("*.safetensors", "*.bin")  # what SGLang loads a model directory from


def check_output_dir(path: str, field: str | None = None) -> None:
    """``run.output_dir`` (or what ``field`` names) must be a directory this process can
    create files in, or one it can create: checked on it, or on its nearest existing
    parent, leaving nothing there (a directory made and removed: permission bits pass
    root anywhere, and /proc refuses new entries whatever they say)."""
    field = field or f"run.output_dir={path!r}"
    p = Path(path).absolute()
    require(not p.exists() or p.is_dir(), f"{field} is a file, not a directory")
    there = next(q for q in (p, *p.parents) if q.exists())
    if not there.is_dir():
        raise ConfigError(f"{field} cannot be written: Not a directory ({there} is a file)")
    if not os.access(there, os.W_OK | os.X_OK):
        raise ConfigError(f"{field} cannot be written: {there} is not writable")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".msrl-probe-", dir=there))
    except OSError as e:
        raise ConfigError(
            f"{field} cannot be written: no directory can be made in {there} ({e.strerror})"
        ) from None


def check_hf_dir(path: str, field: str) -> dict[str, Any]:
    """A Hugging Face model directory a server starts from: its config.json (returned,
    parsed) and weights must be there."""
    name = f"{field}={path!r}"
    p = Path(path)
    require(p.exists(), f"{name} does not exist")
    require(p.is_dir(), f"{name} is not a directory")
    cfg_file = p / "config.json"
    require(cfg_file.is_file(), f"{name} has no config.json")
    try:
        hf = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{name}: config.json is unreadable ({e})") from None
    require(isinstance(hf, dict), f"{name}: config.json is not a JSON object")
    require(
        any(next(p.glob(g), None) for g in WEIGHT_GLOBS),
        f"{name} has no weights ({' or '.join(WEIGHT_GLOBS)})",
    )
    return dict(hf)


def max_positions(hf: dict[str, Any]) -> int | None:
    """``max_position_embeddings`` of a config.json (multimodal ones nest it)."""
    text = hf.get("text_config", hf)
    n = text.get("max_position_embeddings") if isinstance(text, dict) else None
    return n if isinstance(n, int) else None


def check_rollout_model(cfg: RootConfig) -> None:
    """``rollout.model_path``: a model directory whose context holds the rollouts' (which
    check_task measured against rollout.context_length or the policy's positions)."""
    path = cfg.rollout.model_path
    if not path:
        return
    hf = check_hf_dir(path, "rollout.model_path")
    n, r = max_positions(hf), cfg.rollout
    context = r.context_length or cfg.model.max_position_embeddings
    require(
        n is None or context <= n,
        f"rollout.model_path={path!r} has max_position_embeddings={n} in its config.json, "
        f"below the rollouts' context of {context} tokens (rollout.context_length or "
        "model.max_position_embeddings); SGLang refuses a longer context",
    )


def check_checkpoint(path: str, field: str, model: dict[str, Any] | None = None) -> None:
    """A Megatron torch_dist checkpoint a rank will load: complete on disk (metadata, the
    common state, every shard as long as the metadata says) and, given ``model`` (the
    model config as plain data), saved for that architecture."""
    name = f"{field}={path!r}"
    p = Path(path)
    try:
        problem = ckpt_check.problem(p)
        if problem is None and model is not None:
            common = ckpt_check.read_common(p)
            diffs = ckpt_check.architecture_diffs(common.get("model_config"), model)
            problem = "is for a different model: " + "; ".join(diffs) if diffs else None
            if problem is None and (ref := (common.get("lora") or {}).get("base")):
                base = lora_base.resolve(ref, p)  # LoRA adapters only: their base, by content
                if (sub := ckpt_check.problem(Path(base))) is not None:
                    problem = f"names a LoRA base {base!r} that {sub}"
    except (OSError, ckpt_check.Unreadable) as e:
        problem = f"cannot be read: {e}"
    except lora_base.BaseError as e:
        require(False, f"{field}: {e}")
    require(problem is None, f"{name} {problem}")


def prelaunch(cfg: RootConfig) -> None:
    """Every file check of ``cfg`` (after :func:`rl.checks.check`, which checked the
    values, and resolve_model, which checked model.hf_checkpoint's files)."""
    check_output_dir(str(cfg.run.output_dir))
    check_rollout_model(cfg)
    if cfg.trainer.load_dir:
        plain = OmegaConf.to_container(cast(DictConfig, cfg.model), resolve=True)
        model = cast("dict[str, Any]", plain)
        check_checkpoint(cfg.trainer.load_dir, "trainer.load_dir", model)
