"""The trainer executor: Megatron-Core model, optimizer and schedule for one policy.

A step takes a global batch (every rank receives the same dict of ``[B, S]`` tensors),
keeps this data-parallel rank's rows, cuts them into microbatches (``micro_batch_size`` rows
each, or packed under a token budget, see ``pack_by_tokens``) and runs Megatron's
forward/backward schedule (no pipelining, or 1F1B when PP > 1) with a pluggable loss over
token log-probs. Loss statistics are reduced over DP and shared from the last pipeline
stage, so every rank returns the same numbers.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_patches import cuda_to_cpu
from rl.algorithms.losses import LossFn
from rl.algorithms.reuse import Reuse, combine
from rl.batch import TrainBatch
from rl.config.sampling import BANNED
from rl.engine import checkpoint
from rl.engine.checkpoint import TrainState
from rl.engine.packing import Pack, build_pack, plan_packs, stream_length
from rl.models.arch import has_score_head
from rl.models.megatron_gpt import build_gpt
from rl.models.parallel import Layout, init_model_parallel
from rl.models.shapes import padded_vocab_size
from rl.models.vision.inputs import VisionInput, vision_input
from rl.models.vision.tokens import special_ids
from rl.weights.dist_ckpt import hf_fields, read_common

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from rl.config.schema import ModelConfig, TrainerConfig


def pack_by_tokens(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Group row indices into micro-batches of at most ``budget`` tokens each, counting a
    micro-batch as ``rows x its longest row`` (every row is run at that width).

    Rows are taken longest first, so each micro-batch's width is set by its first row and
    rows of similar length share a micro-batch (little padding). A row longer than the
    budget still runs, alone: dropping or cutting it would silently change the loss. Each
    group lists its indices in ascending order; the caller puts per-row outputs back in
    the original order. Rows of length 0 count as 1 (a forward needs one position).
    """
    if budget < 1:
        raise ValueError(f"trainer.max_tokens_per_microbatch={budget} must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    cur: list[int] = []
    width = 0
    for i in order:
        n = max(int(lengths[i]), 1)
        if cur and (len(cur) + 1) * max(width, n) > budget:
            groups.append(sorted(cur))
            cur, width = [], 0
        cur.append(i)
        width = max(width, n)
    if cur:
        groups.append(sorted(cur))
    return groups


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch: its rows (cut to its width) and, when packed, how they pack."""

    batch: TrainBatch
    pack: Pack | None = None


def row_extents(batch: TrainBatch) -> list[int]:
    """How many leading columns of each row the model must see.

    Index t of a per-token tensor scores token t+1, so a row whose last counted index is t
    needs tokens ``[0, t+2)``. Columns past the extent are right padding or unscored tail:
    with causal attention they never change an earlier position's output, so dropping
    them changes no counted log-prob. Without a ``loss_mask`` every row needs all ``S``
    columns.
    """
    rows, seq = batch.rows, batch.seq
    if batch.loss_mask is None:
        return [seq] * rows
    cols = torch.arange(1, seq + 1)
    last = ((batch.loss_mask != 0) * cols).amax(dim=1)  # last scored index + 1
    return torch.where(last > 0, (last + 1).clamp(max=seq), 0).tolist()


class MegatronTrainer:
    def __init__(
        self,
        model_cfg: ModelConfig,
        trainer_cfg: TrainerConfig,
        layout: Layout,
        total_steps: int,
        *,
        frozen: bool = False,
        initialize: bool = True,
    ):
        """``frozen``: forward passes only (a reference policy), no optimizer state.
        ``initialize=False``: the weights are left unset, for a caller that fills them at
        once (a checkpoint load, or a benchmark filling them on the device; then
        ``optimizer.reload_model_params()``): a random init on the host takes minutes at
        billions of parameters."""
        self.mcfg, self.tcfg, self.layout = model_cfg, trainer_cfg, layout
        self.step = 0
        self.carried: dict[str, Any] = {}  # the loaded checkpoint's HF fields (dist_ckpt)
        # LoRA: the checkpoint holding the frozen base, which every save then names
        self.lora_base: str | None = None
        self.token_budget: int | None = getattr(trainer_cfg, "max_tokens_per_microbatch", None)
        self.packing: bool = getattr(trainer_cfg, "packing", False)
        if self.token_budget is not None:
            if self.token_budget < 1:
                raise ValueError(
                    f"trainer.max_tokens_per_microbatch={self.token_budget} must be >= 1"
                )
            # Megatron's 1F1B schedule sends activations between stages with one fixed
            # [seq, micro_batch, hidden] shape for every micro-batch; budgeted
            # micro-batches differ in both rows and width, and padding them all back to one
            # shape would throw away the saving, so refuse rather than pad.
            if layout.pp > 1 and not trainer_cfg.packing:
                raise ValueError(
                    f"trainer.max_tokens_per_microbatch={self.token_budget} needs trainer.pp=1 "
                    f"(got trainer.pp={layout.pp}) or trainer.packing=true: pipeline stages "
                    "exchange one fixed tensor shape per micro-batch"
                )
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        # Log-probs are log softmax(logits / temperature): an RL loss must score tokens
        # with the distribution they were sampled from (SGLang reports it at its T).
        self.temperature = 1.0
        t = trainer_cfg
        # Same seed on every rank: CPU init builds each full weight and splits it.
        torch.manual_seed(t.seed)
        model = build_gpt(
            model_cfg, t, layout.first_stage, layout.last_stage, layout.pg_collection, initialize
        )
        # LoRA: the base frozen, adapters on the targeted linears. A frozen trainer has them
        # too, so it loads an adapted checkpoint (a base one leaves them at B = 0).
        self.adapter_params = 0
        if t.lora.rank:
            from rl.models import lora

            self.adapter_params = lora.apply(model, t.lora, layout.tp, layout.tp_rank, t.seed)
        # Built on the host (use_cpu_initialization: the same seed gives the same weights on
        # every device), then moved where it trains: the rank's current CUDA device on GPU.
        here = torch.cuda.current_device() if t.device == "cuda" else None
        self.device = torch.device("cpu") if here is None else torch.device("cuda", here)
        model = model.to(self.device)
        self.config = model.config
        self._padded_vocab = padded_vocab_size(model_cfg)
        # Tokens the servers never sample (a vision-language model's vision tokens, banned
        # with the same bias): out of the trainer's softmax too.
        v = model_cfg.vision
        self._banned = special_ids(v) if v is not None else ()
        self.score = has_score_head(model_cfg.architecture)  # values, not log-probs
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=t.use_distributed_optimizer,
        )
        with cuda_to_cpu():
            self.model = DistributedDataParallel(
                config=self.config, ddp_config=ddp_config, module=model
            )
        # None: a frozen trainer (the KL reference), which only scores.
        self.optimizer: MegatronOptimizer | None = None
        self.scheduler: OptimizerParamScheduler | None = None
        if not frozen:
            self._build_optimizer(total_steps)
        self.moe = None
        self.replay = None  # an MoE model routes as a batch's ``routing`` says, if it has one
        if model_cfg.num_experts:
            from rl.engine.moe_metrics import MoEMetrics
            from rl.engine.routing_replay import RoutingReplay

            self.moe = MoEMetrics(model, layout, model_cfg.num_layers, model_cfg.num_experts)
            self.replay = RoutingReplay(model, layout, self.config.sequence_parallel)
        self._microbatch_count = 0

    def _build_optimizer(self, total_steps: int) -> None:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        t, o = self.tcfg, self.tcfg.optim
        with cuda_to_cpu():
            self.optimizer = optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam",
                    lr=o.lr,
                    min_lr=o.min_lr,
                    weight_decay=o.weight_decay,
                    adam_beta1=o.adam_beta1,
                    adam_beta2=o.adam_beta2,
                    adam_eps=o.adam_eps,
                    clip_grad=o.clip_grad,
                    bf16=self.config.bf16,
                    params_dtype=self.config.params_dtype,
                    use_distributed_optimizer=t.use_distributed_optimizer,
                ),
                [self.model],
            )
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.grad_scale_func = optimizer.scale_loss
        decay = o.decay_steps if o.decay_steps is not None else max(total_steps, 1)
        self.scheduler = OptimizerParamScheduler(
            optimizer,
            # Warm up from lr/warmup (not 0): the first step should already learn.
            init_lr=o.lr / max(o.warmup_steps, 1),
            max_lr=o.lr,
            min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_steps,
            lr_decay_steps=max(decay, o.warmup_steps + 1),
            lr_decay_style=o.decay_style,
            start_wd=o.weight_decay,
            end_wd=o.weight_decay,
            wd_incr_steps=max(total_steps, 1),
            wd_incr_style="constant",
        )

    # ------------------------------------------------------------------ batching
    def _microbatches(
        self, batch: TrainBatch, trim: bool = True
    ) -> tuple[list[MicroBatch], list[list[int]] | None]:
        """This DP rank's rows cut into micro-batches and, when they are not taken in
        order (a token budget, or packing), each one's row indices within this rank's rows.

        Packed (``trainer.packing``, rl/engine/packing.py), each micro-batch is one stream
        of its rows' extents, ``micro_batch_size`` rows in order or, with a token budget,
        first-fit under it; under pipelining every stream has this step's longest length.
        Padded, a micro-batch is ``micro_batch_size`` rows at full width or, with a token
        budget, rows of similar length trimmed to the longest one's extent. ``trim=False``
        keeps every column (the last column then stays the last position).

        Ranks may end up with different numbers of micro-batches. That is safe: with no
        pipelining Megatron runs no collective per micro-batch (overlap_grad_reduce is off,
        and even with it DDP only reduces on the last micro-batch's backward), the gradient
        all-reduce and the all-reduce of the token count happen once per step in
        finalize_model_grads, and _reduce_stats and _collect make one call per step on
        tensors of fixed shape. TP and CP ranks of one DP rank see the same rows, so the
        same plan; so do the stages of one pipeline.
        """
        rows = batch.rows
        mbs, dp = self.tcfg.micro_batch_size, self.layout.dp
        fixed = self.token_budget is None
        if rows == 0 or rows % (mbs * dp if fixed else dp):
            what = f"trainer.micro_batch_size*dp={mbs}*{dp}" if fixed else f"trainer.dp={dp}"
            raise ValueError(f"batch of {rows} rows is not a positive multiple of {what}")
        per_rank = rows // dp
        lo = self.layout.dp_rank * per_rank
        mine = batch.map(lambda v: v[lo : lo + per_rank])
        seq = batch.seq
        if fixed and not self.packing:
            n = per_rank // mbs
            return [MicroBatch(mine.map(partial(_rows, lo=i * mbs, hi=(i + 1) * mbs)))
                    for i in range(n)], None  # fmt: skip
        lengths = [max(n, 1) for n in row_extents(mine)] if trim else [seq] * per_rank
        if not self.packing:
            assert self.token_budget is not None
            groups = pack_by_tokens(lengths, self.token_budget)
        elif self.token_budget is None:
            groups = [list(range(i, i + mbs)) for i in range(0, per_rank, mbs)]
        else:
            groups = plan_packs(lengths, self.token_budget)
        mult = self.layout.tp if self.config.sequence_parallel else 1
        cp = self.layout.cp
        length = 0
        if self.packing and self.layout.pp > 1:  # one shape for every micro-batch
            length = max(stream_length([lengths[i] for i in g], cp=cp, multiple=mult)
                         for g in groups)  # fmt: skip
        out = []
        for idx in groups:
            extents = [lengths[i] for i in idx]
            width = max(extents)
            if not self.packing:
                width = min(-(-width // mult) * mult, seq)
            # Per-token tensors are cut to the width; per-row ones ([B]) keep their shape.
            # Shorter rows keep their own padding and zero loss_mask up to the width.
            rows_of = mine.map(partial(_rows, sel=torch.tensor(idx)))
            rows_of = rows_of.per_token(partial(_columns, width=width))
            pack = None
            if self.packing:
                pack = build_pack(extents, width, cp=cp, multiple=mult, length=length)
            out.append(MicroBatch(rows_of, pack))
        return out, groups

    def _run(
        self,
        batch: TrainBatch,
        loss_fn: LossFn | None,
        collect: str | None = None,
    ) -> list:
        """Megatron's schedule over this rank's microbatches.

        With ``loss_fn`` it is a training pass; otherwise a forward-only pass that collects
        ``collect``: "logprobs" (``[b, s]``), "logits" (this TP rank's vocab shard,
        ``[b, s, v/tp]``), "last_logits" (the last position's, ``[b, v/tp]``) or, for a
        scalar-head model, "values" (``[b, s]``).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        seq = batch.seq
        # Sequence parallelism splits the sequence over TP ranks: pad it to a multiple
        # (a packed stream is padded as a whole instead).
        sp = self.config.sequence_parallel and not self.packing
        pad = (-seq) % self.layout.tp if sp else 0
        if pad:
            batch = batch.pad_columns(pad)
        if batch.routing is not None:
            self._check_routing(batch.routing)
        # The last position is only the last column when nothing is trimmed.
        mbs, groups = self._microbatches(batch, trim=collect != "last_logits")
        n = self._microbatch_count = len(mbs)
        forward_only = loss_fn is None
        own_ce = (self.temperature != 1.0 or self._padded_vocab > self.mcfg.vocab_size
                  or bool(self._banned))  # fmt: skip
        cp = self.layout.cp

        def forward_step(data_iterator, model):
            item: MicroBatch = next(data_iterator)
            mb = item.batch.map(lambda v: v.to(self.device, non_blocking=True))
            pack = item.pack
            # The model's own output, uncut: logits, or a scalar head's values.
            want_logits = self.score or collect in ("logits", "last_logits")
            vision = self._vision(mb)
            if pack is None:
                tokens = mb.tokens
                positions = torch.arange(tokens.shape[1], device=self.device)
                positions = positions.unsqueeze(0).expand_as(tokens)
                if self.mcfg.vision is not None:
                    positions = self._mrope(mb, positions)
                labels = None if want_logits else torch.roll(tokens, -1, dims=1)
                if self.replay is not None:
                    self.replay.set(mb.routing)
                out = model(tokens, positions, None, labels=None if own_ce else labels,
                            **vision)  # fmt: skip
            else:
                tokens, positions, labels, params = self._packed_inputs(mb, pack)
                if self.mcfg.vision is not None:
                    positions = self._mrope(mb, positions, pack)
                if "vision" in vision:
                    v = vision["vision"]
                    vision["vision"] = v.with_slots(pack.pack(v.slots, fill=-1))
                labels = None if want_logits else labels
                out = model(tokens, positions, None, labels=None if own_ce else labels,
                            packed_seq_params=params, **vision)  # fmt: skip

            def loss_func(output: torch.Tensor):
                if own_ce and not want_logits:
                    output = self._cross_entropy(output, labels)
                if pack is not None:  # back to the micro-batch's [rows, width] layout
                    output = self._unpacked(output, pack, logprobs=not want_logits)
                if loss_fn is None:
                    if collect == "values":
                        value = output[:, :seq, 0].float()
                    elif collect == "last_logits":
                        value = output[:, seq - 1, :].float()
                    elif collect == "logits":
                        value = output[:, :seq].float()
                    else:
                        value = -output[:, :seq].float()
                    one = torch.tensor(1, dtype=torch.int, device=self.device)
                    return output.sum() * 0, one, {collect: value}
                # A scalar-head model's loss takes its values, an LM's its log-probs.
                res = loss_fn(output[..., 0].float() if self.score else -output.float(), mb)
                # Megatron divides the gradient by the sum of the denominators over
                # micro-batches and DP ranks (calculate_per_token_loss).
                den = res.num_tokens if res.denominator is None else res.denominator
                stats = {k: v.detach() for k, v in res.stats.items()}
                stats["loss"] = res.loss_sum.detach()
                stats["loss_denominator"] = den.detach().float()
                stats["num_tokens"] = res.num_tokens.detach().float()
                mask = mb.loss_mask
                seqs = (mask.sum(dim=1) > 0).sum() if mask is not None else den * 0
                stats["num_seqs"] = seqs.detach().float()
                # Every CP rank computes the whole micro-batch's loss from the gathered
                # outputs and backpropagates its own tokens' part; Megatron sums the cp
                # copies of the denominator (over DP x CP), so the loss is cp times too.
                return res.loss_sum * cp if cp > 1 else res.loss_sum, den, stats

            return out, loss_func

        with cuda_to_cpu():
            per_mb = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(mbs),
                model=[self.model],
                num_microbatches=n,
                seq_length=mbs[0].pack.length if mbs[0].pack is not None else seq + pad,
                micro_batch_size=1 if mbs[0].pack is not None else self.tcfg.micro_batch_size,
                forward_only=forward_only,
            )
        if groups is None or not forward_only or not per_mb:
            return per_mb  # training stats are sums: their order does not matter
        assert collect is not None  # a forward-only pass collects something
        return [{collect: self._unpack(per_mb, collect, groups, seq)}]

    def _vision(self, mb: TrainBatch) -> dict[str, VisionInput]:
        """The model's ``vision`` argument for a micro-batch with images (on the first
        stage, which runs the tower); none otherwise."""
        v = self.mcfg.vision
        if v is None and mb.image_grids is not None:
            raise ValueError(
                f"the batch has images (image_grids) for model.architecture="
                f"{self.mcfg.architecture}, a text-only model"
            )
        if v is None or mb.image_grids is None or not self.layout.first_stage:
            return {}
        assert mb.pixel_values is not None
        images = vision_input(mb.tokens, mb.pixel_values, mb.image_grids,
                              image_token_id=v.image_token_id,
                              merge=int(v.tower.get("spatial_merge_size", 2)))  # fmt: skip
        return {} if images is None else {"vision": images}

    def _mrope(
        self, mb: TrainBatch, positions: torch.Tensor, pack: Pack | None = None
    ) -> torch.Tensor:
        """Multimodal RoPE positions ``[3, b, s]``: the batch's own, or the text ones on
        every plane (a batch without images)."""
        if mb.positions is None:
            return positions.unsqueeze(0).expand(3, *positions.shape)
        three = mb.positions if pack is None else pack.pack(mb.positions)
        return three.permute(2, 0, 1).to(self.device)

    def _packed_inputs(self, mb: TrainBatch, pack: Pack) -> tuple:
        """A packed micro-batch's model inputs on this CP rank: tokens, positions within
        their segment and next-token labels ``[1, t]``, and Megatron's PackedSeqParams.
        Routing replay follows the packing (-1, the router's own, on padding). An MoE
        model's routers see the stream's few padding tokens, as they see a padded
        micro-batch's padding: Megatron-Core's padding mask would leave them out of the
        load-balancing loss, but then scales that loss's gradient by each TP rank's own
        count, which differs between ranks under sequence parallelism."""
        from megatron.core.packed_seq_params import PackedSeqParams

        tokens = pack.pack(mb.tokens).to(self.device)
        # A segment's last label is the next segment's first token: that position scores
        # past its row's extent, which is never counted.
        labels = torch.roll(tokens, -1, dims=1)
        positions = pack.positions().to(self.device)
        routing = pack.pack(mb.routing, fill=-1).to(self.device) if mb.routing is not None else None
        if self.layout.cp > 1:
            here = pack.local(self.layout.cp_rank).to(self.device)
            tokens, labels, positions = tokens[:, here], labels[:, here], positions[:, here]
            routing = routing[:, here] if routing is not None else None
        if self.replay is not None:
            self.replay.set(routing)
        cu = pack.cu_seqlens.to(self.device)
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=pack.max_seqlen,
            max_seqlen_kv=pack.max_seqlen,
            cp_group=self.layout.cp_group,
        )
        return tokens, positions, labels, params

    def _unpacked(self, output: torch.Tensor, pack: Pack, logprobs: bool) -> torch.Tensor:
        """A packed micro-batch's per-token output ``[1, t, ...]`` (this CP rank's part)
        as its rows' ``[rows, width, ...]``; under CP gathered from every rank first.
        ``logprobs``: 0 at each row's last token, whose label is the next row's token."""
        group = self.layout.cp_group
        if self.layout.cp > 1 and group is not None:
            from rl.models.packed_attention import gather_cp

            whole = gather_cp(output[0], group, reduce=False)
            order = pack.gathered_order().to(whole.device)
            output = torch.zeros_like(whole).index_copy(0, order, whole).unsqueeze(0)
        out = pack.unpack(output)
        if not logprobs:
            return out
        flat = out.reshape(pack.rows * pack.width, *out.shape[2:])
        return flat.index_fill(0, pack.ends.to(flat.device), 0).view_as(out)

    @staticmethod
    def _unpack(per_mb: list[dict], key: str, groups: list[list[int]], seq: int) -> torch.Tensor:
        """Budgeted micro-batch outputs back in this rank's row order at full width ``seq``;
        columns past a micro-batch's width are 0 (padding, never scored)."""
        first = per_mb[0][key]
        rows = sum(len(g) for g in groups)
        shape = (rows, *first.shape[1:]) if key == "last_logits" else (rows, seq, *first.shape[2:])
        full = torch.zeros(shape, dtype=first.dtype, device=first.device)
        for d, idx in zip(per_mb, groups, strict=True):
            value = d[key]
            if key == "last_logits":
                full[idx] = value
            else:
                full[idx, : value.shape[1]] = value
        return full

    def _cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``-log softmax(logits / T)[label]`` over the *real* vocabulary, from this TP
        rank's vocab shard. Megatron's own loss (used when neither applies) would count
        the padding rows' logits in the softmax, so the trainer's pi would not be the
        distribution the generator samples from (SGLang serves the unpadded vocab)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits = logits.float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        never = self._never_sampled(logits.shape[-1], logits.device)
        if never is not None:
            logits = logits.masked_fill(never, BANNED)
        return vocab_parallel_cross_entropy(logits, labels)

    @functools.cache  # noqa: B019 (one trainer per process, one shard width)
    def _never_sampled(self, part: int, device: torch.device) -> torch.Tensor | None:
        """The columns of this TP rank's vocab shard that never get mass: the padding rows,
        and banned tokens (None: none)."""
        first = self.layout.tp_rank * part
        never = torch.arange(first, first + part) >= self.mcfg.vocab_size
        for t in self._banned:
            if first <= t < first + part:
                never[t - first] = True
        return never.to(device) if bool(never.any()) else None

    def _collect(self, per_mb: list[dict], key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Assemble a forward-only result from every DP rank and share it with all ranks
        (gathered on the trainer's device, returned on the host)."""
        lay = self.layout
        full = torch.empty(shape, dtype=torch.float32, device=self.device)
        if lay.last_stage:
            mine = torch.cat([d[key] for d in per_mb], dim=0)
            if key in ("logits", "last_logits") and lay.tp > 1:
                shards = [torch.empty_like(mine) for _ in range(lay.tp)]
                dist.all_gather(shards, mine.contiguous(), group=lay.tp_group)
                mine = torch.cat(shards, dim=-1)
            parts = [torch.empty_like(mine) for _ in range(lay.dp)]
            dist.all_gather(parts, mine, group=lay.dp_group)
            full = torch.cat(parts, dim=0)
        if lay.pp > 1:
            dist.broadcast(full, src=lay.last_stage_global_rank(), group=lay.pp_group)
        return full.cpu()

    # ------------------------------------------------------------------ public API
    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on the global batch; returns metrics identical on all ranks."""
        t0 = time.perf_counter()
        if self.optimizer is None or self.scheduler is None:
            raise RuntimeError("a frozen trainer (the KL reference) does not train")
        optimizer, scheduler = self.optimizer, self.scheduler
        self.model.zero_grad_buffer()
        optimizer.zero_grad()
        if self.moe is not None:
            self.moe.load.zero_()  # count this step's training forward only
        per_mb = self._run(batch, loss_fn)
        with cuda_to_cpu():
            ok, grad_norm, _ = optimizer.step()
        if ok:
            scheduler.step(increment=1)
            self.step += 1
        metrics = self._reduce_stats(per_mb)
        ntok = max(metrics.pop("num_tokens"), 1.0)
        nseq = max(metrics.pop("num_seqs"), 1.0)
        loss = metrics.pop("loss") / max(metrics.pop("loss_denominator"), 1.0)
        # seq_ statistics are per-sequence sums (rl/algorithms/losses.py), the rest per-token
        out = {k: v / (nseq if k.startswith("seq_") else ntok) for k, v in metrics.items()}
        out.update(
            loss=loss,
            grad_norm=float(grad_norm) if grad_norm is not None else math.nan,
            lr=optimizer.param_groups[0]["lr"],
            num_tokens=ntok,
            num_seqs=nseq,
            step_seconds=time.perf_counter() - t0,
            skipped=float(not ok),
        )
        out["tokens_per_s"] = batch.tokens.numel() / out["step_seconds"]
        if self.moe is not None:
            out.update(self.moe.step(self._microbatch_count))
        if self.replay is not None:
            out.update(self.replay.step())
        return out

    def _check_routing(self, routing: torch.Tensor) -> None:
        """A batch's routing must fit the model, and stay with its micro-batch: a forward
        recomputed during a pipelined backward would replay another one's."""
        want = (self.mcfg.num_layers, self.config.moe_router_topk)
        if self.replay is None or tuple(routing.shape[2:]) != want:
            raise ValueError(
                f"the batch's routing has layers x top-k {tuple(routing.shape[2:])}; the model "
                f"{'has no MoE layer' if self.replay is None else f'routes {want}'}"
            )
        if self.tcfg.recompute != "none" and self.layout.pp > 1:
            raise ValueError(
                f"routing replay with trainer.recompute={self.tcfg.recompute} needs "
                f"trainer.pp=1 (got {self.layout.pp})"
            )

    def train_batch(
        self, batch: TrainBatch, loss_fn: LossFn, reuse: Reuse, step: int
    ) -> dict[str, float]:
        """``reuse.updates`` optimizer steps on RL step ``step``'s batch, one per minibatch
        of each epoch (rl/algorithms/reuse.py), pi_old's log-probs scored first when there
        are several (not for a scalar head: a critic's old values come with the batch);
        returns their combined metrics, identical on all ranks."""
        if reuse.updates == 1:
            return combine([self.train_step(batch, loss_fn)])
        t0 = time.perf_counter()
        if not self.score:
            batch = replace(batch, old_logprobs=self.logprobs(batch))
        scored = time.perf_counter() - t0
        parts = [
            self.train_step(batch.map(partial(_rows, sel=rows)), loss_fn)
            for rows in reuse.minibatch_rows(batch.rows, step)
        ]
        out = combine(parts, reuse.epochs)
        out["step_seconds"] += scored
        out["old_logprobs_s"] = scored
        return out

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Per-token log-probs ``[B, S]`` of the whole batch, on every rank. Past a row's
        last ``loss_mask`` position they are 0 when micro-batches are trimmed or packed
        (those columns are not run); every scored position is exact."""
        if self.score:
            raise ValueError(f"{self.mcfg.architecture} has a scalar head: it gives values()")
        per_mb = self._run(batch, None, collect="logprobs")
        return self._collect(per_mb, "logprobs", tuple(batch.tokens.shape))

    @torch.no_grad()
    def logits(self, batch: TrainBatch) -> torch.Tensor:
        """Full logits ``[B, S, padded_vocab]`` of the whole batch, on every rank."""
        per_mb = self._run(batch, None, collect="logits")
        return self._collect(per_mb, "logits", (*batch.tokens.shape, self._padded_vocab))

    @torch.no_grad()
    def values(self, batch: TrainBatch) -> torch.Tensor:
        """A scalar-head model's value of every token ``[B, S]``, on every rank."""
        if not self.score:
            raise ValueError(f"{self.mcfg.architecture} has an LM head, not a scalar one")
        per_mb = self._run(batch, None, collect="values")
        return self._collect(per_mb, "values", tuple(batch.tokens.shape))

    @torch.no_grad()
    def greedy_generate(
        self,
        prompts: torch.Tensor,
        max_new_tokens: int,
        images: Callable[[TrainBatch], TrainBatch] | None = None,
    ) -> torch.Tensor:
        """Greedy continuation ``[B, max_new_tokens]`` of equal-length prompts (no KV cache).
        ``images``: adds the rows' images to each step's batch (a vision-language model).

        For evaluation of small models; serving is the generator executor's job.
        """
        tokens = prompts
        vocab = self.mcfg.vocab_size
        for _ in range(max_new_tokens):
            batch = TrainBatch(tokens) if images is None else images(TrainBatch(tokens))
            per_mb = self._run(batch, None, collect="last_logits")
            rows = tokens.shape[0]
            logits = self._collect(per_mb, "last_logits", (rows, self._padded_vocab))[:, :vocab]
            logits[:, list(self._banned)] = BANNED
            nxt = logits.argmax(dim=-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens[:, prompts.shape[1] :]

    def _reduce_stats(self, per_mb: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        lay = self.layout
        stats = None
        if lay.last_stage:
            keys = sorted(per_mb[0])
            vec = torch.stack([torch.stack([d[k].float() for d in per_mb]).sum() for k in keys])
            dist.all_reduce(vec, group=lay.dp_group)
            stats = dict(zip(keys, vec.tolist(), strict=True))
        if lay.pp > 1:
            box = [stats]
            dist.broadcast_object_list(box, src=lay.last_stage_global_rank(), group=lay.pp_group)
            stats = box[0]
        assert stats is not None
        return stats

    def state_dict(self) -> TrainState:
        """The counters a checkpoint keeps next to the optimizer state."""
        return TrainState(step=self.step)

    def load_state_dict(self, state: TrainState) -> None:
        self.step = state.step

    def save(self, path: str, keep_previous: bool = False, weights_only: bool = False) -> None:
        """Collective save to ``path``: weights, plus optimizer state once a step was taken
        unless ``weights_only`` (``keep_previous``: see rl/engine/checkpoint.py)."""
        module = self.model.module
        opt, sched = self.optimizer, self.scheduler
        checkpoint.save(path, module, self.mcfg, opt, sched, self.state_dict(), keep_previous,
                        self.carried, self.lora_base, weights_only)  # fmt: skip

    def load(self, path: str, load_optimizer: bool = True) -> None:
        """Load a checkpoint of any TP/PP in place; the optimizer state and step too if
        ``load_optimizer`` and the checkpoint has them."""
        module = self.model.module
        opt, sched = self.optimizer, self.scheduler
        state, self.lora_base = checkpoint.load(path, module, self.mcfg, opt, sched, load_optimizer)
        if state is not None:
            self.load_state_dict(state)
        # The HF model's token ids and generation config, for every later save's export.
        self.carried = hf_fields(read_common(path, self.mcfg)) or self.carried

    def load_decoder(self, path: str) -> None:
        """Every weight but the head's from ``path``, a checkpoint of the same decoder with
        the LM head (a critic started from its policy): the scalar head stays fresh."""
        checkpoint.load_decoder(path, self.model.module, self.mcfg, self.optimizer)


def build_trainer(
    model_cfg: ModelConfig,
    trainer_cfg: TrainerConfig,
    total_steps: int,
    frozen: bool = False,
    initialize: bool = True,
) -> MegatronTrainer:
    """Initialise model parallelism on this rank's world and build the trainer."""
    t = trainer_cfg
    layout = init_model_parallel(t.tp, t.pp, t.seed, ep=t.ep, cp=t.cp)
    return MegatronTrainer(
        model_cfg, trainer_cfg, layout, total_steps, frozen=frozen, initialize=initialize
    )


def _rows(
    v: torch.Tensor, lo: int = 0, hi: int | None = None, sel: torch.Tensor | None = None
) -> torch.Tensor:
    return v[lo:hi] if sel is None else v[sel]


def _columns(v: torch.Tensor, width: int) -> torch.Tensor:
    return v[:, :width]


__all__ = ["MegatronTrainer", "build_trainer"]
