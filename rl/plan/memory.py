"""Per-GPU memory of trainer and generator GPUs, from shapes and layouts alone.

Why: a layout that does not fit is found out at step 1 on a few hundred GPUs, after the
queue wait and minutes of start-up. These estimates are deliberately simple, each term a
formula over the config (below), so a reader can check them by hand; they model what this
project's trainer actually builds (rl/models/megatron_gpt.py, rl/engine/trainer.py).

Trainer GPU of pipeline stage p (P = its parameters, on this TP rank):

* weights ``P * w`` (w = 2 for bf16, 4 for fp32 ``trainer.params_dtype``);
* grads ``P * 4``: the DDP grad buffer is fp32 (``grad_reduce_in_fp32=True``);
* Adam ``P * (8 + 4 if bf16) / dp``: fp32 m and v, plus fp32 main weights when training
  in bf16, sharded over DP by the distributed optimizer (``/1`` without it); the routed
  experts' share over ``dp / ep`` only, the replicas of each expert (EP sits inside DP);
* activations ``b * s / cp * layers_per_stage * min(pp - p, microbatches) * a`` with b
  the micro-batch, s the sequence (``rollout.context_length``, else the model's
  maximum), cp the ranks of context parallelism sharing it, and 1F1B keeping ``pp -
  p`` micro-batches in flight on stage p. Per token and layer, ``a = w * (4h + (2q +
  2kv + 3f) / tp)`` bytes: without sequence parallelism
  (``trainer.sequence_parallel``) the two norm inputs and the two column-parallel
  inputs (4h) are replicated across TP, with it they are split too; the q/k/v tensors
  and the attention output kept by fused (flash) attention (2q + 2kv; under context
  parallelism the whole sequence's gathered keys and values, 2kv * cp per local token)
  and SwiGLU's gate, up and output (3f) are split. No s^2 term: Transformer Engine's
  fused attention keeps no score matrix. An MoE layer (rl/models/megatron_gpt.py)
  differs in three ways: f is what one token goes through (top-k experts plus the
  shared expert); the routed experts keep their input, on average (even routing) k
  copies of each token the all-to-all brings them (``k * h``, whole: with TP the
  dispatcher gathers the sequence, as the experts are split over TP too); and with TP
  > 1 sequence parallelism is on (Megatron-Core requires it for MoE), which splits the
  4h too: ``a = w * (k * h + (4h + 2q + 2kv + 3f) / tp)``. With
  ``trainer.recompute=full`` a layer keeps only its input, ``w * h`` (``/ tp`` under
  sequence parallelism), in place of ``a``, and the backward brings one layer's ``a``
  back at a time: ``tokens * a`` once per stage;
* with LoRA (``trainer.lora.rank``) the adapters' parameters A join the weights, and the
  grads and Adam hold A alone (the base is frozen); a push merges one targeted shard at a
  time into a temporary (the largest, ``w`` bytes an element), counted with the buffers;
* logits (last stage) ``b * s / cp * vocab / tp * (w + 8)``: the logits plus the fp32 copy and
  softmax the vocab-parallel cross-entropy keeps;
* a frozen reference copy ``P * w`` when ``algorithm.kl_coef > 0``; two DDMA buckets;
  and a fixed 4 GiB for the CUDA context, NCCL buffers and allocator fragmentation.

A model executor's GPU (a critic, a reward model, a teacher: rl/companion) is a trainer
GPU of its own model and layout (``<role>.trainer``), without DDMA buckets or a
reference: a trained one (the critic) as above; a frozen one (a reward model, a teacher)
holds its weights, no grads and no Adam, and a forward without grad keeps one layer's
activations at a time, ``tokens * a`` (``tokens``: its micro-batch, or its
``max_tokens_per_microbatch``), plus its head's output: the LM head's logits as above,
nothing for a scalar head.

Generator GPU (one SGLang TP rank): its weight shards in ``rollout.dtype`` (linear weights
1 byte plus a float32 scale per 128x128 block with ``weight_sync.fp8_block``), the DDMA
receiver's staging of an incoming version (``weight_sync.staging``: ``device`` a second
copy of those shards on the GPU, ``host`` the copy in the node's host memory instead,
``none`` nothing), SGLang's own reserve for activations and CUDA graphs, and the KV cache
in what is left: ``2 * layers * kv_heads_per_rank * head_dim * w`` bytes per token.
GB in this package means GiB (2**30 bytes), as ``nvidia-smi`` reports. Pure logic.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, replace
from typing import TYPE_CHECKING, cast

from omegaconf import DictConfig, OmegaConf

from rl.config import dtypes
from rl.models.arch import Dims, has_score_head
from rl.models.registry import expert_count
from rl.models.shapes import (
    LORA_SHAPES,
    kv_channels,
    layer_param_count,
    lora_layer_params,
    padded_vocab_size,
    sequence_parallel,
    tower_param_count,
)

if TYPE_CHECKING:
    from rl.config.schema import ModelConfig, RootConfig, TrainerConfig

GIB = 1 << 30
MIB = 1 << 20
GRAD_BYTES = 4  # rl/engine/trainer.py: DistributedDataParallelConfig(grad_reduce_in_fp32=True)
TRAINER_OVERHEAD = 4 * GIB  # CUDA context, NCCL communicators, allocator fragmentation
# SGLang 0.5's static-memory heuristic (sglang/srt/arg_groups/memory_hook.py) on an 80 GB
# GPU: 512 MiB + 1.5 MiB per chunked-prefill token (8192) + tp/8 GiB + 2 MiB per CUDA-graph
# batch (256 below tp 4, else 512), and at least 10 GiB on GPUs over 60 GiB.
SGLANG_PREFILL_TOKENS = 8192


@dataclass(frozen=True)
class TrainerGPU:
    """Bytes one trainer GPU of pipeline stage ``stage`` needs."""

    stage: int
    params: int
    weights: int
    grads: int
    _: KW_ONLY
    optimizer: int
    activations: int
    logits: int
    reference: int
    buffers: int
    overhead: int

    @property
    def static(self) -> int:
        return self.weights + self.grads + self.optimizer + self.reference

    @property
    def total(self) -> int:
        return self.static + self.activations + self.logits + self.buffers + self.overhead


@dataclass(frozen=True)
class GeneratorGPU:
    """Bytes one SGLang TP rank needs, and the KV cache the rest holds."""

    weights: int
    reserved: int
    kv_bytes_per_token: int
    kv_tokens: int  # the KV pool: rollout.max_total_tokens, or what the free memory holds
    _: KW_ONLY
    kv_capacity: int | None  # tokens the free memory could hold (None on CPU: not checked)
    staging: str = "device"  # rollout.weight_sync.staging
    staged: int = 0  # on the GPU: the device copy of the weights (staging=device)
    host_staged: int = 0  # in the node's host memory for this GPU (staging=host)
    tower: int = 0  # a vision-language model's tower: held as loaded, never synced

    @property
    def total(self) -> int:
        kv = self.kv_tokens * self.kv_bytes_per_token
        return self.weights + self.tower + self.staged + self.reserved + kv


def sequence_length(cfg: RootConfig) -> int:
    """Tokens per sample the trainer and servers are sized for (prompt + response)."""
    return cfg.rollout.context_length or cfg.model.max_position_embeddings


def stage_params(m: ModelConfig, tp: int, pp: int, stage: int, ep: int = 1) -> int:
    """Parameters on one TP rank of pipeline stage ``stage`` (Megatron's padded vocab),
    with the routed experts split over ``ep`` ranks."""
    h = m.hidden_size
    n = (m.num_layers // pp) * layer_param_count(m, tp, ep)
    vocab = padded_vocab_size(m) * h // tp
    if stage == 0:  # and a vision tower, whole on every TP rank of the first stage
        n += vocab + tower_param_count(m)
    if stage == pp - 1:
        n += h  # final norm
        if has_score_head(m.architecture):  # a scalar head: [1, h], on every TP rank
            n += h
        elif not m.tie_embeddings or pp > 1:  # tied: the last stage keeps its own copy
            n += vocab
    return n


def stage_expert_params(m: ModelConfig, tp: int, pp: int, ep: int = 1) -> int:
    """The routed experts' share of :func:`stage_params` (their optimizer state is sharded
    over the dp / ep replicas of each expert, not over dp)."""
    return (m.num_layers // pp) * (expert_count(Dims.of(m)) // (tp * ep))


def activation_bytes_per_token_layer(
    m: ModelConfig, tp: int, itemsize: int, sp: bool = False, cp: int = 1
) -> int:
    """``w * (4h + (2q + 2kv * cp + 3f) / tp)``: see the module docstring; with sequence
    parallelism (``sp``) the 4h is split too. For an MoE layer f is what one token goes
    through (top-k experts plus the shared expert), and the routed experts keep their k
    copies of the token (``k * h``, not split). Under context parallelism a rank's token
    also keeps its share of the whole sequence's all-gathered keys and values (``cp``
    times its own)."""
    h, q = m.hidden_size, m.num_attention_heads * kv_channels(m)
    kv = m.num_query_groups * kv_channels(m)
    replicated = 0 if sp else 4 * h
    split = 2 * q + 2 * kv * cp + (4 * h if sp else 0)
    if not m.num_experts:
        return itemsize * (replicated + (split + 3 * m.ffn_hidden_size) // tp)
    k, d = m.moe_router_topk, Dims.of(m)  # Dims: the expert widths as ints
    f = k * d.moe_ffn + d.shared_ffn
    return itemsize * (k * h + replicated + (split + 3 * f) // tp)


def activation_bytes(cfg: RootConfig, stage: int) -> int:
    """Stage ``stage``'s activations: ``tokens * layers * in_flight * a`` (see the module
    docstring); with ``trainer.recompute=full`` each layer keeps its input alone
    (``w * h``, over TP with sequence parallelism) and one layer's whole ``a`` is back
    while the backward recomputes it."""
    m, t = cfg.model, cfg.trainer
    w = dtypes.itemsize(t.params_dtype)
    sp = sequence_parallel(m, t.tp, t.sequence_parallel)
    tokens = rank_tokens(cfg)
    kept = tokens * (m.num_layers // t.pp) * min(t.pp - stage, microbatches(cfg))
    a = activation_bytes_per_token_layer(m, t.tp, w, sp, t.cp)
    if t.recompute == "none":
        return kept * a
    return kept * w * m.hidden_size // (t.tp if sp else 1) + tokens * a


def rank_tokens(cfg: RootConfig) -> int:
    """The tokens of one micro-batch a trainer rank holds: ``micro_batch_size`` rows of the
    sequence, split over the ``trainer.cp`` ranks of context parallelism."""
    t = cfg.trainer
    return -(-t.micro_batch_size * sequence_length(cfg) // t.cp)


def microbatches(cfg: RootConfig) -> int:
    """Micro-batches per optimizer step per DP rank: the larger of the warm-up batch and
    the RL minibatch."""
    t, a = cfg.trainer, cfg.algorithm
    rows = t.global_batch_size
    if cfg.rl.steps > 0:
        rows = max(rows, cfg.rl.prompts_per_step * a.group_size // a.minibatches)
    return max(1, rows // (t.micro_batch_size * t.dp))


def trainer_gpu(cfg: RootConfig, stage: int, dp: int | None = None) -> TrainerGPU:
    """``dp``: data-parallel replicas instead of ``trainer.dp`` (the simulator's co-located
    baseline runs the trainer's TP x PP on every GPU of the cluster)."""
    m, t = cfg.model, cfg.trainer
    dp = dp or t.dp
    w = dtypes.itemsize(t.params_dtype)
    p = stage_params(m, t.tp, t.pp, stage, t.ep)
    experts = stage_expert_params(m, t.tp, t.pp, t.ep)
    # LoRA: the adapters are all that trains, so all that has gradients and Adam state;
    # a DDMA push merges one targeted shard at a time (the largest: fc1's, or qkv's).
    lora = t.lora.rank and lora_layer_params(m, t.lora.rank, list(t.lora.targets), t.tp)
    adapters = (m.num_layers // t.pp) * lora if lora else 0
    # A frozen vision tower has weights only.
    frozen = tower_param_count(m) if stage == 0 and not m.train_vision else 0
    trained, trained_experts = (adapters, 0) if lora else (p - frozen, experts)
    adam = 8 + (4 if w != 4 else 0)
    shards = dp if t.use_distributed_optimizer else 1
    expert_shards = max(1, shards // t.ep)
    tokens = rank_tokens(cfg)
    acts = activation_bytes(cfg, stage)
    logits = tokens * (padded_vocab_size(m) // t.tp) * (w + 8) if stage == t.pp - 1 else 0
    syncing = cfg.rl.steps > 0
    merged = max(_merged_shards(m, t)) if adapters else 0
    return TrainerGPU(
        stage=stage,
        params=p + adapters,
        weights=(p + adapters) * w,
        grads=trained * GRAD_BYTES,
        optimizer=-(-(trained - trained_experts) * adam // shards)
        + -(-trained_experts * adam // expert_shards),
        activations=acts,
        logits=logits,
        reference=p * w if cfg.algorithm.kl_coef > 0 else 0,
        buffers=(2 * cfg.rollout.weight_sync.bucket_mb * MIB + merged * w) if syncing else 0,
        overhead=TRAINER_OVERHEAD if t.device == "cuda" else 0,
    )


def model_gpu(
    cfg: RootConfig, m: ModelConfig | DictConfig, t: TrainerConfig, stage: int, *,
    trained: bool, score: bool,
) -> TrainerGPU:  # fmt: skip
    """A model executor's GPU of pipeline stage ``stage``: model ``m`` on layout ``t``,
    trained (a critic) or frozen, with a scalar head (``score``) or an LM head."""
    # Resolved first: the role's fields may name the policy's (``${trainer.tp}``).
    layout = {"model": _resolved(m), "trainer": _resolved(t), "algorithm": {"kl_coef": 0.0}}
    own = cast("RootConfig", OmegaConf.merge(cfg, layout))
    g = replace(trainer_gpu(own, stage), buffers=0)
    if score:
        g = replace(g, logits=0)
    if trained:
        return g
    mm, w = own.model, dtypes.itemsize(t.params_dtype)
    tokens = -(-(t.max_tokens_per_microbatch or t.micro_batch_size * sequence_length(own))
               // t.cp)  # fmt: skip
    a = activation_bytes_per_token_layer(
        mm, t.tp, w, sequence_parallel(mm, t.tp, t.sequence_parallel), t.cp
    )
    last = stage == t.pp - 1 and not score
    logits = tokens * (padded_vocab_size(mm) // t.tp) * (w + 8) if last else 0
    return replace(g, grads=0, optimizer=0, activations=tokens * a, logits=logits)


def _resolved(node: object) -> object:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def _merged_shards(m: ModelConfig, t: TrainerConfig) -> list[int]:
    """Elements of each targeted weight's shard on one TP rank (what a LoRA push merges)."""
    kv_ch = kv_channels(m)
    q, kv = m.num_attention_heads * kv_ch, m.num_query_groups * kv_ch
    shapes = [LORA_SHAPES[x](m.hidden_size, q, kv, m.ffn_hidden_size) for x in t.lora.targets]
    return [n_in * n_out // t.tp for n_in, n_out, _ in shapes]


def sglang_reserved(gpu_bytes: int, tp: int) -> int:
    """SGLang's reserve for activations and CUDA graphs (its default mem_fraction_static)."""
    graph_bs = 256 if tp < 4 else 512
    mib = 512 + 1.5 * SGLANG_PREFILL_TOKENS + 1024 * tp / 8 + 2 * graph_bs
    reserve = int(mib * MIB)
    return max(reserve, 10 * GIB) if gpu_bytes > 60 * GIB else reserve


def kv_bytes_per_token(m: ModelConfig, tp: int, itemsize: int) -> int:
    """K and V of every layer for one token on one TP rank (KV heads replicated when
    tp > num_query_groups, as SGLang does)."""
    heads = max(1, m.num_query_groups // tp)
    return 2 * m.num_layers * heads * kv_channels(m) * itemsize


def generator_gpu(
    cfg: RootConfig, weight_bytes: int, gpu_bytes: int | None, staging: str | None = None
) -> GeneratorGPU:
    """``weight_bytes``: one TP rank's weights (from the DDMA plan's destination shapes);
    ``gpu_bytes``: the GPU's memory (None on CPU, where nothing is sized from it);
    ``staging``: instead of ``rollout.weight_sync.staging``. A vision-language model's
    tower is held too (split over the server's TP ranks), never staged: DDMA does not send
    it."""
    r = cfg.rollout
    per_token = kv_bytes_per_token(cfg.model, r.tp, dtypes.itemsize(r.dtype))
    staging = staging or r.weight_sync.staging
    # The receiver stages exactly the tensors it writes: the rank's whole weight shard.
    device, host = (weight_bytes if staging == s else 0 for s in ("device", "host"))
    tower = tower_param_count(cfg.model) * dtypes.itemsize(r.dtype) // r.tp
    if gpu_bytes is None:
        pool = r.max_total_tokens or 0
        return GeneratorGPU(
            weight_bytes,
            0,
            per_token,
            pool,
            kv_capacity=None,
            staging=staging,
            staged=device,
            host_staged=host,
            tower=tower,
        )
    reserved = sglang_reserved(gpu_bytes, r.tp)
    capacity = max(0, (gpu_bytes - reserved - weight_bytes - tower - device) // per_token)
    pool = r.max_total_tokens if r.max_total_tokens is not None else capacity
    return GeneratorGPU(
        weight_bytes,
        reserved,
        per_token,
        pool,
        kv_capacity=capacity,
        staging=staging,
        staged=device,
        host_staged=host,
        tower=tower,
    )
