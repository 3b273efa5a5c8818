"""What a model executor's ranks are given of the job's config (:class:`CompanionSettings`),
and the checks every role's layout shares.

Pure config: neither torch.distributed nor Megatron is imported here.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import DictConfig, OmegaConf

from rl.config.errors import ConfigError
from rl.models import registry

if TYPE_CHECKING:
    from rl.algorithms.losses import LossFn
    from rl.algorithms.reuse import Reuse
    from rl.batch import TrainBatch
    from rl.config.schema import ModelConfig, RootConfig, TrainerConfig


@dataclass(frozen=True)
class Training:
    """A trained model's step: ``prepare(batch)`` gives the batch its targets and the loss;
    ``reuse``: its epochs and minibatches over each batch."""

    prepare: Callable[[TrainBatch], tuple[TrainBatch, LossFn]]
    reuse: Reuse


@dataclass(frozen=True, kw_only=True)
class CompanionSettings:
    """One role's model (its architecture names its head), its layout, batch and dtype
    (``trainer``), ``rl.steps`` and ``rl.deterministic``; ``training`` is None for a frozen
    model."""

    role: str
    model: ModelConfig | DictConfig
    trainer: TrainerConfig
    steps: int
    deterministic: bool
    training: Training | None = None
    temperature: float = 1.0  # an LM head's log-probs are of logits / temperature


def with_head(m: ModelConfig | DictConfig, head: str) -> DictConfig:
    """The model config ``m`` with its family's ``score`` (scalar) or ``causal`` (LM) head."""
    arch = registry.get(str(m.architecture))
    fields = OmegaConf.to_container(OmegaConf.structured(m), resolve=True)
    assert isinstance(fields, dict)
    name = arch.score_class if head == "score" else arch.hf_class
    return OmegaConf.create({**fields, "architecture": name})


def check_layout(
    prefix: str, t: TrainerConfig, m: ModelConfig | DictConfig, model: str = "model."
) -> None:
    """``t`` divides ``m``, in one line naming ``{prefix}.trainer``'s field and the model's
    as ``model`` (the policy's: ``model.``)."""
    from rl.models.checks import validate_trainer

    if t.lora.rank:
        raise ConfigError(f"{prefix}.trainer.lora.rank={t.lora.rank}: only the policy has LoRA")
    try:
        validate_trainer(t, m)  # type: ignore[arg-type]
    except ConfigError as e:  # its messages name the policy's trainer.* fields
        msg = re.sub(r"\bmodel\.", model, str(e))
        raise ConfigError(msg.replace("trainer.", f"{prefix}.trainer.")) from None


def frozen(cfg: RootConfig, role: str, temperature: float = 1.0) -> CompanionSettings:
    """The settings of the frozen model of ``role`` (its section's HF checkpoint and
    layout): no steps to train, no training."""
    section = getattr(cfg, role)
    return CompanionSettings(
        role=role, model=hf_model(section.hf_checkpoint, role), trainer=section.trainer,
        steps=1, deterministic=cfg.rl.deterministic, temperature=temperature,
    )  # fmt: skip


def hf_model(path: str | None, section: str) -> ModelConfig:
    """The architecture of ``{section}.hf_checkpoint``, from its config.json."""
    from rl.weights.hf_model import hf_model_config

    if not path:
        raise ConfigError(f"{section}.enabled=true needs {section}.hf_checkpoint (an HF dir)")
    try:
        return hf_model_config(path)
    except ConfigError as e:
        raise ConfigError(str(e).replace("model.", f"{section}.", 1)) from None


def check_hf_model(
    cfg: RootConfig, m: ModelConfig | DictConfig, section: str, *, score: bool, needs: str,
    what: str,
) -> None:  # fmt: skip
    """``{section}.hf_checkpoint`` (its model ``m``) has a scalar head (``score``) or an LM
    head, else a ConfigError ending in ``needs``; and the policy's vocabulary (it ``what``
    the policy's token ids): its size, and, where both directories hold a tokenizer, its
    tokens' ids."""
    from rl.models.arch import has_score_head
    from rl.tasks.tokenizer import check_tokenizer_dir, vocab_mismatch

    other = getattr(cfg, section).hf_checkpoint
    field = f"{section}.hf_checkpoint={other!r}"
    if has_score_head(str(m.architecture)) != score:
        raise ConfigError(f"{field} is a {m.architecture}: {needs}")
    if m.vocab_size != cfg.model.vocab_size:
        raise ConfigError(
            f"{field} has vocab_size={m.vocab_size}, the policy {cfg.model.vocab_size}: it "
            f"{what} the policy's token ids, so the two must share a tokenizer"
        )
    mine = getattr(cfg.task, "tokenizer", None) or cfg.model.hf_checkpoint
    dirs = []
    for path in (mine, other):
        try:
            dirs.append(str(check_tokenizer_dir(str(path), "")) if path else None)
        except Exception:  # no tokenizer files there: the vocabulary size was checked
            dirs.append(None)
    if dirs[0] and dirs[1] and (why := vocab_mismatch(dirs[0], dirs[1])):
        raise ConfigError(f"{field} has another tokenizer than the policy's: {why}")
