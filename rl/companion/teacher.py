"""The teacher (``teacher=``): a frozen causal LM giving its log-prob of every sampled
token, for on-policy distillation (``algorithm.distill_coef``: rl/algorithms/distill.py).

It runs on the model executor (rl/companion/service.py), on ranks and a layout of its own
(``teacher.trainer``), converted once from its HF directory and cached. It may be another
size or family than the policy, as long as the two share a tokenizer: it scores the
policy's token ids as they are. Its log-probs are taken at the rollouts' sampling
temperature, as the policy's are, so a teacher equal to the policy adds nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rl.companion.settings import (
    CompanionSettings,
    check_hf_model,
    check_layout,
    frozen,
    hf_model,
)
from rl.config.errors import ConfigError

if TYPE_CHECKING:
    from rl.config.schema import ModelConfig, RootConfig

ROLE = "teacher"


def model(cfg: RootConfig) -> ModelConfig:
    """The teacher's architecture, from its checkpoint's config.json."""
    return hf_model(cfg.teacher.hf_checkpoint, ROLE)


def settings(cfg: RootConfig) -> CompanionSettings:
    # Its log-probs at the rollouts' temperature, as the policy's are taken.
    return frozen(cfg, ROLE, float(cfg.rollout.sampling.temperature))


def check(cfg: RootConfig) -> None:
    """The teacher's checkpoint (a causal LM with the policy's vocabulary), its layout, and
    the algorithm's use of it, each in one line."""
    t, a = cfg.teacher, cfg.algorithm
    if a.distill_coef < 0:
        raise ConfigError(f"algorithm.distill_coef={a.distill_coef} must be >= 0")
    if a.distill_only and not a.distill_coef:
        raise ConfigError(
            "algorithm.distill_only=true with algorithm.distill_coef=0: nothing would be "
            "learned (set algorithm.distill_coef > 0)"
        )
    if a.distill_only and a.drop_uniform_groups:
        raise ConfigError(
            "algorithm.drop_uniform_groups=true with algorithm.distill_only=true: a group of "
            "equal rewards still carries the teacher's signal (set it to false)"
        )
    if not t.enabled:
        if a.distill_coef:
            raise ConfigError(
                f"algorithm.distill_coef={a.distill_coef} needs a teacher: set teacher=cpu "
                "teacher.hf_checkpoint=DIR"
            )
        return
    if not a.distill_coef:
        raise ConfigError(
            "teacher.enabled=true but algorithm.distill_coef=0: the teacher would be unused "
            "(set algorithm.distill_coef > 0)"
        )
    m = model(cfg)
    needs = "a teacher needs an LM head (*ForCausalLM)"
    check_hf_model(cfg, m, ROLE, score=False, needs=needs, what="scores")
    check_layout(ROLE, t.trainer, m, "the teacher's ")
