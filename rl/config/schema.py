"""Dataclass schemas for every config group, registered in Hydra's ConfigStore.

Why dataclasses: Hydra then type-checks every YAML file and command-line override against
the schema, so ``trainer.tpp=2`` or ``trainer.tp=two`` fails at composition, before any
process is spawned. Semantic checks live in ``validate.py`` (the config's own fields) and
in the layers that own the rest (the model and its trainer: rl/models/checks.py; all of
them: rl/checks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class RopeScalingConfig:
    """Llama 3.x RoPE frequency scaling (HF ``rope_scaling`` with rope_type "llama3")."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass
class VisionConfig:
    """A vision-language model's image side (rl/models/vision): the HF vision tower's own
    config as the checkpoint gives it, the image tokens, and the language model's
    multimodal RoPE. Read from the checkpoint's config.json, never written by hand."""

    # The HF ``vision_config``: the tower is transformers' own module, built from it.
    tower: dict[str, Any] = field(default_factory=dict)
    image_token_id: int = MISSING  # the placeholder each image's embeddings replace
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    # Rotary frequency pairs given to the temporal, height and width positions (in that
    # order); they sum to head_dim / 2.
    mrope_section: list[int] = field(default_factory=list)


# The model's sizes.
_SIZES = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "vocab_size",
    "make_vocab_size_divisible_by",
)
# The fields that make its architecture: a checkpoint and the model loading it must agree
# on every one (rl/config/ckpt_check.py).
ARCH_FIELDS = (
    "architecture",
    *_SIZES,
    "qkv_bias",
    "qk_norm",
    "head_dim",
    "tie_embeddings",
    "num_experts",
    "moe_ffn_hidden_size",
    "shared_expert_ffn_hidden_size",
    "shared_expert_gate",
)
# Every size, the context included, an integer >= 1 (rl/models/checks.py).
SIZE_FIELDS = (*_SIZES, "max_position_embeddings")


@dataclass
class ModelConfig:
    """A decoder of one registered architecture (rl/models/families): RMSNorm, RoPE,
    SwiGLU, GQA, with the options its family fixes (QKV bias, QK norm, experts)."""

    name: str = MISSING
    # The Hugging Face class, which selects the family (rl/models/registry.py).
    architecture: str = "LlamaForCausalLM"
    num_layers: int = MISSING
    hidden_size: int = MISSING
    ffn_hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    num_query_groups: int = MISSING
    vocab_size: int = MISSING
    max_position_embeddings: int = MISSING
    rotary_base: float = 10000.0
    rope_scaling: RopeScalingConfig | None = None
    norm_epsilon: float = 1e-5
    qkv_bias: bool = False
    qk_norm: bool = False  # RMSNorm on every head's q and k (Qwen3)
    # Per-head width when it is not hidden_size / num_attention_heads (Qwen3, Mistral).
    head_dim: int | None = None
    tie_embeddings: bool = False
    # Mixture of Experts (0 experts: a dense MLP). Every layer is an MoE layer.
    num_experts: int = 0
    moe_ffn_hidden_size: int | None = None  # one expert's intermediate size
    moe_router_topk: int = 2
    # Renormalise the top-k routing weights (HF norm_topk_prob); false: softmax over all.
    moe_norm_topk_prob: bool = True
    shared_expert_ffn_hidden_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = False  # sigmoid gate on the shared expert (Qwen2-MoE)
    moe_aux_loss_coeff: float = 0.001  # load-balancing loss weight (HF router_aux_loss_coef)
    # Embedding/output rows are padded up to a multiple of this (Megatron's convention).
    # Padding is a model property, not a TP one, so a checkpoint's shapes are the same at
    # every TP size and it reshards freely; conversion to HF strips the padding rows.
    make_vocab_size_divisible_by: int = 1
    init_method_std: float = 0.02
    # A Hugging Face directory (config.json, safetensors, tokenizer). When set, every
    # architecture field above is read from its config.json at launch (rl/weights/hf_model.py),
    # the trainer starts from its weights and the servers start from the directory.
    hf_checkpoint: str | None = None
    # Set for a vision-language family (from its config.json); None: a text model.
    vision: VisionConfig | None = None
    # Train the vision tower and merger too (data-parallel, Adam state in the checkpoint);
    # false: they stay as loaded.
    train_vision: bool = False
    # The largest image (width x height, as the file holds it) a prompt may carry; a
    # larger one's prompt is skipped and counted. None: any (the processor resizes it).
    max_pixels: int | None = None


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    # Steps over which the LR decays to min_lr; None means the run's number of steps.
    decay_steps: int | None = None
    decay_style: str = "constant"  # constant | linear | cosine


@dataclass
class LoraConfig:
    """Low-rank adapters on the trainer's linears (rl/models/lora.py): each targeted weight
    W trains as W + (alpha / rank) * B @ A with W frozen, and only A and B get gradients and
    optimizer state. DDMA sends the servers the merged W + (alpha / rank) * B @ A."""

    rank: int = 0  # 0: no adapters, every weight trains
    alpha: float = 16.0
    dropout: float = 0.0  # on the adapters' input, training only
    # qkv (attention's fused QKV), proj (its output), fc1 (the MLP's fused gate/up), fc2
    targets: list[str] = field(default_factory=lambda: ["qkv", "proj", "fc1", "fc2"])


@dataclass
class TrainerConfig:
    """Megatron-Core trainer executor: parallel layout, batching, optimizer, checkpoints."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1  # expert parallelism (MoE): experts split over ep of the dp ranks
    # Context parallelism: each packed sequence split over cp ranks (2*cp chunks, rank i
    # holding chunks i and 2*cp-1-i), keys and values all-gathered in attention; the
    # trainer's ranks are tp*cp*pp*dp. Needs trainer.packing and trainer.attention=sdpa.
    cp: int = 1
    micro_batch_size: int = 8
    global_batch_size: int = 32
    use_distributed_optimizer: bool = True
    params_dtype: str = "float32"  # float32 | bfloat16
    device: str = "cpu"  # cpu (gloo) | cuda (nccl)
    seed: int = 1234
    # torch intra-op threads per rank: 2 ranks on 2 cores oversubscribe with more.
    threads_per_rank: int = 1
    optim: OptimConfig = field(default_factory=OptimConfig)
    save_dir: str | None = None
    save_interval: int = 0  # 0: only at the end (when save_dir is set)
    load_dir: str | None = None
    load_optimizer: bool = True
    # Cut each rank's rows into micro-batches of at most this many tokens (rows x their
    # longest sequence) instead of micro_batch_size rows; null: micro_batch_size rows.
    max_tokens_per_microbatch: int | None = None
    # Packed micro-batches: each one a single stream of its rows' own lengths (no padding
    # but what TP/CP divisibility needs), attention causal within each row, RoPE restarted
    # at each (rl/engine/packing.py). false: rows right-padded to a common width.
    packing: bool = True
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Megatron's sequence parallelism with tp > 1: the norms' inputs and the residual
    # stream split over the TP ranks too, each holding 1/tp of the sequence (a
    # Mixture-of-Experts model has it with tp > 1 either way: Megatron-Core requires it).
    sequence_parallel: bool = False
    # Activation recomputation: none keeps each layer's activations for the backward;
    # full keeps only each layer's input and runs the layer's forward again in the
    # backward (Megatron's recompute_granularity=full, uniform, one layer per checkpoint).
    recompute: str = "none"
    # Core attention of Megatron's local layer spec (without Transformer Engine, whose own
    # fused attention is used when it imports): sdpa runs torch's fused
    # scaled_dot_product_attention kernels, which never hold the [s, s] score matrix;
    # dot_product is Megatron's DotProductAttention, which does (the same logits in fp32
    # to rounding: tests/multiproc/test_sdpa_attention.py).
    attention: str = "sdpa"


@dataclass
class CriticConfig:
    """The critic (rl/companion/critic.py): a scalar-head model on ranks of its own
    (``critic.trainer``: its layout, batch, optimizer and dtype), trained on each RL batch
    beside the policy with the clipped value loss; its values of every token are what
    ``algorithm/advantage=gae`` needs. Off unless a ``critic=`` preset (conf/critic/) turns
    it on."""

    enabled: bool = False
    # policy: the policy's weights as the RL stage starts (its warm-up's checkpoint), with
    # a fresh scalar head; hf: the HF *ForSequenceClassification at critic.hf_checkpoint
    # (a reward model: tools/train_reward_model.py), head included, of any size or family
    # sharing the policy's tokenizer
    init: str = "policy"
    hf_checkpoint: str | None = None
    clip: float | None = 0.2  # the value loss's clip around the scored values; null: none
    # Passes over each RL batch, each cut into this many minibatches, one optimizer step
    # per minibatch (as algorithm.epochs and minibatches are the policy's).
    epochs: int = 1
    minibatches: int = 1
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


@dataclass
class TeacherConfig:
    """A frozen teacher for on-policy distillation (rl/companion/teacher.py): an HF causal LM
    sharing the policy's tokenizer, of any size or family, on ranks of its own
    (``teacher.trainer``: its layout and dtype), giving its log-prob of every sampled token
    (``algorithm.distill_coef`` uses them). Off unless a ``teacher=`` preset turns it on."""

    enabled: bool = False
    hf_checkpoint: str | None = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


@dataclass
class RewardModelConfig:
    """A frozen reward model (rl/companion/reward_model.py): an HF ``*ForSequenceClassification``
    checkpoint with one label, on ranks of its own (``reward_model.trainer``: its layout and
    dtype), scoring each (prompt + response) by its value at its rightmost token that is not
    the checkpoint's ``pad_token_id``. ``reward.fn=model`` or ``reward.combine`` use it. Off
    unless a ``reward_model=`` preset turns it on."""

    enabled: bool = False
    hf_checkpoint: str | None = None
    # How a score becomes a reward: none | standard ((s - mean) / std) | sigmoid (of the
    # standardised score: in (0, 1), a Bradley-Terry model's odds against the mean).
    normalize: str = "none"
    # null: the checkpoint's reward_stats.json (tools/train_reward_model.py writes its
    # held-out scores' mean and std there), else 0 and 1
    mean: float | None = None
    std: float | None = None
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


@dataclass
class TaskConfig:
    """What the loop trains and evaluates on (rl/tasks): the fields every task has. Each
    task's module in rl/tasks/kinds/ subclasses this with its own fields, and ``task=<name>``
    picks it."""

    name: str = MISSING
    seed: int = 0  # the training stream's shuffle and the held-out split
    eval_size: int = 256  # held-out prompts for the evaluation (0: none)


@dataclass
class SFTConfig:
    """Supervised warm-up on the task's answers (loss on answer tokens only)."""

    steps: int = 0  # at most; 0: no warm-up
    log_every: int = 1
    eval_every: int = 50  # held-out greedy pass rate every N steps (0: never)
    # End the warm-up once greedy accuracy on fresh training problems reaches this (checked
    # every check_every steps); null: always run all the steps.
    stop_at_accuracy: float | None = None
    check_every: int = 10
    # The warm-up's optimizer and LR schedule; null: trainer.optim. RL runs on
    # trainer.optim with a fresh optimizer state (RL wants a far smaller LR).
    optim: OptimConfig | None = None


@dataclass
class SamplingConfig:
    """Default sampling of rollouts (checked by rl.config.sampling.SamplingParams)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 16
    n: int = 1
    # Each rollout's sampling seed is drawn from this, its prompt and its sample index, and
    # each token from that seed and its position: the same samples in any batch and across
    # resumed segments on CPU (rl/serving/cpu_seeds.py); a CUDA server honours it only
    # when started with SGLang's --enable-deterministic-inference, which the launcher does
    # not pass. null: random.
    seed: int | None = None


@dataclass
class WeightSyncConfig:
    """DDMA: trainer shards straight into the generator's shards after each step (rl/ddma)."""

    # How the buckets travel, one of rl/ddma/transports/ (docs/ddma.md, "Transports"):
    # ipc: host shared-memory rings named in the servers' HTTP API (one host); cuda_ipc:
    # GPU buckets handed over as CUDA IPC handles (one host, CUDA both ends); p2p: point to
    # point over a process group, NCCL GPU to GPU, else gloo (any hosts; relays); p2p_shm:
    # signals over the group, bytes through shared-memory rings (one host).
    transport: str = "ipc"
    bucket_mb: int = 64  # per-rank extra memory of a sync is two buckets
    # Blockwise FP8 (e4m3, this block size) for the linear weights, for GPU engines started
    # from an FP8 checkpoint config; null sends them in the trainer's dtype.
    fp8_block: int | None = None
    timeout: float = 600.0
    # Where each server keeps the incoming version until all of it has arrived (the
    # planner counts it): device, a full copy of its weights beside them (today's
    # behaviour); host, a pinned host-memory copy; none, written in place while paused, and
    # a version that does not complete leaves the server paused and out of routing.
    staging: str = "device"
    # p2p into several servers (rl/ddma/relay.py): the trainer ranks feed relay_roots servers
    # and each other server gets every bucket, unchanged, from a parent server that forwards
    # it while receiving the next. chain: the others hang below the roots in chains; tree:
    # each server forwards to relay_fanout servers; none: the trainer feeds every server.
    # A server lost mid-sync fails that version on the servers below it at once (they keep
    # the previous one); the next sync re-forms the topology over the servers that answer.
    relay: str = "none"
    relay_roots: int = 0  # 0: as many as keep a trainer rank no busier than a server GPU
    relay_fanout: int = 2  # tree only: servers each server forwards to
    # A group transport (p2p, p2p_shm) with staging device or host: the servers keep
    # generating (on the previous version) while the buckets arrive, and pause only to open
    # the version and to commit it. false: paused for the whole sync, as staged transports
    # (ipc, cuda_ipc) and staging none always are.
    overlap: bool = True


@dataclass
class RolloutConfig:
    """The generator executor: the SGLang servers it starts and how it samples."""

    # A Hugging Face directory the servers start from; null: one written from model/ (the
    # trainer pushes its weights before the first rollout either way).
    model_path: str | None = None
    servers: int = 1
    tp: int = 1  # SGLang tensor parallelism per server (CPU: 1)
    device: str = "cpu"
    dtype: str = "float32"  # float32 | bfloat16
    # Intra-op threads per server on CPU; None: all cores.
    threads: int | None = 1
    # KV-cache tokens and concurrent requests per server (SGLang's own defaults size the
    # KV cache from free memory, which on CPU means most of the machine's RAM).
    max_total_tokens: int | None = 8192
    max_running_requests: int | None = 64
    context_length: int | None = None  # None: the model's max_position_embeddings
    startup_timeout: float = 300.0
    max_in_flight: int = 64  # requests the client keeps on each server
    request_timeout: float = 600.0
    # Cut rollouts after this many new tokens and resume them later (partial rollouts).
    segment_tokens: int | None = None
    # A server that dies or stops answering /health is restarted on its rank and given the
    # current weights; more than max_restarts restarts within restart_window_s fail the job.
    max_restarts: int = 3
    restart_window_s: float = 600.0
    health_timeout_s: float = 10.0  # a /health slower than this counts as a failed check
    health_failures: int = 3  # consecutive failed checks that make a live server unresponsive
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)


@dataclass
class ObjectiveConfig:
    """The RL loss's own fields. Each objective's module in rl/algorithms/objectives/
    subclasses this, and ``algorithm/objective=<name>`` picks it."""

    name: str = MISSING


@dataclass
class CorrectionConfig:
    """The fields of the per-token off-policy weight ``w(pi/mu)`` (no gradient) of the
    policy gradient ``-w * A * log pi``. Each correction's module in
    rl/algorithms/corrections/ subclasses this, and ``algorithm/correction=<name>`` picks
    it."""

    name: str = MISSING


@dataclass
class AdvantageConfig:
    """How each sampled token's advantage is estimated from the rewards (and, for some
    estimators, the reference log-probs or a critic's values). Each estimator's module in
    rl/algorithms/advantages/ subclasses this, and ``algorithm/advantage=<name>`` picks
    it."""

    name: str = MISSING


@dataclass
class AlgorithmConfig:
    """The RL objective and how stale a rollout may be (rl/algorithms). The presets:
    algorithm=aipo (pg with the aipo correction) and algorithm=grpo (ppo_clip), both with
    the grpo advantage."""

    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    # How the per-token losses become one (rl/algorithms/aggregation.py): token_mean |
    # seq_mean_token_mean | seq_mean_token_sum_norm; null: the advantage estimator's own
    # (dr_grpo: seq_mean_token_sum_norm), else the objective's (gspo: seq_mean_token_mean),
    # else token_mean.
    loss_agg: str | None = None
    # Sample reuse (rl/algorithms/reuse.py): passes over each RL batch, each cut into this
    # many minibatches, one optimizer step per minibatch. With more than one step the
    # trainer scores pi_old first (a forward pass) to log the policy's move apart from the
    # train/rollout mismatch; the ratio stays pi/mu.
    epochs: int = 1
    minibatches: int = 1
    kl_coef: float = 0.0  # KL(pi || pi_ref) penalty; 0: no reference model
    # On-policy distillation (rl/algorithms/distill.py; needs a ``teacher=``): each sampled
    # token's advantage gains distill_coef * (log pi_teacher - log mu); distill_only: that
    # term alone, without the task's advantages.
    distill_coef: float = 0.0
    distill_only: bool = False
    group_size: int = 8  # samples per prompt (a group estimator's baseline is their mean)
    # Off-policy bound: train on rollouts at most this many policy versions old (0: fully
    # synchronous). Older ones are dropped, or the generator is throttled at the source.
    max_policy_lag: int = 1
    stale: str = "drop"  # drop | throttle
    # Skip groups whose rewards are all equal (no signal), count them, refill the batch.
    drop_uniform_groups: bool = False
    # A response cut by max_new_tokens: keep it, mask it out of the loss, or penalise it
    # (its reward becomes overlong_penalty).
    overlong: str = "keep"  # keep | mask | penalise
    overlong_penalty: float = -1.0
    # MoE only: rollout routing replay (R3). The servers return the experts they routed
    # each token to, and every trainer pass over the batch (pi_old, the reference, the
    # loss) routes each token to those experts, its gating weights from its own logits.
    routing_replay: bool = False


@dataclass
class JudgeConfig:
    """A generative reward model (``reward.fn=judge``): an LLM served by SGLang on every
    reward rank, asked to grade each response; its answer, parsed, is the score."""

    model_path: str | None = None  # an HF directory with its tokenizer (and chat template)
    servers: int = 1  # per reward rank
    # A shipped template (correctness) or a text file, the judge's user turn, with
    # {prompt} {response} {label} {conversation} filled in.
    prompt: str = "correctness"
    # How the answer becomes a score: yes_no | score10 | 'pkg.module:fn' | 'path/to.py:fn',
    # fn(text) -> float. An answer it cannot read scores 0 and is counted as a failure.
    parser: str = "yes_no"
    max_new_tokens: int = 16  # greedy
    concurrency: int = 16  # items in flight per reward rank
    timeout_s: float = 60.0  # per item; an overrun scores 0 and is counted
    dtype: str = "float32"
    threads: int | None = 1
    context_length: int | None = None  # None: the judge model's
    max_total_tokens: int | None = 8192
    startup_timeout: float = 300.0
    max_restarts: int = 3  # a judge server that dies is restarted, this often per window
    restart_window_s: float = 600.0


@dataclass
class RewardCombineConfig:
    """The trained reward as a weighted sum of the rule's score (``reward.fn``'s) and the
    reward model's (normalised), e.g. ``reward.combine.rule=1 reward.combine.model=0.5``;
    both 0 (the default): ``reward.fn``'s alone."""

    rule: float = 0.0
    model: float = 0.0


@dataclass
class RewardConfig:
    """The reward executor (rl/reward): the reward function and its worker processes.

    One function scores training rollouts and evaluation alike."""

    # A built-in (exact | math_verify | gsm8k | env: the episode environment's reward |
    # judge: the LLM judge below), a dotted path ``pkg.module:fn`` or a file
    # ``path/to/rewards.py:fn``; fn(prompt, response, label, metadata) -> float | dict.
    # model: the reward model's score (``reward_model=``) alone; the held-out evaluation
    # and the logged accuracy then use ``eval_fn``.
    fn: str = "exact"
    eval_fn: str = "exact"  # the rule that scores evaluation when fn=model
    combine: RewardCombineConfig = field(default_factory=RewardCombineConfig)
    workers: int = 1
    timeout_s: float = 5.0  # per item; an overrun scores 0 and is counted
    # A score request unanswered by its deadline (its items' timeouts, ``workers`` at a
    # time, plus this margin for the requests queued before it) is sent again once, then
    # scored 0 as failed; both counted (reward_resent, reward_lost).
    reply_margin_s: float = 60.0
    pass_threshold: float = 1.0  # a response passes (pass@k) when its score reaches this
    judge: JudgeConfig = field(default_factory=JudgeConfig)


@dataclass
class EnvConfig:
    """Multi-turn episodes (rl/envs): off unless ``tools`` or ``cls`` is set. Each turn the
    policy generates until its end token; the environment then runs the tools it called
    and answers, or ends the episode. A trajectory's tokens (every turn and every
    observation) count against rollout.sampling.max_new_tokens."""

    # Built-ins (calculator | python) or a user's tool by path, ``pkg.module:obj`` or
    # ``path/to/tools.py:obj`` (a Tool, or a function with type hints and a docstring).
    tools: list[str] = field(default_factory=list)
    # null: the built-in environment (runs the called tools; a turn without a call is the
    # final answer); or a user's class by path, built as ``cls(tools, tool_format)``.
    cls: str | None = None
    tool_format: str = "qwen"  # how calls are written: qwen (<tool_call>{json}) | llama3
    # A shipped template (chatml_tools) or a Jinja file for prompts with tools; null: the
    # tokenizer's own, which must render tools.
    chat_template: str | None = None
    max_turns: int = 4  # assistant turns per episode; the last one is scored as it is
    tool_timeout_s: float = 10.0  # wall clock per tool call; an overrun is an observation
    # Every tool's observation text, errors included, is cut to this (the cut said in it).
    max_observation_chars: int = 4000
    sandbox_memory_mb: int = 512  # the python tool's address space
    workers: int = 4  # threads answering turns (running tools) on the controller


@dataclass
class RLConfig:
    """The RL stage driven by the single controller (rl/train.py)."""

    # RL steps (batches), algorithm.epochs*minibatches optimizer steps each; 0: warm-up only
    # (no generator, no reward ranks).
    steps: int = 0
    # async: the generator samples the next batches (up to algorithm.max_policy_lag policy
    # versions ahead) while the trainer trains; sync: generate -> score -> train -> push
    # weights, in sequence (the DeepSpeed-Chat-like baseline), with the same code.
    mode: str = "async"
    prompts_per_step: int = 16  # x algorithm.group_size samples = the trainer's batch
    eval_every: int = 25  # held-out greedy accuracy from the generator; 0: start and end
    # pass@k and mean@k over eval_k samples per eval prompt at the rollout temperature
    # (1: greedy pass@1 only).
    eval_k: int = 1
    save_hf: bool = False  # also export each RL checkpoint as an HF directory
    # Every step's batch as the trainer got it (tokens, masks, rewards, a critic's values)
    # to <run.output_dir>/batches/step_NNNNNN.pt: torch.load(path) gives a dict of tensors.
    save_batches: bool = False
    log_every: int = 1
    save_interval: int = 0  # RL checkpoints every N steps (0: at the end only)
    # auto: a run dir holding a resume point (rl_state.json: the last RL checkpoint, its
    # rollout state and prompt-stream position) continues from it, as a SLURM requeue does;
    # never: start fresh, refusing a run dir that holds one rather than overwrite it.
    resume: str = "auto"
    # A reply from another executor that takes longer than this is an error (seconds).
    channel_timeout: float = 1800.0
    # Each time the loop makes no progress for this long, one line says what it waits for
    # (seconds; 0: never).
    stall_warn_s: float = 300.0
    # Runs, and killed-and-resumed runs, that repeat bit for bit: batches and versions set
    # by the step number (rl/controller/lockstep.py), seeded samples (rollout.sampling.seed,
    # else trainer.seed) and batch-invariant servers. Costs step time: docs/benchmarks.md.
    deterministic: bool = False


@dataclass
class RolesConfig:
    """Ranks per executor besides the controller (1) and the trainer (tp*pp*dp)."""

    generator: int = 1  # ranks that own SGLang servers; rollout.servers is split among them
    reward: int = 1  # ranks that run a reward worker pool


@dataclass
class ResponseLengthConfig:
    """The response lengths the step-time simulator (``python -m rl.simulate``) samples:
    lognormal, truncated at ``rollout.sampling.max_new_tokens``; relative to that cap so
    one setting serves every preset."""

    median_frac: float = 0.25  # median response / max_new_tokens
    sigma: float = 0.8  # standard deviation of log(length)
    prompt_frac: float = 0.5  # prompt tokens / (context_length - max_new_tokens)


@dataclass
class HardwareConfig:
    """One GPU's public specs and the efficiency factors the step-time simulator assumes
    (``python -m rl.simulate``; rl/simulate/hardware.py keeps each value's source). The
    defaults: an H100 SXM node."""

    name: str = "h100_sxm"
    bf16_tflops: float = 989.0  # dense
    fp8_tflops: float = 1979.0  # dense
    hbm_gbps: float = 3350.0  # GB/s
    nvlink_gbps: float = 450.0  # GB/s per direction (inter-node: interconnect_gbps)
    pcie_gbps: float = 64.0  # GB/s per direction, host <-> GPU
    train_mfu: float = 0.40  # trainer FLOP/s / peak
    prefill_mfu: float = 0.50
    decode_efficiency: float = 0.60  # HBM bandwidth a decode step reaches / peak
    network_efficiency: float = 0.80  # NIC goodput / line rate (DDMA)
    collective_latency_us: float = 15.0  # one small TP all-reduce inside a node
    hop_latency_us: float = 30.0  # one pipeline-stage send between nodes
    # Per layer and decode step of a decoder without CUDA graphs (the trainer's engine in
    # the synchronous baseline): eager kernel launches. SGLang replays CUDA graphs.
    eager_layer_us: float = 75.0
    reward_s_per_sample: float = 0.01  # one reward worker (a CPU process)
    step_overhead_s: float = 0.5  # controller per step: batch assembly, logging
    # What the synchronous baseline's co-located trainer moves off its GPUs while they
    # generate: none | optimizer | optimizer_grads (rl/simulate/colocated.py).
    baseline_offload: str = "none"
    responses: ResponseLengthConfig = field(default_factory=ResponseLengthConfig)


@dataclass
class ClusterConfig:
    """Where the job runs and how its ranks are split between executors.

    The hardware fields are read by the placement planner (``python -m rl.plan``), which
    puts trainer ranks and SGLang servers on disjoint nodes and refuses a split or a
    memory budget that cannot work; the defaults describe this one CPU machine."""

    name: str = "local"  # local (every rank on this machine) | slurm (multi-node)
    roles: RolesConfig = field(default_factory=RolesConfig)
    nodes: int = 1
    gpus_per_node: int = 0  # 0: CPU only (ranks are processes; no GPU memory to check)
    gpu_memory_gb: float = 80.0  # per GPU; a plan needing more is refused
    cpus_per_node: int | None = None  # null: not checked
    host_memory_gb: float | None = None  # per node (staging=host copies); null: not checked
    # Nodes for the trainer (tp*pp*dp GPUs), for the SGLang servers (servers*rollout.tp
    # GPUs) and for the model executors (a critic, a reward model, a teacher: each its
    # tp*pp*dp GPUs); they must add up to nodes. All 0: every executor shares every node.
    train_nodes: int = 0
    generation_nodes: int = 0
    model_nodes: int = 0
    # Network bandwidth per GPU (its NIC), for the planner's DDMA time estimate.
    interconnect_gbps: float = 400.0
    # What the step-time simulator assumes of each GPU (python -m rl.simulate).
    hardware: HardwareConfig = field(default_factory=HardwareConfig)


@dataclass
class RunConfig:
    name: str = "run"
    output_dir: str = "outputs/${run.name}"


class WandbMode(StrEnum):
    """An enum, not a plain str, so Hydra refuses any other value at composition (one line
    naming ``logging.wandb_mode`` and the value), before a process starts. A ``str`` too:
    ``mode == "offline"`` holds, and ``str(mode)`` is what ``wandb.init(mode=...)`` takes."""

    offline = "offline"  # no network: the run stays under <run.output_dir>/wandb (wandb sync)
    online = "online"
    disabled = "disabled"  # wandb.init returns a no-op run


@dataclass
class LoggingConfig:
    """Where the controller's metrics go besides the progress lines, metrics.jsonl and
    TensorBoard (rl/metrics.py): Weights & Biases, off by default."""

    wandb: bool = False
    wandb_project: str = "megatron-sglang-rl"
    wandb_mode: WandbMode = WandbMode.offline
    wandb_entity: str | None = None  # null: the API key's default entity


@dataclass
class RootConfig:
    model: ModelConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    run: RunConfig = field(default_factory=RunConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


_REGISTERED = False


def register() -> None:
    """Register the schemas once; YAML files extend them by name in their defaults lists.
    The choices of ``task``, ``algorithm/objective`` and ``algorithm/correction`` are each
    registered by the layer that owns them (rl/compose.py registers them all)."""
    global _REGISTERED
    if _REGISTERED:
        return
    cs = ConfigStore.instance()
    cs.store(name="root_schema", node=RootConfig)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="trainer", name="trainer_schema", node=TrainerConfig)
    cs.store(group="rollout", name="rollout_schema", node=RolloutConfig)
    cs.store(group="algorithm", name="algorithm_schema", node=AlgorithmConfig)
    cs.store(group="cluster", name="cluster_schema", node=ClusterConfig)
    cs.store(group="critic", name="critic_schema", node=CriticConfig)
    cs.store(group="reward_model", name="reward_model_schema", node=RewardModelConfig)
    cs.store(group="teacher", name="teacher_schema", node=TeacherConfig)
    _REGISTERED = True
