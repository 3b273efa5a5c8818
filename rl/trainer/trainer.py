"""The trainer executor: Megatron-Core model, optimizer and schedule for one policy.

A step takes a global batch (every rank receives the same dict of ``[B, S]`` tensors),
keeps this data-parallel rank's rows, cuts them into microbatches and runs Megatron's
forward/backward schedule (no pipelining, or 1F1B when PP > 1) with a pluggable loss over
token log-probs. Loss statistics are reduced over DP and shared from the last pipeline
stage, so every rank returns the same numbers.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_patches import cuda_to_cpu
from rl.algorithms.losses import LossFn
from rl.models.megatron_gpt import build_gpt
from rl.models.shapes import padded_vocab_size
from rl.trainer import checkpoint
from rl.trainer.parallel import Layout


class MegatronTrainer:
    def __init__(
        self,
        model_cfg: Any,
        trainer_cfg: Any,
        layout: Layout,
        total_steps: int,
        frozen: bool = False,
    ):
        """``frozen``: forward passes only (a reference policy), no optimizer state."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        self.mcfg, self.tcfg, self.layout = model_cfg, trainer_cfg, layout
        self.step = 0
        # Log-probs are log softmax(logits / temperature): an RL loss must score tokens
        # with the distribution they were sampled from (SGLang reports it at its T).
        self.temperature = 1.0
        t = trainer_cfg
        # Same seed on every rank: CPU init builds each full weight and splits it.
        torch.manual_seed(t.seed)
        model = build_gpt(model_cfg, t, layout.first_stage, layout.last_stage, layout.pg_collection)
        self.config = model.config
        self._padded_vocab = padded_vocab_size(model_cfg)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=t.use_distributed_optimizer,
        )
        with cuda_to_cpu():
            self.model = DistributedDataParallel(
                config=self.config, ddp_config=ddp_config, module=model
            )
        self.optimizer = self.scheduler = None
        if not frozen:
            self._build_optimizer(total_steps)

    def _build_optimizer(self, total_steps: int) -> None:
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        t, o = self.tcfg, self.tcfg.optim
        with cuda_to_cpu():
            self.optimizer = get_megatron_optimizer(
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
        self.config.grad_scale_func = self.optimizer.scale_loss
        decay = o.decay_steps if o.decay_steps is not None else max(total_steps, 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
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
    def _microbatches(self, batch: dict[str, torch.Tensor]) -> tuple[list[dict], int]:
        rows = batch["tokens"].shape[0]
        mbs, dp = self.tcfg.micro_batch_size, self.layout.dp
        if rows % (mbs * dp):
            raise ValueError(
                f"batch of {rows} rows is not a multiple of trainer.micro_batch_size*dp={mbs}*{dp}"
            )
        per_rank = rows // dp
        lo = self.layout.dp_rank * per_rank
        mine = {k: v[lo : lo + per_rank] for k, v in batch.items()}
        n = per_rank // mbs
        return [{k: v[i * mbs : (i + 1) * mbs] for k, v in mine.items()} for i in range(n)], n

    def _run(
        self,
        batch: dict[str, torch.Tensor],
        loss_fn: LossFn | None,
        collect: str | None = None,
    ) -> list:
        """Megatron's schedule over this rank's microbatches.

        With ``loss_fn`` it is a training pass; otherwise a forward-only pass that collects
        ``collect``: "logprobs" (``[b, s]``), "logits" (this TP rank's vocab shard,
        ``[b, s, v/tp]``) or "last_logits" (the last position's, ``[b, v/tp]``).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        mbs, n = self._microbatches(batch)
        seq = batch["tokens"].shape[1]
        forward_only = loss_fn is None
        own_ce = self.temperature != 1.0 or self._padded_vocab > self.mcfg.vocab_size

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            tokens = mb["tokens"]
            positions = torch.arange(seq).unsqueeze(0).expand_as(tokens)
            want_logits = collect in ("logits", "last_logits")
            labels = None if want_logits else torch.roll(tokens, -1, dims=1)
            out = model(tokens, positions, None, labels=None if own_ce else labels)

            def loss_func(output: torch.Tensor):
                if own_ce and not want_logits:
                    output = self._cross_entropy(output, labels)
                if forward_only:
                    if collect == "last_logits":
                        value = output[:, -1, :].float()
                    elif collect == "logits":
                        value = output.float()
                    else:
                        value = -output.float()
                    return output.sum() * 0, torch.tensor(1, dtype=torch.int), {collect: value}
                res = loss_fn(-output.float(), mb)
                stats = {k: v.detach() for k, v in res.stats.items()}
                stats["loss"] = res.loss_sum.detach()
                stats["num_tokens"] = res.num_tokens.detach().float()
                return res.loss_sum, res.num_tokens, stats

            return out, loss_func

        with cuda_to_cpu():
            return get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(mbs),
                model=[self.model],
                num_microbatches=n,
                seq_length=seq,
                micro_batch_size=self.tcfg.micro_batch_size,
                forward_only=forward_only,
            )

    def _cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``-log softmax(logits / T)[label]`` over the *real* vocabulary, from this TP
        rank's vocab shard. Megatron's own loss (used when neither applies) would count
        the padding rows' logits in the softmax, so the trainer's pi would not be the
        distribution the generator samples from (SGLang serves the unpadded vocab)."""
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        logits = logits.float()
        if self.temperature != 1.0:
            logits = logits / self.temperature
        part = logits.shape[-1]
        first_pad = self.mcfg.vocab_size - self.layout.tp_rank * part
        if first_pad < part:  # this shard holds padding columns: they never get mass
            cols = torch.arange(part) >= max(first_pad, 0)
            logits = logits.masked_fill(cols, -1e9)
        return vocab_parallel_cross_entropy(logits, labels)

    def _collect(self, per_mb: list[dict], key: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Assemble a forward-only result from every DP rank and share it with all ranks."""
        lay = self.layout
        full = torch.empty(shape, dtype=torch.float32)
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
        return full

    # ------------------------------------------------------------------ public API
    def train_step(self, batch: dict[str, torch.Tensor], loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on the global batch; returns metrics identical on all ranks."""
        t0 = time.perf_counter()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        per_mb = self._run(batch, loss_fn)
        with cuda_to_cpu():
            ok, grad_norm, _ = self.optimizer.step()
        if ok:
            self.scheduler.step(increment=1)
            self.step += 1
        metrics = self._reduce_stats(per_mb)
        ntok = max(metrics.pop("num_tokens"), 1.0)
        out = {k: v / ntok for k, v in metrics.items()}
        out.update(
            grad_norm=float(grad_norm) if grad_norm is not None else math.nan,
            lr=self.optimizer.param_groups[0]["lr"],
            num_tokens=ntok,
            step_seconds=time.perf_counter() - t0,
            skipped=float(not ok),
        )
        out["tokens_per_s"] = batch["tokens"].numel() / out["step_seconds"]
        return out

    @torch.no_grad()
    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-token log-probs ``[B, S]`` of the whole batch, on every rank."""
        per_mb = self._run(batch, None, collect="logprobs")
        return self._collect(per_mb, "logprobs", tuple(batch["tokens"].shape))

    @torch.no_grad()
    def logits(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Full logits ``[B, S, padded_vocab]`` of the whole batch, on every rank."""
        per_mb = self._run(batch, None, collect="logits")
        return self._collect(per_mb, "logits", (*batch["tokens"].shape, self._padded_vocab))

    @torch.no_grad()
    def greedy_generate(self, prompts: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation ``[B, max_new_tokens]`` of equal-length prompts (no KV cache).

        For evaluation of small models; serving is the generator executor's job.
        """
        tokens = prompts
        vocab = self.mcfg.vocab_size
        for _ in range(max_new_tokens):
            per_mb = self._run({"tokens": tokens}, None, collect="last_logits")
            rows = tokens.shape[0]
            logits = self._collect(per_mb, "last_logits", (rows, self._padded_vocab))
            nxt = logits[:, :vocab].argmax(dim=-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
        return tokens[:, prompts.shape[1] :]

    def _reduce_stats(self, per_mb: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        lay = self.layout
        stats = None
        if lay.last_stage:
            keys = sorted(per_mb[0])
            vec = torch.stack([sum(d[k].float() for d in per_mb) for k in keys])
            dist.all_reduce(vec, group=lay.dp_group)
            stats = dict(zip(keys, vec.tolist(), strict=True))
        if lay.pp > 1:
            box = [stats]
            dist.broadcast_object_list(box, src=lay.last_stage_global_rank(), group=lay.pp_group)
            stats = box[0]
        assert stats is not None
        return stats

    def save(self, path: str) -> None:
        checkpoint.save(self, path)

    def load(self, path: str, load_optimizer: bool = True) -> None:
        checkpoint.load(self, path, load_optimizer)


def build_trainer(
    model_cfg: Any, trainer_cfg: Any, total_steps: int, frozen: bool = False
) -> MegatronTrainer:
    """Initialise model parallelism on this rank's world and build the trainer."""
    from rl.trainer.parallel import init_model_parallel

    layout = init_model_parallel(trainer_cfg.tp, trainer_cfg.pp, trainer_cfg.seed)
    return MegatronTrainer(model_cfg, trainer_cfg, layout, total_steps, frozen)


__all__ = ["MegatronTrainer", "build_trainer"]
