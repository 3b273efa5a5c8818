"""Seconds of each phase of one RL step at cluster scale, from specs and the plan.

Generation (per decoding replica: ``tp`` GPUs per stage, ``pp`` stages run in turn):

* a decode step reads every weight once and each active sample's KV cache, over HBM at
  ``decode_efficiency`` of its bandwidth, spread over the TP ranks (pipeline stages run
  one after another, so their reads add up); or, for a large batch, the 2·N·batch
  FLOPs at ``prefill_mfu`` on the TP ranks of one stage, whichever is slower; plus two
  TP all-reduces per layer (``collective_latency_us``) and a send per stage boundary
  (``hop_latency_us``);
* prefill is compute-bound: 2·N FLOPs per prompt token;
* synchronous, the step waits for the longest of all its samples: the active batch
  shrinks along the length distribution's survival function while the replica still
  pays a whole decode step per token;
* asynchronous, finished slots are refilled from the next batch (the tail overlaps the
  next batch), so a server is bound by the mean length at a full batch.

The synchronous baseline (DeepSpeed-Chat-like) has trainer and generator share every GPU
of the cluster with the trainer's TP x PP layout; its memory, KV cache, waves and
offload traffic are rl/simulate/colocated.py's.

Training: 6·N_active·tokens per pass over the batch (``algorithm.epochs`` passes), +2 for
a reference model's forward and +2 for pi_old's when a batch takes several updates, over
the trainer's GPUs at ``train_mfu``, stretched by the 1F1B pipeline bubble (pp - 1) /
micro-batches of one update.

The model executors (async; rl/companion): each is 2·N per token of the step's batch for a
forward, 6·N per pass for a trained one's step, over its own GPUs at ``train_mfu``, N
its active parameters with its head (the vocabulary's rows, or one for a scalar head). A
teacher's log-probs and a critic's values come before the policy's step; the critic's
step runs beside the policy's (the longer of the two counts); a reward model scores each
group as it is generated, so only the last group's scoring waits, as the rule's does.

Weight sync (async): the DDMA plan's busiest sender or receiver (rl.plan.transfer) at the
NIC's line rate times ``network_efficiency``. Reward: ``reward_s_per_sample`` on every
reward worker; synchronous it follows generation, asynchronous only the last group does.
Pure logic.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING

from rl.config import dtypes
from rl.models.arch import Dims
from rl.models.registry import active_count
from rl.models.shapes import padded_vocab_size
from rl.plan.memory import kv_bytes_per_token, stage_params
from rl.simulate.colocated import SharedLayout, shared_layout
from rl.simulate.lengths import Lengths
from rl.simulate.step import Phases

if TYPE_CHECKING:
    from rl.config.schema import HardwareConfig, RootConfig
    from rl.plan.cluster import ClusterPlan


@dataclass(frozen=True)
class Engine:
    """A decoding replica: the whole model on ``tp`` x ``pp`` GPUs."""

    tp: int
    pp: int
    layers: int
    weights_per_rank: float  # bytes one TP rank reads per decode step (all its stages)
    _: KW_ONLY
    kv_per_token: float  # KV bytes of one token on one TP rank (all layers)
    flops_per_token: float  # 2 * active parameters
    peak_flops: float  # per GPU, in the engine's dtype
    eager: bool = False  # no CUDA graphs: kernel launches per layer and step


def decode_step_s(e: Engine, hw: HardwareConfig, batch: float, context: float) -> float:
    """One decode step of ``batch`` samples of ``context`` tokens each. Through a pipeline
    the stages run in turn: their weight reads add up to the whole TP rank's, and each
    stage boundary costs a send. (Micro-batching the step keeps every stage busy but
    reads each stage's weights once per micro-batch, so it takes no less.)"""
    memory = (e.weights_per_rank + batch * context * e.kv_per_token) / (
        hw.hbm_gbps * 1e9 * hw.decode_efficiency
    )
    compute = e.flops_per_token * batch / (e.tp * e.peak_flops * hw.prefill_mfu)
    per_layer = (2 * hw.collective_latency_us if e.tp > 1 else 0) + (
        hw.eager_layer_us if e.eager else 0
    )
    latency = e.layers * per_layer + (e.pp - 1) * hw.hop_latency_us
    return max(memory, compute) + latency * 1e-6


def prefill_s(e: Engine, hw: HardwareConfig, tokens: float) -> float:
    return e.flops_per_token * tokens / (e.tp * e.peak_flops * hw.prefill_mfu)


def straggler_s(e: Engine, hw: HardwareConfig, n: float, prompt: float, lengths: Lengths,
                longest: float) -> float:  # fmt: skip
    """``n`` samples decoded together until the longest (``longest`` tokens) ends."""
    steps = sum(
        w * decode_step_s(e, hw, max(n * lengths.survival(t), 1.0), prompt + t)
        for t, w in lengths.grid(longest)
    )
    return prefill_s(e, hw, n * prompt) + steps


def streaming_s(e: Engine, hw: HardwareConfig, n: float, slots: float, prompt: float,
                lengths: Lengths) -> float:  # fmt: skip
    """``n`` samples through ``slots`` concurrent slots, refilled as samples finish."""
    mean = lengths.mean()
    c = max(1.0, min(n, slots))
    return prefill_s(e, hw, n * prompt) + n * mean / c * decode_step_s(e, hw, c, prompt + mean / 2)


def tflops(hw: HardwareConfig, fp8: bool) -> float:
    return (hw.fp8_tflops if fp8 else hw.bf16_tflops) * 1e12


@dataclass(frozen=True)
class Workload:
    samples: int
    prompt: float  # tokens per prompt
    lengths: Lengths
    active_params: float

    @classmethod
    def of(cls, cfg: RootConfig) -> Workload:
        r, a, resp = cfg.rollout, cfg.algorithm, cfg.cluster.hardware.responses
        cap = r.sampling.max_new_tokens
        budget = (r.context_length or cfg.model.max_position_embeddings) - cap
        m = cfg.model
        active = m.num_layers * active_count(Dims.of(m), m.moe_router_topk or 1)
        return cls(
            samples=cfg.rl.prompts_per_step * a.group_size,
            prompt=resp.prompt_frac * max(budget, 0),
            lengths=Lengths.relative(cap, resp.median_frac, resp.sigma),
            active_params=active + padded_vocab_size(m) * m.hidden_size,
        )

    @property
    def tokens(self) -> float:
        return self.samples * (self.prompt + self.lengths.mean())


def train_s(cfg: RootConfig, w: Workload, gpus: int, dp: int) -> float:
    t, hw = cfg.trainer, cfg.cluster.hardware
    a = cfg.algorithm
    # 6 per token per pass over the batch (forward and backward; 2 more when the backward
    # recomputes each layer's forward), 2 per forward-only scoring: the KL reference's
    # and, with several updates, pi_old's.
    train = 6 + 2 * (t.recompute == "full")
    passes = train * a.epochs + 2 * (a.kl_coef > 0) + 2 * (a.epochs * a.minibatches > 1)
    micro = max(1, w.samples // (a.minibatches * dp * t.micro_batch_size))
    bubble = 1 + (t.pp - 1) / micro
    return passes * w.active_params * w.tokens / (gpus * tflops(hw, False) * hw.train_mfu) * bubble


def model_s(cfg: RootConfig, role: str, tokens: float) -> tuple[float, float]:
    """(forward, training step) seconds of the model executor ``role`` over ``tokens``
    (its step 0 for a frozen one)."""
    from rl.companion import TRAINED, model_of
    from rl.models.arch import has_score_head

    section, hw = getattr(cfg, role), cfg.cluster.hardware
    t, m = section.trainer, model_of(cfg, role)
    head = 1 if has_score_head(str(m.architecture)) else padded_vocab_size(m)  # output rows
    n = m.num_layers * active_count(Dims.of(m), m.moe_router_topk or 1) + head * m.hidden_size
    rate = t.tp * t.cp * t.pp * t.dp * tflops(hw, False) * hw.train_mfu
    forward = 2 * n * tokens / rate
    if role not in TRAINED:
        return forward, 0.0
    passes = (6 + 2 * (t.recompute == "full")) * section.epochs
    return forward, passes * n * tokens / rate


def reward_s(cfg: RootConfig, samples: int) -> float:
    workers = max(1, cfg.cluster.roles.reward * cfg.reward.workers)
    return math.ceil(samples / workers) * cfg.cluster.hardware.reward_s_per_sample


def server_engine(cfg: RootConfig, plan: ClusterPlan, w: Workload) -> Engine:
    """One SGLang server of the plan: its TP rank's weights as the engine holds them."""
    r, hw = cfg.rollout, cfg.cluster.hardware
    assert plan.generator is not None and plan.transfer is not None
    return Engine(
        r.tp,
        1,
        cfg.model.num_layers,
        plan.transfer.server_weight_bytes,
        kv_per_token=plan.generator.kv_bytes_per_token,
        flops_per_token=2 * w.active_params,
        peak_flops=tflops(hw, bool(r.weight_sync.fp8_block)),
    )


def server_slots(cfg: RootConfig, plan: ClusterPlan, w: Workload) -> float:
    """Samples a server decodes at once: its share of the step, within its KV cache."""
    assert plan.generator is not None
    fits = plan.generator.kv_tokens / (w.prompt + w.lengths.mean())
    return max(1.0, min(w.samples / cfg.rollout.servers, fits))


def async_phases(cfg: RootConfig, plan: ClusterPlan, w: Workload) -> Phases:
    """LlamaRL: trainer and SGLang servers on their own GPUs, DDMA between them."""
    hw, t = cfg.cluster.hardware, cfg.trainer
    assert plan.transfer is not None
    e = server_engine(cfg, plan, w)
    per_server = w.samples / cfg.rollout.servers
    sent = max(plan.transfer.per_trainer_rank.values(), default=0)
    received = max(plan.transfer.per_server_gpu.values(), default=0)
    rate = cfg.cluster.interconnect_gbps * 1e9 / 8 * hw.network_efficiency
    train, before, beside, scored = train_s(cfg, w, t.tp * t.cp * t.pp * t.dp, t.dp), 0.0, 0.0, 0.0
    group = w.tokens * cfg.algorithm.group_size / w.samples
    for role in ("critic", "teacher", "reward_model"):
        if getattr(cfg, role).enabled:
            forward, step = model_s(cfg, role, group if role == "reward_model" else w.tokens)
            if role == "reward_model":
                scored = forward
            else:
                before, beside = before + forward, max(beside, step)
    return Phases(
        generate=streaming_s(e, hw, per_server, server_slots(cfg, plan, w), w.prompt, w.lengths),
        # the last group's scoring: the rule's and the reward model's at once
        reward=max(reward_s(cfg, cfg.algorithm.group_size), scored),
        train=before + max(train, beside),
        sync=max(sent, received) / rate,
        overhead=hw.step_overhead_s,
    )


def shared_engine(cfg: RootConfig, w: Workload) -> Engine:
    """The baseline's decoding replica: the trainer's TP x PP, eager (no CUDA graphs)."""
    t, m, hw = cfg.trainer, cfg.model, cfg.cluster.hardware
    itemsize = dtypes.itemsize(t.params_dtype)
    params = sum(stage_params(m, t.tp, t.pp, s, t.ep) for s in range(t.pp))
    return Engine(
        t.tp,
        t.pp,
        m.num_layers,
        params * itemsize,
        kv_per_token=kv_bytes_per_token(m, t.tp, itemsize),
        flops_per_token=2 * w.active_params,
        peak_flops=tflops(hw, False),
        eager=True,
    )


def sync_phases(cfg: RootConfig, w: Workload) -> tuple[Phases, SharedLayout]:
    hw = cfg.cluster.hardware
    lay = shared_layout(cfg, w.prompt, w.lengths.cap, w.samples)
    e = shared_engine(cfg, w)
    # Every replica's wave k ends with the longest of the samples in all of them.
    longest = w.lengths.longest(math.ceil(w.samples / lay.waves))
    wave = lay.samples_per_replica / lay.waves
    gen = lay.waves * straggler_s(e, hw, wave, w.prompt, w.lengths, longest)
    phases = Phases(
        generate=gen,
        reward=reward_s(cfg, w.samples),
        train=train_s(cfg, w, lay.gpus, lay.replicas),
        sync=lay.reload_s,
        overhead=hw.step_overhead_s,
    )
    return phases, lay
