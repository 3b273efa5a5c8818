"""The model's checks: its shape and family, MoE, and the trainer's parallel layout on it.

The model owns them (they read the family registry and the model's shapes); the config's
own fields are rl/config/validate.py's. Pure logic, no torch: the planner and the
converters run them too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rl.config.errors import ConfigError, positive, require
from rl.config.schema import SIZE_FIELDS
from rl.config.validate import validate_batch, validate_trainer_fields
from rl.models import registry
from rl.models.arch import kv_channels
from rl.models.shapes import padded_vocab_size, sequence_parallel

if TYPE_CHECKING:
    from rl.config.schema import ModelConfig, TrainerConfig

# Megatron-Core 0.16 applies Llama 3 RoPE scaling with only `factor` configurable.
MCORE_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def validate_model(m: ModelConfig) -> None:
    positive("model", m, *SIZE_FIELDS)
    try:
        arch = registry.get(m.architecture)
    except registry.UnknownArchitecture as e:
        raise ConfigError(str(e)) from None
    for key, want in arch.fixed.items():
        require(
            getattr(m, key) == want,
            f"model.{key}={getattr(m, key)!r} is not supported by {arch.hf_class} "
            f"(the family fixes {want!r})",
        )
    require(
        m.head_dim is None or (isinstance(m.head_dim, int) and m.head_dim >= 1),
        f"model.head_dim={m.head_dim!r} must be an integer >= 1 or null",
    )
    require(
        m.head_dim is not None or m.hidden_size % m.num_attention_heads == 0,
        f"model.num_attention_heads={m.num_attention_heads} does not divide "
        f"model.hidden_size={m.hidden_size} (or set model.head_dim)",
    )
    require(
        m.num_attention_heads % m.num_query_groups == 0,
        f"model.num_query_groups={m.num_query_groups} does not divide "
        f"model.num_attention_heads={m.num_attention_heads}",
    )
    require(
        kv_channels(m) % 2 == 0,
        f"model head dim {kv_channels(m)} must be even for RoPE (model.head_dim={m.head_dim}, "
        f"model.hidden_size={m.hidden_size}, model.num_attention_heads={m.num_attention_heads})",
    )
    _validate_moe(m, arch.moe)
    _validate_vision(m, arch.vision is not None)
    rs = m.rope_scaling
    if rs is not None:
        require(rs.factor > 0, f"model.rope_scaling.factor={rs.factor} must be > 0")
        for name, fixed in MCORE_LLAMA3_ROPE.items():
            require(
                getattr(rs, name) == fixed,
                f"model.rope_scaling.{name}={getattr(rs, name)} is not supported: "
                f"Megatron-Core's Llama 3 RoPE scaling fixes it at {fixed}",
            )


def _validate_vision(m: ModelConfig, vision: bool) -> None:
    v = m.vision
    require(
        (v is not None) == vision,
        f"model.vision is {'missing' if vision else 'set'}: {m.architecture} is "
        + ("a vision-language family (give model.hf_checkpoint: its config.json has it)"
           if vision else "a text-only family"),
    )  # fmt: skip
    require(
        v is not None or not m.train_vision,
        f"model.train_vision=true with {m.architecture}, which has no vision tower",
    )
    if v is None:
        return
    half = kv_channels(m) // 2
    require(
        len(v.mrope_section) == 3 and sum(v.mrope_section) == half,
        f"model.vision.mrope_section={list(v.mrope_section)} must be 3 sizes summing to "
        f"head dim / 2 = {half}",
    )


def _validate_moe(m: ModelConfig, moe: bool) -> None:
    require(
        (m.num_experts > 0) == moe,
        f"model.num_experts={m.num_experts} does not fit {m.architecture} "
        f"({'a Mixture-of-Experts' if moe else 'a dense'} family)",
    )
    if not moe:
        return
    require(
        isinstance(m.moe_ffn_hidden_size, int) and m.moe_ffn_hidden_size >= 1,
        f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size!r} must be an integer >= 1",
    )
    require(
        1 <= m.moe_router_topk <= m.num_experts,
        f"model.moe_router_topk={m.moe_router_topk} must be in [1, model.num_experts="
        f"{m.num_experts}]",
    )
    require(
        m.moe_router_topk > 1 or not m.moe_norm_topk_prob,
        "model.moe_router_topk=1 with model.moe_norm_topk_prob=true always weighs the expert "
        "1.0, which Megatron's router does not reproduce: set moe_norm_topk_prob=false",
    )
    require(
        m.shared_expert_ffn_hidden_size >= 0,
        f"model.shared_expert_ffn_hidden_size={m.shared_expert_ffn_hidden_size} must be >= 0",
    )
    require(
        not m.shared_expert_gate or m.shared_expert_ffn_hidden_size > 0,
        "model.shared_expert_gate=true needs model.shared_expert_ffn_hidden_size > 0",
    )
    require(m.moe_aux_loss_coeff >= 0, f"model.moe_aux_loss_coeff={m.moe_aux_loss_coeff} < 0")


def validate_trainer(t: TrainerConfig, m: ModelConfig) -> None:
    """The trainer's own fields, its layout on ``m`` (every split must divide), then its
    batch."""
    validate_trainer_fields(t)
    targets = [x for x in t.lora.targets if x in ("fc1", "fc2")]
    require(
        not (t.lora.rank and m.num_experts and targets),
        f"trainer.lora.targets={list(t.lora.targets)}: adapters on experts are not built; "
        "with model.num_experts target qkv and proj only",
    )
    require(
        not (t.lora.rank and sequence_parallel(m, t.tp, t.sequence_parallel)),
        f"trainer.lora.rank={t.lora.rank} with trainer.tp={t.tp} under sequence parallelism "
        f"({'a Mixture-of-Experts model' if m.num_experts else 'trainer.sequence_parallel'}"
        "): adapters there are not built (use trainer.tp=1)",
    )
    require(
        t.cp == 1 or not m.num_experts,
        f"trainer.cp={t.cp} with a Mixture-of-Experts model (model.num_experts="
        f"{m.num_experts}): its load-balancing loss is not reduced over CP ranks",
    )
    deep = len(m.vision.tower.get("deepstack_visual_indexes") or []) if m.vision else 0
    require(
        not deep or t.recompute == "none",
        f"trainer.recompute={t.recompute} with {m.architecture}: its deepstack embeddings are "
        "added to the first layers' outputs, which a recomputed layer would miss",
    )
    require(
        m.num_layers // t.pp >= deep,
        f"trainer.pp={t.pp} puts fewer than the {deep} deepstack layers of {m.architecture} "
        f"on the first stage ({m.num_layers} layers), where the vision tower runs",
    )
    require(
        t.cp == 1 or m.vision is None,
        f"trainer.cp={t.cp} with a vision-language model ({m.architecture}): its 3-D "
        "positions and image embeddings are not split over CP ranks",
    )
    require(
        t.ep == 1 or m.num_experts > 0,
        f"trainer.ep={t.ep} needs a Mixture-of-Experts model (model.num_experts=0)",
    )
    require(
        m.num_experts % t.ep == 0,
        f"trainer.ep={t.ep} does not divide model.num_experts={m.num_experts}",
    )
    for field, value in (
        ("num_attention_heads", m.num_attention_heads),
        ("num_query_groups", m.num_query_groups),
        *(
            (("moe_ffn_hidden_size", m.moe_ffn_hidden_size),)
            if m.num_experts
            else (("ffn_hidden_size", m.ffn_hidden_size),)
        ),
        *(
            (("shared_expert_ffn_hidden_size", m.shared_expert_ffn_hidden_size),)
            if m.num_experts and m.shared_expert_ffn_hidden_size
            else ()
        ),
    ):
        require(value % t.tp == 0, f"trainer.tp={t.tp} does not divide model.{field}={value}")
    vocab = padded_vocab_size(m)
    require(
        vocab % t.tp == 0,
        f"trainer.tp={t.tp} does not divide the padded vocab {vocab} (model.vocab_size="
        f"{m.vocab_size}, model.make_vocab_size_divisible_by={m.make_vocab_size_divisible_by}; "
        f"set the latter to a multiple of {t.tp})",
    )
    require(
        m.num_layers % t.pp == 0,
        f"trainer.pp={t.pp} does not divide model.num_layers={m.num_layers}",
    )
    validate_batch(t)


def validate_routing_replay(replay: bool, t: TrainerConfig, m: ModelConfig) -> None:
    """``algorithm.routing_replay`` (rl/engine/routing_replay.py) on this model and layout."""
    if not replay:
        return
    require(
        m.num_experts > 0,
        "algorithm.routing_replay=true needs a Mixture-of-Experts model (model.num_experts=0): "
        "a dense model routes nothing",
    )
    require(
        t.recompute == "none" or t.pp == 1,
        f"algorithm.routing_replay=true with trainer.recompute={t.recompute} needs trainer.pp=1 "
        f"(got {t.pp}): a forward recomputed in a pipelined backward would replay another "
        "micro-batch's routing",
    )
