"""Semantic validation of a composed config, run before any process is spawned.

Every check raises :class:`ConfigError` with one line naming the field and its value, so
a bad launch fails in the launcher, in milliseconds, instead of as a shape error on rank 3
minutes later. Pure logic: no torch.distributed, no Megatron.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from rl.config.errors import ConfigError, at_least, positive, require
from rl.config.model_checks import validate_model, validate_optim, validate_trainer
from rl.config.roles import RoleError, RoleMap
from rl.config.sampling import RequestError, SamplingParams
from rl.config.sglang import WEIGHT_STAGINGS, layout_problem
from rl.tasks import scoring

if TYPE_CHECKING:  # a task is built (data files, tokenizers) only where it is checked
    from rl.config.schema import (
        AlgorithmConfig,
        ClusterConfig,
        RewardConfig,
        RolloutConfig,
        RootConfig,
    )
    from rl.tasks import Task

CLUSTERS = ("local", "slurm")
OVERLONG = ("keep", "mask", "penalise")


def validate_task(cfg: RootConfig) -> None:
    """The task's own fields (rl/tasks checks them; no data is read here) and the warm-up."""
    from rl.tasks import TaskError, check_config

    try:
        check_config(cfg)
    except TaskError as e:
        raise ConfigError(str(e)) from None
    sft = cfg.sft
    require(sft.steps >= 0, f"sft.steps={sft.steps} must be >= 0")
    positive("sft", sft, "log_every", "check_every")
    at_least("sft", sft, 0, "eval_every")
    t = sft.stop_at_accuracy
    require(t is None or 0 < t <= 1, f"sft.stop_at_accuracy={t} must be in (0, 1] or null")
    if sft.optim is not None:
        validate_optim("sft.optim", sft.optim)


def check_task(cfg: RootConfig) -> Task:
    """Build the task (reads and renders its data) and check it against the model and
    the rollouts; returns it. Run once before launch, after :func:`validate`."""
    from rl.tasks import TaskError, build_task

    try:
        task = build_task(cfg)
    except TaskError as e:
        raise ConfigError(str(e)) from None
    if cfg.rl.steps > 0:
        check_context(cfg, task.max_prompt_len)
    if cfg.sft.steps > 0:
        missing = next((e.uid for e in task.validation_set if not e.target_ids), None)
        require(
            missing is None,
            f"sft.steps={cfg.sft.steps} needs a label on every prompt: {missing} has none "
            f"(task.label_key={cfg.task.label_key!r})",
        )
    return task


def check_context(cfg: RootConfig, longest: int) -> None:
    """Every rollout must fit the servers: the longest prompt (``longest`` tokens, measured
    on the rendered data) plus ``max_new_tokens`` within the context and the KV cache, and
    the context within the model's positions (checked here, after resolve_model has read
    them from model.hf_checkpoint, not in validate)."""
    r, new = cfg.rollout, cfg.rollout.sampling.max_new_tokens
    positions = cfg.model.max_position_embeddings
    require(  # SGLang refuses it at server start, after the warm-up
        r.context_length is None or r.context_length <= positions,
        f"rollout.context_length={r.context_length} exceeds model.max_position_embeddings="
        f"{positions} (the servers refuse a longer context; null: the model's)",
    )
    context = r.context_length or positions
    require(
        longest + new <= context,
        f"rollout.sampling.max_new_tokens={new} + the longest prompt ({longest} tokens) "
        f"exceeds the context of {context} tokens (rollout.context_length or "
        "model.max_position_embeddings; task.max_prompt_tokens drops long prompts)",
    )
    kv = r.max_total_tokens
    require(
        kv is None or longest + new <= kv,
        f"rollout.max_total_tokens={kv} (a server's KV cache) cannot hold one rollout: the "
        f"longest prompt ({longest} tokens) + rollout.sampling.max_new_tokens={new}",
    )


def validate_rollout(r: RolloutConfig) -> None:
    positive("rollout", r, "servers", "max_in_flight")
    problem = layout_problem(r.device, r.tp, r.dtype, "rollout")
    require(problem is None, str(problem))
    for name in ("threads", "max_total_tokens", "max_running_requests", "context_length"):
        v = getattr(r, name)
        require(
            v is None or (isinstance(v, int) and v >= 1),
            f"rollout.{name}={v!r} must be an integer >= 1 or null",
        )
    for name in ("startup_timeout", "request_timeout", "restart_window_s", "health_timeout_s"):
        v = getattr(r, name)
        require(v > 0, f"rollout.{name}={v} must be > 0 seconds")
    require(r.max_restarts >= 0, f"rollout.max_restarts={r.max_restarts} must be >= 0")
    positive("rollout", r, "health_failures")
    seg = r.segment_tokens
    require(seg is None or seg >= 1, f"rollout.segment_tokens={seg} must be >= 1 or null")
    try:
        SamplingParams.from_config(r.sampling)
    except RequestError as e:
        raise ConfigError(f"rollout.{e}") from None
    w = r.weight_sync  # its transport: rl.ddma.transport.check (rl/checks.py)
    require(w.bucket_mb >= 1, f"rollout.weight_sync.bucket_mb={w.bucket_mb} must be >= 1")
    why = f"rollout.weight_sync.staging={w.staging!r} must be one of {WEIGHT_STAGINGS}"
    require(w.staging in WEIGHT_STAGINGS, why)
    require(w.timeout > 0, f"rollout.weight_sync.timeout={w.timeout} must be > 0 seconds")
    from rl.ddma.relay import RELAYS

    require(w.relay in RELAYS, f"rollout.weight_sync.relay={w.relay!r} must be one of {RELAYS}")
    require(
        w.relay_roots >= 0,
        f"rollout.weight_sync.relay_roots={w.relay_roots} must be >= 0 (0: chosen per plan)",
    )
    require(w.relay_fanout >= 1, f"rollout.weight_sync.relay_fanout={w.relay_fanout} must be >= 1")
    fp8 = w.fp8_block
    require(
        fp8 is None or (fp8 >= 1 and r.device == "cuda"),
        f"rollout.weight_sync.fp8_block={fp8} needs rollout.device=cuda (SGLang's FP8 "
        "kernels are GPU-only) and a block >= 1",
    )


def validate_algorithm(a: AlgorithmConfig) -> None:
    require(a.name in ("aipo", "grpo"), f"algorithm.name={a.name!r} must be 'aipo' or 'grpo'")
    require(a.rho > 0, f"algorithm.rho={a.rho} must be > 0 (the importance-weight cap)")
    require(0 < a.clip_eps < 1, f"algorithm.clip_eps={a.clip_eps} must be in (0, 1)")
    require(a.kl_coef >= 0, f"algorithm.kl_coef={a.kl_coef} must be >= 0")
    require(
        a.group_size >= 2,
        f"algorithm.group_size={a.group_size} must be >= 2 (the group mean is the baseline)",
    )
    require(
        a.max_policy_lag >= 0,
        f"algorithm.max_policy_lag={a.max_policy_lag} must be >= 0 (0: synchronous)",
    )
    require(
        a.stale in ("drop", "throttle"),
        f"algorithm.stale={a.stale!r} must be 'drop' or 'throttle'",
    )
    require(
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
    require(r.workers >= 1, f"reward.workers={r.workers} must be >= 1")
    require(r.timeout_s > 0, f"reward.timeout_s={r.timeout_s} must be > 0 seconds")
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
    require(rl.steps >= 0, f"rl.steps={rl.steps} must be >= 0")
    require(rl.mode in ("async", "sync"), f"rl.mode={rl.mode!r} must be 'async' or 'sync'")
    require(rl.resume in ("auto", "never"), f"rl.resume={rl.resume!r} must be 'auto' or 'never'")
    positive("rl", rl, "prompts_per_step", "log_every")
    for name in ("eval_every", "save_interval"):
        v = getattr(rl, name)
        require(v >= 0, f"rl.{name}={v} must be >= 0")
    require(rl.channel_timeout > 0, f"rl.channel_timeout={rl.channel_timeout} must be > 0")
    if rl.steps == 0:
        return
    require(
        rl.mode == "sync" or a.max_policy_lag >= 1,
        f"rl.mode=async with algorithm.max_policy_lag={a.max_policy_lag}: async needs a lag "
        ">= 1 (a lag of 0 is rl.mode=sync)",
    )
    rows = rl.prompts_per_step * a.group_size
    # A token budget cuts each DP rank's rows itself; otherwise whole micro-batches.
    unit, what = (t.dp, "dp") if t.max_tokens_per_microbatch else (
        t.micro_batch_size * t.dp, f"micro_batch_size*dp={t.micro_batch_size}*")  # fmt: skip
    require(
        rows % unit == 0,
        f"rl.prompts_per_step*algorithm.group_size={rl.prompts_per_step}*{a.group_size}={rows} "
        f"is not a multiple of trainer.{what}{t.dp}",
    )
    require(
        s.temperature > 0,
        f"rollout.sampling.temperature={s.temperature} must be > 0 for RL (greedy sampling "
        "does not explore)",
    )
    require(
        s.n == 1,
        f"rollout.sampling.n={s.n} must be 1 in RL: samples per prompt are "
        f"algorithm.group_size={a.group_size}",
    )
    positive("rl", rl, "eval_k")


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
    require(c.name in CLUSTERS, f"cluster.name={c.name!r} must be one of {CLUSTERS}")
    at_least("cluster", c, 1, "nodes")
    at_least("cluster", c, 0, "gpus_per_node", "train_nodes", "generation_nodes")
    for name in ("gpu_memory_gb", "interconnect_gbps"):
        v = getattr(c, name)
        require(v > 0, f"cluster.{name}={v} must be > 0")
    cpus = c.cpus_per_node
    require(cpus is None or cpus >= 1, f"cluster.cpus_per_node={cpus} must be >= 1 or null")
    require(
        c.name != "local" or c.nodes == 1,
        f"cluster.nodes={c.nodes} but cluster.name=local runs every rank on this machine "
        "(use cluster=slurm for several nodes)",
    )
    split = c.train_nodes + c.generation_nodes
    if split == 0:
        require(
            c.nodes == 1,
            f"cluster.nodes={c.nodes} with cluster.train_nodes=0 and cluster.generation_nodes=0:"
            " only a single node can share every executor; split the nodes between training"
            " and generation",
        )
        return
    require(
        split == c.nodes,
        f"cluster.train_nodes + generation_nodes = {c.train_nodes} + {c.generation_nodes} = "
        f"{split} != cluster.nodes={c.nodes}",
    )
    require(c.train_nodes >= 1, f"cluster.train_nodes={c.train_nodes} must be >= 1")


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
