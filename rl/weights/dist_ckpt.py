"""Megatron's ``torch_dist`` checkpoint format: what every writer and reader shares.

Model weights are stored as sharded tensors with their global shapes, so a checkpoint
written at TP=2/PP=2 loads at TP=1/PP=1 (or any other layout). Next to the tensors, the
common state carries a format version and the model config, which a reader checks against
the model it builds. The trainer (rl/engine/checkpoint.py, which adds optimizer state) and
the converters (rl/weights/convert.py) both write through :func:`write`: a sibling
temporary directory that rank 0 renames once every rank has written, so a crash never
leaves a half-written checkpoint under the final name. Every read goes through torch
DCP's reader with its index unpickled by a restricted unpickler (rl/weights/dcp_guard.py),
so a checkpoint cannot run code in the ranks that load it.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from rl.checkpoints import files as ckpt_files
from rl.config import ckpt_check
from rl.config.ckpt_check import ARCH_FIELDS, FORMAT_VERSION, architecture_diffs
from rl.config.dcp_metadata import RefusedPickle
from rl.weights import dcp_guard

if TYPE_CHECKING:
    from megatron.core.transformer.module import MegatronModule

    from rl.config.schema import ModelConfig

__all__ = ["ARCH_FIELDS", "FORMAT_VERSION", "CheckpointError", "check", "load", "read_common"]


class CheckpointError(ValueError):
    """A checkpoint path that is missing, incomplete or not a torch_dist checkpoint."""


def model_config_dict(m: ModelConfig | DictConfig) -> dict[str, Any]:
    """The model config as plain data, stored in every checkpoint's common state."""
    if isinstance(m, DictConfig):
        return OmegaConf.to_container(m, resolve=True)  # type: ignore[return-value]
    return dataclasses.asdict(m)


def model_state(
    model: MegatronModule,
    model_cfg: ModelConfig | DictConfig,
    **common: Any,  # JSON-like metadata
) -> dict[str, Any]:
    """A weights-only checkpoint state: the sharded model plus the common metadata."""
    return {
        "model": model.sharded_state_dict(),
        "format_version": FORMAT_VERSION,
        "has_optimizer": False,
        "model_config": model_config_dict(model_cfg),
        **common,
    }


def check(path: str | os.PathLike) -> Path:
    """Raise CheckpointError unless ``path`` holds a complete torch_dist checkpoint: its
    metadata readable and every shard as long as the metadata says (a truncated shard is
    named here, before torch's reader fails on it with a bare EOFError)."""
    from megatron.core import dist_checkpointing

    dcp_guard.apply()  # before the first read of any checkpoint in this process
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {str(p)!r} does not exist or is not a directory")
    if not dist_checkpointing.check_is_distributed_checkpoint(str(p)):
        raise CheckpointError(
            f"checkpoint {str(p)!r} is not a Megatron torch_dist checkpoint "
            "(no metadata.json): incomplete or wrong format"
        )
    problem = ckpt_check.problem(p)
    if problem:
        raise CheckpointError(f"checkpoint {str(p)!r} {problem}")
    return p


def load(state: dict[str, Any], path: str | os.PathLike) -> dict[str, Any]:
    """Megatron's ``dist_checkpointing.load`` of ``state`` from ``path``, with a failure
    to read a file as one CheckpointError naming it (Megatron raises a
    CheckpointException wrapping each rank's EOFError, which names no file)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import CheckpointException

    dcp_guard.apply()
    p = Path(path)
    try:
        return dist_checkpointing.load(state, str(p))
    except RefusedPickle as e:  # where no collective wrapped it: it names the file itself
        raise CheckpointError(f"checkpoint {str(p)!r} cannot be loaded: {e}") from None
    except (CheckpointException, EOFError, pickle.UnpicklingError, RuntimeError) as e:
        first = first_failure(e)
        if isinstance(first, RefusedPickle):  # an item that would run code
            raise CheckpointError(f"checkpoint {str(p)!r} cannot be loaded: {first}") from None
        try:
            problem = ckpt_check.problem(p)
        except OSError as err:
            problem = f"cannot be read: {err}"
        if problem is None and isinstance(e, RuntimeError):
            raise  # the files look whole: not a damaged checkpoint, keep the traceback
        if problem is None:  # CheckpointException: one failure per rank
            problem = f"cannot be read: {type(first).__name__} {first}".rstrip()
        raise CheckpointError(f"checkpoint {str(p)!r} {problem}") from None


def first_failure(e: BaseException) -> BaseException:
    """The first rank's exception inside DCP's CheckpointException (torch's holds an
    (exception, traceback) pair per rank; a bare exception is taken as it is), or ``e``."""
    for failure in (getattr(e, "failures", None) or {}).values():
        return failure[0] if isinstance(failure, tuple) else failure
    return e


def write(state: dict[str, Any], path: str, keep_previous: bool = False) -> None:
    """Collective save of ``state`` to ``path``, atomically (temp dir, then rename).
    ``keep_previous``: leave the checkpoint it replaces at ``<path>.old`` until the resume
    state names the new one (rl/checkpoints/files.py)."""
    from megatron.core import dist_checkpointing

    from megatron_patches import cuda_to_cpu

    final = Path(path)
    tmp = ckpt_files.tmp_of(final)
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    with cuda_to_cpu():
        dist_checkpointing.save(state, str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        # Renames only: deleting the previous checkpoint file by file before the new one
        # is in place left a requeued job (SIGTERM mid-save) with neither.
        prev = ckpt_files.old_of(final)
        shutil.rmtree(prev, ignore_errors=True)
        if final.exists():
            os.replace(final, prev)
        os.replace(tmp, final)
        if not keep_previous:
            shutil.rmtree(prev, ignore_errors=True)
    dist.barrier()


def check_architecture(
    common: dict[str, Any], model_cfg: ModelConfig | DictConfig, path: str
) -> None:
    """Refuse a checkpoint whose stored model shape differs from the model being built."""
    diffs = architecture_diffs(common.get("model_config"), model_config_dict(model_cfg))
    if diffs:
        raise CheckpointError(f"checkpoint {path!r} is for a different model: " + "; ".join(diffs))


# What a checkpoint keeps of the HF model it came from (rl/weights/convert.py writes them
# into the conversion cache): not shapes, but what an HF export needs to stop and pad as
# the original does (config.json's token ids, generation_config.json). Every later
# checkpoint of a trainer that loaded one carries them on.
HF_FIELDS = ("hf_config", "hf_generation_config")


def hf_fields(common: dict[str, Any]) -> dict[str, Any]:
    """The :data:`HF_FIELDS` of a checkpoint's common state that it has."""
    return {k: common[k] for k in HF_FIELDS if common.get(k)}


def read_common(path: str | os.PathLike, model_cfg: ModelConfig | DictConfig) -> dict[str, Any]:
    """The common (non-tensor) state of the checkpoint at ``path``, after checking that it
    is complete, of this format version and for ``model_cfg``'s architecture."""
    from megatron.core import dist_checkpointing

    p = check(path)
    common = dist_checkpointing.load_common_state_dict(str(p))
    if common.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(p)!r} has format_version={common.get('format_version')!r}, "
            f"expected {FORMAT_VERSION}"
        )
    check_architecture(common, model_cfg, str(p))
    return common
