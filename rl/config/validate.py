"""Semantic validation of a composed config, run before any process is spawned.

Every check raises :class:`ConfigError` with one line naming the field and its value, so
a bad launch fails in the launcher, in milliseconds, instead of as a shape error on rank 3
minutes later. Pure logic: no torch.distributed, no Megatron.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from rl.config.dtypes import PARAM_DTYPES
from rl.config.roles import RoleError, RoleMap
from rl.config.sampling import RequestError, SamplingParams
from rl.config.sglang import layout_problem
from rl.models import registry
from rl.models.arch import kv_channels
from rl.models.shapes import padded_vocab_size
from rl.tasks import scoring

if TYPE_CHECKING:  # a task is built (data files, tokenizers) only where it is checked
    from rl.config.schema import (
        AlgorithmConfig,
        ClusterConfig,
        ModelConfig,
        OptimConfig,
        RewardConfig,
        RolloutConfig,
        RootConfig,
        TrainerConfig,
    )
    from rl.tasks import Task

DEVICES = ("cpu", "cuda")
DECAY_STYLES = ("constant", "linear", "cosine")
# Megatron-Core 0.16 applies Llama 3 RoPE scaling with only `factor` configurable.
MCORE_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and the value."""


CLUSTERS = ("local", "slurm")
OVERLONG = ("keep", "mask", "penalise")


def _require(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _at_least(section: str, obj: object, low: int, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        _require(
            isinstance(v, int) and v >= low, f"{section}.{n}={v!r} must be an integer >= {low}"
        )


def _positive(section: str, obj: object, *names: str) -> None:
    _at_least(section, obj, 1, *names)


def validate_model(m: ModelConfig) -> None:
    _positive(
        "model",
        m,
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "vocab_size",
        "max_position_embeddings",
        "make_vocab_size_divisible_by",
    )
    try:
        arch = registry.get(m.architecture)
    except registry.UnknownArchitecture as e:
        raise ConfigError(str(e)) from None
    for key, want in arch.fixed.items():
        _require(
            getattr(m, key) == want,
            f"model.{key}={getattr(m, key)!r} is not supported by {arch.hf_class} "
            f"(the family fixes {want!r})",
        )
    _require(
        m.head_dim is None or (isinstance(m.head_dim, int) and m.head_dim >= 1),
        f"model.head_dim={m.head_dim!r} must be an integer >= 1 or null",
    )
    _require(
        m.head_dim is not None or m.hidden_size % m.num_attention_heads == 0,
        f"model.num_attention_heads={m.num_attention_heads} does not divide "
        f"model.hidden_size={m.hidden_size} (or set model.head_dim)",
    )
    _require(
        m.num_attention_heads % m.num_query_groups == 0,
        f"model.num_query_groups={m.num_query_groups} does not divide "
        f"model.num_attention_heads={m.num_attention_heads}",
    )
    _require(
        kv_channels(m) % 2 == 0,
        f"model head dim {kv_channels(m)} must be even for RoPE (model.head_dim={m.head_dim}, "
        f"model.hidden_size={m.hidden_size}, model.num_attention_heads={m.num_attention_heads})",
    )
    _validate_moe(m, arch.moe)
    rs = m.rope_scaling
    if rs is not None:
        _require(rs.factor > 0, f"model.rope_scaling.factor={rs.factor} must be > 0")
        for name, fixed in MCORE_LLAMA3_ROPE.items():
            _require(
                getattr(rs, name) == fixed,
                f"model.rope_scaling.{name}={getattr(rs, name)} is not supported: "
                f"Megatron-Core's Llama 3 RoPE scaling fixes it at {fixed}",
            )


def _validate_moe(m: ModelConfig, moe: bool) -> None:
    _require(
        (m.num_experts > 0) == moe,
        f"model.num_experts={m.num_experts} does not fit {m.architecture} "
        f"({'a Mixture-of-Experts' if moe else 'a dense'} family)",
    )
    if not moe:
        return
    _require(
        isinstance(m.moe_ffn_hidden_size, int) and m.moe_ffn_hidden_size >= 1,
        f"model.moe_ffn_hidden_size={m.moe_ffn_hidden_size!r} must be an integer >= 1",
    )
    _require(
        1 <= m.moe_router_topk <= m.num_experts,
        f"model.moe_router_topk={m.moe_router_topk} must be in [1, model.num_experts="
        f"{m.num_experts}]",
    )
    _require(
        m.moe_router_topk > 1 or not m.moe_norm_topk_prob,
        "model.moe_router_topk=1 with model.moe_norm_topk_prob=true always weighs the expert "
        "1.0, which Megatron's router does not reproduce: set moe_norm_topk_prob=false",
    )
    _require(
        m.shared_expert_ffn_hidden_size >= 0,
        f"model.shared_expert_ffn_hidden_size={m.shared_expert_ffn_hidden_size} must be >= 0",
    )
    _require(
        not m.shared_expert_gate or m.shared_expert_ffn_hidden_size > 0,
        "model.shared_expert_gate=true needs model.shared_expert_ffn_hidden_size > 0",
    )
    _require(m.moe_aux_loss_coeff >= 0, f"model.moe_aux_loss_coeff={m.moe_aux_loss_coeff} < 0")


def _optim(where: str, o: OptimConfig) -> None:
    _require(
        o.decay_style in DECAY_STYLES,
        f"{where}.decay_style={o.decay_style!r} must be one of {DECAY_STYLES}",
    )
    _require(o.lr > 0, f"{where}.lr={o.lr} must be > 0")
    _require(0 <= o.min_lr <= o.lr, f"{where}.min_lr={o.min_lr} must be in [0, {where}.lr={o.lr}]")
    _require(o.clip_grad >= 0, f"{where}.clip_grad={o.clip_grad} must be >= 0")
    for name in ("warmup_steps", "decay_steps"):
        v = getattr(o, name)
        _require(v is None or v >= 0, f"{where}.{name}={v} must be >= 0")


def validate_trainer(t: TrainerConfig, m: ModelConfig) -> None:
    _positive("trainer", t, "tp", "pp", "dp", "ep", "micro_batch_size", "global_batch_size")
    _positive("trainer", t, "threads_per_rank")
    _require(
        t.ep == 1 or m.num_experts > 0,
        f"trainer.ep={t.ep} needs a Mixture-of-Experts model (model.num_experts=0)",
    )
    _require(t.dp % t.ep == 0, f"trainer.ep={t.ep} does not divide trainer.dp={t.dp}")
    _require(
        m.num_experts % t.ep == 0,
        f"trainer.ep={t.ep} does not divide model.num_experts={m.num_experts}",
    )
    _require(t.device in DEVICES, f"trainer.device={t.device!r} must be one of {DEVICES}")
    _require(
        t.params_dtype in PARAM_DTYPES,
        f"trainer.params_dtype={t.params_dtype!r} must be one of {PARAM_DTYPES}",
    )
    _optim("trainer.optim", t.optim)
    budget = t.max_tokens_per_microbatch
    _require(
        budget is None or (isinstance(budget, int) and budget >= 1),
        f"trainer.max_tokens_per_microbatch={budget!r} must be an integer >= 1 or null",
    )
    _require(
        budget is None or t.pp == 1,
        f"trainer.max_tokens_per_microbatch={budget} needs trainer.pp=1 (pipeline stages "
        f"exchange one fixed micro-batch shape), not trainer.pp={t.pp}",
    )
    _require(t.save_interval >= 0, f"trainer.save_interval={t.save_interval} must be >= 0")
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
        _require(value % t.tp == 0, f"trainer.tp={t.tp} does not divide model.{field}={value}")
    vocab = padded_vocab_size(m)
    _require(
        vocab % t.tp == 0,
        f"trainer.tp={t.tp} does not divide the padded vocab {vocab} (model.vocab_size="
        f"{m.vocab_size}, model.make_vocab_size_divisible_by={m.make_vocab_size_divisible_by}; "
        f"set the latter to a multiple of {t.tp})",
    )
    _require(
        m.num_layers % t.pp == 0,
        f"trainer.pp={t.pp} does not divide model.num_layers={m.num_layers}",
    )
    per_step = t.micro_batch_size * t.dp
    _require(
        t.global_batch_size % per_step == 0,
        f"trainer.global_batch_size={t.global_batch_size} is not a multiple of "
        f"trainer.micro_batch_size*dp={t.micro_batch_size}*{t.dp}={per_step}",
    )


def validate_task(cfg: RootConfig) -> None:
    """The task's own fields (rl/tasks checks them; no data is read here) and the warm-up."""
    from rl.tasks import TaskError, check_config

    try:
        check_config(cfg)
    except TaskError as e:
        raise ConfigError(str(e)) from None
    sft = cfg.sft
    _require(sft.steps >= 0, f"sft.steps={sft.steps} must be >= 0")
    _positive("sft", sft, "log_every", "check_every")
    _at_least("sft", sft, 0, "eval_every")
    t = sft.stop_at_accuracy
    _require(t is None or 0 < t <= 1, f"sft.stop_at_accuracy={t} must be in (0, 1] or null")
    if sft.optim is not None:
        _optim("sft.optim", sft.optim)


def check_task(cfg: RootConfig) -> Task:
    """Build the task (reads and renders its data) and check it against the model and
    the rollouts; returns it. Run once before launch, after :func:`validate`."""
    from rl.tasks import TaskError, build_task

    try:
        task = build_task(cfg)
    except TaskError as e:
        raise ConfigError(str(e)) from None
    longest, new = task.max_prompt_len, cfg.rollout.sampling.max_new_tokens
    context = cfg.rollout.context_length or cfg.model.max_position_embeddings
    if cfg.rl.steps > 0:
        _require(
            longest + new <= context,
            f"rollout.sampling.max_new_tokens={new} + the longest prompt ({longest} tokens) "
            f"exceeds the context of {context} tokens (rollout.context_length or "
            "model.max_position_embeddings; task.max_prompt_tokens drops long prompts)",
        )
    if cfg.sft.steps > 0:
        missing = next((e.uid for e in task.validation_set if not e.target_ids), None)
        _require(
            missing is None,
            f"sft.steps={cfg.sft.steps} needs a label on every prompt: {missing} has none "
            f"(task.label_key={cfg.task.label_key!r})",
        )
    return task


def validate_rollout(r: RolloutConfig) -> None:
    _positive("rollout", r, "servers", "max_in_flight")
    problem = layout_problem(r.device, r.tp, r.dtype, "rollout")
    _require(problem is None, str(problem))
    for name in ("threads", "max_total_tokens", "max_running_requests", "context_length"):
        v = getattr(r, name)
        _require(
            v is None or (isinstance(v, int) and v >= 1),
            f"rollout.{name}={v!r} must be an integer >= 1 or null",
        )
    for name in ("startup_timeout", "request_timeout"):
        v = getattr(r, name)
        _require(v > 0, f"rollout.{name}={v} must be > 0 seconds")
    seg = r.segment_tokens
    _require(seg is None or seg >= 1, f"rollout.segment_tokens={seg} must be >= 1 or null")
    try:
        SamplingParams.from_config(r.sampling)
    except RequestError as e:
        raise ConfigError(f"rollout.{e}") from None
    w = r.weight_sync
    _require(
        w.transport in ("ipc", "p2p"),
        f"rollout.weight_sync.transport={w.transport!r} must be 'ipc' or 'p2p'",
    )
    _require(w.bucket_mb >= 1, f"rollout.weight_sync.bucket_mb={w.bucket_mb} must be >= 1")
    _require(w.timeout > 0, f"rollout.weight_sync.timeout={w.timeout} must be > 0 seconds")
    fp8 = w.fp8_block
    _require(
        fp8 is None or (fp8 >= 1 and r.device == "cuda"),
        f"rollout.weight_sync.fp8_block={fp8} needs rollout.device=cuda (SGLang's FP8 "
        "kernels are GPU-only) and a block >= 1",
    )


def validate_algorithm(a: AlgorithmConfig) -> None:
    _require(a.name in ("aipo", "grpo"), f"algorithm.name={a.name!r} must be 'aipo' or 'grpo'")
    _require(a.rho > 0, f"algorithm.rho={a.rho} must be > 0 (the importance-weight cap)")
    _require(0 < a.clip_eps < 1, f"algorithm.clip_eps={a.clip_eps} must be in (0, 1)")
    _require(a.kl_coef >= 0, f"algorithm.kl_coef={a.kl_coef} must be >= 0")
    _require(
        a.group_size >= 2,
        f"algorithm.group_size={a.group_size} must be >= 2 (the group mean is the baseline)",
    )
    _require(
        a.max_policy_lag >= 0,
        f"algorithm.max_policy_lag={a.max_policy_lag} must be >= 0 (0: synchronous)",
    )
    _require(
        a.stale in ("drop", "throttle"),
        f"algorithm.stale={a.stale!r} must be 'drop' or 'throttle'",
    )
    _require(
        a.overlong in OVERLONG,
        f"algorithm.overlong={a.overlong!r} must be one of {', '.join(OVERLONG)}",
    )
    from rl.algorithms.losses import loss_from_config

    try:  # the correction's name and parameters, as the trainer will build them
        loss_from_config(a)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def validate_reward(r: RewardConfig) -> None:
    """The reward function must import and take (prompt, response, label, metadata)."""
    _require(r.workers >= 1, f"reward.workers={r.workers} must be >= 1")
    _require(r.timeout_s > 0, f"reward.timeout_s={r.timeout_s} must be > 0 seconds")
    try:
        scoring.check(r.fn)
    except scoring.RewardFnError as e:
        raise ConfigError(f"reward.{e}") from None


def validate_weight_sync(cfg: RootConfig) -> None:
    """Can the trainer's shards be planned into the generator's layout? (rl/ddma/plan.py)"""
    from rl.ddma.plan import PlanError, plan_for

    t, m = cfg.trainer, cfg.model
    # Every check of the plan (each tensor's split on both sides, vocab padding, FP8 block
    # alignment) is per tensor shape and layout; further layers and experts only repeat the
    # same tensors. So one layer per pipeline stage and one expert per EP rank check them
    # all, in milliseconds even for a 235B MoE (the full plan takes seconds: rl.plan does
    # it for the volumes). validate_trainer has checked that pp and ep divide the counts.
    few = {"num_layers": t.pp, "num_experts": t.ep if m.num_experts else 0}
    try:
        # One bucket per pair; the real DP, which trainer.ep must divide.
        plan_for(OmegaConf.merge(m, few), t, cfg.rollout, dp=t.dp, bucket_bytes=1 << 50)
    except PlanError as e:
        raise ConfigError(str(e)) from None


def validate_rl(cfg: RootConfig) -> None:
    """The RL stage: its mode, batch shape and sampling must fit the trainer."""
    rl, a, t, s = cfg.rl, cfg.algorithm, cfg.trainer, cfg.rollout.sampling
    _require(rl.steps >= 0, f"rl.steps={rl.steps} must be >= 0")
    _require(rl.mode in ("async", "sync"), f"rl.mode={rl.mode!r} must be 'async' or 'sync'")
    _positive("rl", rl, "prompts_per_step", "log_every")
    for name in ("eval_every", "save_interval"):
        v = getattr(rl, name)
        _require(v >= 0, f"rl.{name}={v} must be >= 0")
    _require(rl.channel_timeout > 0, f"rl.channel_timeout={rl.channel_timeout} must be > 0")
    if rl.steps == 0:
        return
    _require(
        rl.mode == "sync" or a.max_policy_lag >= 1,
        f"rl.mode=async with algorithm.max_policy_lag={a.max_policy_lag}: async needs a lag "
        ">= 1 (a lag of 0 is rl.mode=sync)",
    )
    rows = rl.prompts_per_step * a.group_size
    # A token budget cuts each DP rank's rows itself; otherwise whole micro-batches.
    unit, what = (t.dp, "dp") if t.max_tokens_per_microbatch else (
        t.micro_batch_size * t.dp, f"micro_batch_size*dp={t.micro_batch_size}*")  # fmt: skip
    _require(
        rows % unit == 0,
        f"rl.prompts_per_step*algorithm.group_size={rl.prompts_per_step}*{a.group_size}={rows} "
        f"is not a multiple of trainer.{what}{t.dp}",
    )
    _require(
        s.temperature > 0,
        f"rollout.sampling.temperature={s.temperature} must be > 0 for RL (greedy sampling "
        "does not explore)",
    )
    _require(
        s.n == 1,
        f"rollout.sampling.n={s.n} must be 1 in RL: samples per prompt are "
        f"algorithm.group_size={a.group_size}",
    )
    _positive("rl", rl, "eval_k")


def validate_roles(cfg: RootConfig, world_size: int | None = None) -> None:
    """Every rank of the launch must get exactly one executor (rl/config/roles.py)."""
    try:
        roles = RoleMap.from_config(cfg)
        if world_size is not None:
            roles.check_world(world_size)
    except RoleError as e:
        raise ConfigError(str(e)) from None


def validate_cluster(c: ClusterConfig) -> None:
    """The cluster section alone: names, counts and the split of nodes between training
    and generation (the placement itself is the planner's, rl/plan)."""
    _require(c.name in CLUSTERS, f"cluster.name={c.name!r} must be one of {CLUSTERS}")
    _at_least("cluster", c, 1, "nodes")
    _at_least("cluster", c, 0, "gpus_per_node", "train_nodes", "generation_nodes")
    for name in ("gpu_memory_gb", "interconnect_gbps"):
        v = getattr(c, name)
        _require(v > 0, f"cluster.{name}={v} must be > 0")
    cpus = c.cpus_per_node
    _require(cpus is None or cpus >= 1, f"cluster.cpus_per_node={cpus} must be >= 1 or null")
    _require(
        c.name != "local" or c.nodes == 1,
        f"cluster.nodes={c.nodes} but cluster.name=local runs every rank on this machine "
        "(use cluster=slurm for several nodes)",
    )
    split = c.train_nodes + c.generation_nodes
    if split == 0:
        _require(
            c.nodes == 1,
            f"cluster.nodes={c.nodes} with cluster.train_nodes=0 and cluster.generation_nodes=0:"
            " only a single node can share every executor; split the nodes between training"
            " and generation",
        )
        return
    _require(
        split == c.nodes,
        f"cluster.train_nodes + generation_nodes = {c.train_nodes} + {c.generation_nodes} = "
        f"{split} != cluster.nodes={c.nodes}",
    )
    _require(c.train_nodes >= 1, f"cluster.train_nodes={c.train_nodes} must be >= 1")


def validate(cfg: RootConfig, world_size: int | None = None) -> None:
    """Validate a composed RootConfig; raise ConfigError on the first bad field.

    ``world_size``: the number of ranks a launcher started, checked against the role map."""
    validate_model(cfg.model)
    validate_trainer(cfg.trainer, cfg.model)
    validate_task(cfg)
    validate_rollout(cfg.rollout)
    validate_weight_sync(cfg)
    validate_algorithm(cfg.algorithm)
    validate_reward(cfg.reward)
    validate_rl(cfg)
    validate_cluster(cfg.cluster)
    validate_roles(cfg, world_size)
