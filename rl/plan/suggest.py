"""What the planner may tell a user to change when a GPU's budget is exceeded.

Why a module of its own: a suggestion the user cannot follow costs a queue wait and a
rerun ("lower trainer.micro_batch_size=1" when 1 is the least there is). Each helper
says whether a value can still move in the direction that saves memory, from the config
alone; the hint lists only those, and says so when none is left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rl.models.shapes import sequence_parallel
from rl.plan.memory import sequence_length

if TYPE_CHECKING:
    from rl.config.schema import RootConfig


def context_floor(cfg: RootConfig) -> int:
    """The shortest context the rollouts still fit in: the longest prompt the task admits
    (``task.max_prompt_tokens``; at least one token when unbounded) plus the response."""
    longest = getattr(cfg.task, "max_prompt_tokens", None)  # a task of text files has it
    return (longest or 1) + cfg.rollout.sampling.max_new_tokens


def can_lower_context(cfg: RootConfig) -> bool:
    return sequence_length(cfg) > context_floor(cfg)


def can_raise_pp(cfg: RootConfig) -> bool:
    """A larger pipeline size must still divide the layers (one stage holds >= 1 layer)."""
    layers, pp = cfg.model.num_layers, cfg.trainer.pp
    return any(layers % d == 0 for d in range(pp + 1, layers + 1))


def can_raise_tp(cfg: RootConfig) -> bool:
    """Twice the TP group must fit in a node and split the query groups evenly."""
    m, tp = cfg.model, cfg.trainer.tp
    return 2 * tp <= cfg.cluster.gpus_per_node and m.num_query_groups % (2 * tp) == 0


def can_raise_cp(cfg: RootConfig) -> bool:
    """Context parallelism can grow: packed micro-batches through SDPA, a dense model (its
    load-balancing loss is not reduced over CP ranks), and twice the ranks with TP in a
    node (CP's all-gathers run every layer)."""
    t = cfg.trainer
    return (
        t.packing
        and t.attention == "sdpa"
        and not cfg.model.num_experts
        and 2 * t.cp * t.tp <= cfg.cluster.gpus_per_node
    )


def can_split_sequence(cfg: RootConfig) -> bool:
    """Sequence parallelism is off and could be on: TP > 1, and no adapters (LoRA under
    sequence parallelism is not built)."""
    m, t = cfg.model, cfg.trainer
    return t.tp > 1 and not t.lora.rank and not sequence_parallel(m, t.tp, t.sequence_parallel)


def _join(verb: str, items: list[str]) -> str:
    return f"{verb} {' or '.join(items)}" if items else ""


def trainer_hint(cfg: RootConfig, activations_dominate: bool) -> str:
    """How to shrink a trainer GPU: its activations when they dominate, else its static
    memory (weights, gradients, Adam)."""
    t, r = cfg.trainer, cfg.rollout
    set_: list[str] = []  # what costs compute or nothing, before what changes the run
    lower: list[str] = []
    raise_: list[str] = []
    extra = ""
    if activations_dominate:
        if t.recompute == "none":
            set_.append("trainer.recompute=full")
        if can_split_sequence(cfg):
            set_.append("trainer.sequence_parallel=true")
        if can_lower_context(cfg):
            lower.append(
                f"rollout.context_length={r.context_length}"
                if r.context_length
                else "rollout.context_length (null: model.max_position_embeddings="
                f"{cfg.model.max_position_embeddings})"
            )
        if t.micro_batch_size > 1:
            lower.append(f"trainer.micro_batch_size={t.micro_batch_size}")
        if can_raise_tp(cfg):
            raise_.append(f"trainer.tp={t.tp}")
        if can_raise_cp(cfg):
            raise_.append(f"trainer.cp={t.cp}")
    else:
        if can_raise_pp(cfg):
            raise_.append(f"trainer.pp={t.pp}")
        if can_raise_tp(cfg):
            raise_.append(f"trainer.tp={t.tp}")
        extra = (
            f" (or trainer.dp={t.dp}: the distributed optimizer shards Adam over DP)"
            if t.use_distributed_optimizer
            else " (or set trainer.use_distributed_optimizer=true: it shards Adam over DP)"
        )
    parts = [p for p in (_join("set", set_), _join("lower", lower), _join("raise", raise_)) if p]
    if not parts:
        return (
            "every setting that would shrink it is at its limit (recomputation, context, "
            "micro-batch, TP within a node): use GPUs with more memory than "
            f"cluster.gpu_memory_gb{extra}"
        )
    return ", or ".join(parts) + extra
