"""Semantic validation of a composed config's own fields, run before any process is spawned.

Every check raises :class:`ConfigError` with one line naming the field and its value, so
a bad launch fails in the launcher, in milliseconds, instead of as a shape error on rank 3
minutes later. This module checks what the config alone can say; each layer above owns
the checks that need its code (rl/checks.py runs them all). Pure logic, and a leaf: it
imports nothing of ``rl`` outside ``rl.config``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rl.config.dtypes import PARAM_DTYPES
from rl.config.errors import ConfigError, at_least, positive, require
from rl.config.roles import RoleError, RoleMap
from rl.config.sampling import RequestError, SamplingParams
from rl.config.sglang import RELAYS, WEIGHT_STAGINGS, layout_problem

if TYPE_CHECKING:
    from rl.config.schema import (
        AlgorithmConfig,
        ClusterConfig,
        LoraConfig,
        OptimConfig,
        RewardConfig,
        RolloutConfig,
        RootConfig,
        TrainerConfig,
    )

CLUSTERS = ("local", "slurm")
OVERLONG = ("keep", "mask", "penalise")
DEVICES = ("cpu", "cuda")
# trainer.lora.targets: attention's fused QKV and output, the MLP's fused gate/up and down
LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")
DECAY_STYLES = ("constant", "linear", "cosine")
RECOMPUTE = ("none", "full")  # trainer.recompute
ATTENTION = ("sdpa", "dot_product")  # trainer.attention


def validate_optim(where: str, o: OptimConfig) -> None:
    require(
        o.decay_style in DECAY_STYLES,
        f"{where}.decay_style={o.decay_style!r} must be one of {DECAY_STYLES}",
    )
    require(o.lr > 0, f"{where}.lr={o.lr} must be > 0")
    require(0 <= o.min_lr <= o.lr, f"{where}.min_lr={o.min_lr} must be in [0, {where}.lr={o.lr}]")
    require(o.clip_grad >= 0, f"{where}.clip_grad={o.clip_grad} must be >= 0")
    for name in ("warmup_steps", "decay_steps"):
        v = getattr(o, name)
        require(v is None or v >= 0, f"{where}.{name}={v} must be >= 0")


def validate_trainer_fields(t: TrainerConfig) -> None:
    """The trainer section alone (its layout on the model: rl/models/checks.py)."""
    positive("trainer", t, "tp", "pp", "dp", "ep", "cp", "micro_batch_size", "global_batch_size")
    positive("trainer", t, "threads_per_rank")
    require(t.dp % t.ep == 0, f"trainer.ep={t.ep} does not divide trainer.dp={t.dp}")
    require(t.device in DEVICES, f"trainer.device={t.device!r} must be one of {DEVICES}")
    require(
        t.params_dtype in PARAM_DTYPES,
        f"trainer.params_dtype={t.params_dtype!r} must be one of {PARAM_DTYPES}",
    )
    validate_optim("trainer.optim", t.optim)
    budget = t.max_tokens_per_microbatch
    require(
        budget is None or (isinstance(budget, int) and budget >= 1),
        f"trainer.max_tokens_per_microbatch={budget!r} must be an integer >= 1 or null",
    )
    require(isinstance(t.packing, bool), f"trainer.packing={t.packing!r} must be true or false")
    require(
        not (t.packing and t.attention == "dot_product"),
        "trainer.packing=true needs trainer.attention=sdpa (Megatron's DotProductAttention "
        "takes no packed sequences): set trainer.packing=false to use dot_product",
    )
    require(
        budget is None or t.pp == 1 or t.packing,
        f"trainer.max_tokens_per_microbatch={budget} with trainer.packing=false needs "
        f"trainer.pp=1 (pipeline stages exchange one fixed micro-batch shape), not "
        f"trainer.pp={t.pp}",
    )
    validate_context_parallel(t)
    require(t.save_interval >= 0, f"trainer.save_interval={t.save_interval} must be >= 0")
    require(
        t.recompute in RECOMPUTE, f"trainer.recompute={t.recompute!r} must be one of {RECOMPUTE}"
    )
    require(
        t.attention in ATTENTION, f"trainer.attention={t.attention!r} must be one of {ATTENTION}"
    )
    require(
        isinstance(t.sequence_parallel, bool),
        f"trainer.sequence_parallel={t.sequence_parallel!r} must be true or false",
    )
    validate_lora(t.lora)


def validate_context_parallel(t: TrainerConfig) -> None:
    """``trainer.cp`` splits packed sequences over ranks in SDPA's attention."""
    if t.cp == 1:
        return
    require(
        t.packing,
        f"trainer.cp={t.cp} splits packed sequences: it needs trainer.packing=true",
    )
    require(
        t.attention == "sdpa",
        f"trainer.cp={t.cp} needs trainer.attention=sdpa ({t.attention!r} holds the whole "
        "sequence's scores on one rank)",
    )
    budget = t.max_tokens_per_microbatch
    require(
        budget is None or budget % (2 * t.cp) == 0,
        f"trainer.cp={t.cp} does not divide trainer.max_tokens_per_microbatch={budget} into "
        f"2*cp={2 * t.cp} chunks",
    )


def validate_lora(lora: LoraConfig) -> None:
    """The adapters' own fields (their fit to the model: rl/models/checks.py)."""
    require(
        isinstance(lora.rank, int) and lora.rank >= 0,
        f"trainer.lora.rank={lora.rank!r} must be an integer >= 0 (0: no adapters)",
    )
    if not lora.rank:
        return
    require(lora.alpha > 0, f"trainer.lora.alpha={lora.alpha} must be > 0")
    require(0 <= lora.dropout < 1, f"trainer.lora.dropout={lora.dropout} must be in [0, 1)")
    targets = list(lora.targets)
    bad = [x for x in targets if x not in LORA_TARGETS]
    require(
        bool(targets) and not bad and len(set(targets)) == len(targets),
        f"trainer.lora.targets={targets} must be distinct names among {list(LORA_TARGETS)}",
    )


def validate_batch(t: TrainerConfig) -> None:
    """The trainer's global batch in whole micro-batches of every data-parallel rank."""
    per_step = t.micro_batch_size * t.dp
    require(
        t.global_batch_size % per_step == 0,
        f"trainer.global_batch_size={t.global_batch_size} is not a multiple of "
        f"trainer.micro_batch_size*dp={t.micro_batch_size}*{t.dp}={per_step}",
    )


def validate_sft(cfg: RootConfig) -> None:
    """The supervised warm-up (the task's own fields: rl/tasks/checks.py)."""
    sft = cfg.sft
    require(sft.steps >= 0, f"sft.steps={sft.steps} must be >= 0")
    positive("sft", sft, "log_every", "check_every")
    at_least("sft", sft, 0, "eval_every")
    t = sft.stop_at_accuracy
    require(t is None or 0 < t <= 1, f"sft.stop_at_accuracy={t} must be in (0, 1] or null")
    if sft.optim is not None:
        validate_optim("sft.optim", sft.optim)


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
    require(a.kl_coef >= 0, f"algorithm.kl_coef={a.kl_coef} must be >= 0")
    for name in ("epochs", "minibatches"):
        v = getattr(a, name)
        require(isinstance(v, int) and v >= 1, f"algorithm.{name}={v!r} must be an integer >= 1")
    # >= 2 where the estimator's baseline is its group's (rl/algorithms/registry.py)
    require(a.group_size >= 1, f"algorithm.group_size={a.group_size} must be >= 1")
    require(
        a.group_size > 1 or not a.drop_uniform_groups,
        "algorithm.drop_uniform_groups=true with algorithm.group_size=1: a group of one "
        "sample is always uniform, so every group would be dropped",
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


def validate_reward(r: RewardConfig) -> None:
    """The reward executor (its function: rl/tasks/checks.py)."""
    require(r.workers >= 1, f"reward.workers={r.workers} must be >= 1")
    require(r.timeout_s > 0, f"reward.timeout_s={r.timeout_s} must be > 0 seconds")
    require(r.reply_margin_s > 0, f"reward.reply_margin_s={r.reply_margin_s} must be > 0 seconds")


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
    require(rl.stall_warn_s >= 0, f"rl.stall_warn_s={rl.stall_warn_s} must be >= 0 (0: off)")
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
        rows % (unit * a.minibatches) == 0,
        f"algorithm.minibatches={a.minibatches} does not cut the batch of {rows} rows "
        f"(rl.prompts_per_step*algorithm.group_size) into minibatches of whole "
        f"trainer.{what}{t.dp}={unit} rows",
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
    at_least("cluster", c, 0, "gpus_per_node", "train_nodes", "generation_nodes", "model_nodes")
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
    split = c.train_nodes + c.generation_nodes + c.model_nodes
    if split == 0:
        require(
            c.nodes == 1,
            f"cluster.nodes={c.nodes} with cluster.train_nodes=0 and cluster.generation_nodes=0:"
            " only a single node can share every executor; split the nodes between training"
            " and generation",
        )
        return
    names, counts = "train_nodes + generation_nodes", f"{c.train_nodes} + {c.generation_nodes}"
    if c.model_nodes:
        names, counts = f"{names} + model_nodes", f"{counts} + {c.model_nodes}"
    require(split == c.nodes, f"cluster.{names} = {counts} = {split} != cluster.nodes={c.nodes}")
    require(c.train_nodes >= 1, f"cluster.train_nodes={c.train_nodes} must be >= 1")


def validate(cfg: RootConfig, world_size: int | None = None) -> None:
    """The config's own fields, section by section; raise ConfigError on the first bad one.

    What other layers own (the model and the trainer's layout on it, the task and the
    reward function, the correction, the DDMA plan and transport) is checked by their
    owners: rl/checks.py runs them all. ``world_size``: the number of ranks a launcher
    started, checked against the role map."""
    validate_trainer_fields(cfg.trainer)
    validate_batch(cfg.trainer)
    validate_sft(cfg)
    validate_rollout(cfg.rollout)
    validate_algorithm(cfg.algorithm)
    validate_reward(cfg.reward)
    validate_rl(cfg)
    validate_cluster(cfg.cluster)
    validate_roles(cfg, world_size)
