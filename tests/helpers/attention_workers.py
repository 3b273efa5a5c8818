"""Rank functions for the core-attention and norm-dtype tests (module level: spawned ranks
import them): the same GPTModel weights under each ``trainer.attention``, and a bf16
trainer's norms."""

from __future__ import annotations

import warnings
from unittest import mock

import torch

# A tiny Llama with grouped-query attention (6 heads over 2 KV groups), 2 layers.
TINY = ["trainer=cpu_tp1", "model=tiny", "model.num_layers=2"]
FUSED_WARNING = "Cannot dispatch to fused implementation"


def _device(cfg) -> torch.device:
    if cfg.trainer.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def gpt_outputs(
    overrides: list[str], runs: list[tuple[str, str]], tokens: torch.Tensor, fused_only: bool
) -> dict:
    """For each ``(attention, params_dtype)`` of ``runs``, one GPTModel holding the first
    run's weights (cast): its logits and (the first two runs') parameter gradients of a
    fixed weighting of the logits, on the host. ``fused_only``: SDPA may not fall back to
    its math kernel (CUDA: flash, memory-efficient or cuDNN must take it)."""
    from megatron_patches import cuda_to_cpu
    from rl.compose import compose
    from rl.models.megatron_gpt import build_gpt
    from rl.models.parallel import init_model_parallel

    cfg = compose(overrides)
    lay = init_model_parallel(1, 1, cfg.trainer.seed)
    dev = _device(cfg)
    first: dict | None = None
    out: dict = {"logits": [], "grads": [], "core": [], "norm_dtype": []}
    for attention, dtype in runs:
        cfg.trainer.attention, cfg.trainer.params_dtype = attention, dtype
        torch.manual_seed(cfg.trainer.seed)
        model = build_gpt(cfg.model, cfg.trainer, True, True, lay.pg_collection)
        if first is None:
            first = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
        else:
            model.load_state_dict(first, strict=False)  # cast to this run's dtype
        model.to(dev)
        ids = tokens.to(dev)
        pos = torch.arange(ids.shape[1], device=dev).expand_as(ids)
        ctx = _only_fused() if fused_only and attention == "sdpa" else _nothing()
        with cuda_to_cpu(), ctx:
            logits = model(ids, pos, None)
            weight = torch.linspace(-1, 1, logits.numel(), device=dev).view_as(logits)
            (logits.float() * weight).sum().backward()
        out["logits"].append(logits.detach().float().cpu())
        out["grads"].append({n: p.grad.float().cpu() for n, p in model.named_parameters()})
        out["core"].append(type(model.decoder.layers[0].self_attention.core_attention).__name__)
        out["norm_dtype"].append(model.decoder.final_layernorm.weight.dtype)
    return out


def _only_fused():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    if hasattr(SDPBackend, "CUDNN_ATTENTION"):
        fused.append(SDPBackend.CUDNN_ATTENTION)
    return sdpa_kernel(fused)


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def module_cases() -> dict:
    """SDPAttention against DotProductAttention on the same q, k, v (fp32, CPU): causal,
    a boolean padding mask, one query position against a longer key (a KV-cache decode),
    and the refusals."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_patches import cuda_to_cpu
    from rl.compose import compose
    from rl.models.megatron_gpt import transformer_config
    from rl.models.parallel import init_model_parallel
    from rl.models.sdpa_attention import SDPAttention

    cfg = compose(TINY)
    lay = init_model_parallel(1, 1, 0)
    config = transformer_config(cfg.model, cfg.trainer)
    heads, groups, dim = 6, 2, config.kv_channels
    g = torch.Generator().manual_seed(3)

    def both(mask_type: AttnMaskType, sq: int, sk: int, mask: torch.Tensor | None) -> float:
        q = torch.randn(sq, 2, heads, dim, generator=g)
        k, v = (torch.randn(sk, 2, groups, dim, generator=g) for _ in range(2))
        args = (config, 1, mask_type, "self")
        ref = DotProductAttention(*args, pg_collection=lay.pg_collection)
        new = SDPAttention(*args, pg_collection=lay.pg_collection)
        with cuda_to_cpu():
            a, b = ref(q, k, v, mask), new(q, k, v, mask)
        assert a.shape == b.shape == (sq, 2, heads * dim), (a.shape, b.shape)
        return float((a - b).abs().max())

    pad = torch.zeros(2, 1, 1, 24, dtype=torch.bool)
    pad[1, ..., 17:] = True  # row 1's last 7 keys are padding
    out = {
        "causal": both(AttnMaskType.causal, 24, 24, None),
        "padding_mask": both(AttnMaskType.padding, 24, 24, pad),
        "decode": both(AttnMaskType.causal, 1, 24, None),
        "refusals": {},
    }
    for name, field, value in (
        ("dropout", "attention_dropout", 0.1),
        ("softmax", "softmax_type", "off-by-one"),
        ("window", "window_size", (8, 0)),
    ):
        bad = transformer_config(cfg.model, cfg.trainer)
        setattr(bad, field, value)
        try:
            SDPAttention(bad, 1, AttnMaskType.causal, "self", pg_collection=lay.pg_collection)
            out["refusals"][name] = None
        except ValueError as e:
            out["refusals"][name] = str(e)
    return out


def _trainer(overrides: list[str], old_norms: bool):
    from rl.compose import compose
    from rl.engine.trainer import build_trainer
    from rl.models import megatron_gpt

    batching = ["trainer.micro_batch_size=2", "trainer.global_batch_size=4"]
    optim = ["trainer.optim.lr=1e-2", "trainer.optim.warmup_steps=0"]
    cfg = compose([*TINY, *batching, *optim, *overrides])
    keep = mock.patch.object(megatron_gpt, "norms_in_compute_dtype", lambda m, d: None)
    with keep if old_norms else _nothing():
        return build_trainer(cfg.model, cfg.trainer, total_steps=4)


def _step(tr, batch) -> bool:
    """One step; whether torch warned that a norm could not run its fused kernel."""
    from rl.algorithms.losses import nll_loss

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tr.train_step(batch, nll_loss)
    return any(FUSED_WARNING in str(w.message) for w in seen)


def _norm_states(tr) -> list[dict[str, torch.Tensor]]:
    """Each norm weight's fp32 main copy and Adam moments (distributed optimizer)."""
    opt = tr.optimizer.chained_optimizers[0]
    norms = [p for n, p in tr.model.module.named_parameters() if "layernorm" in n]
    return [opt._get_main_param_and_optimizer_states(p) for p in norms]


def norm_paths_rank(batches: list, ckpt: str) -> dict:
    """bf16 on the host: the old path (norms float32) steps and saves; the new path (norms
    in bf16) steps from scratch, then loads the old checkpoint with its optimizer state.
    fp32: two steps with and without the cast, to compare bit for bit."""
    bf16 = ["trainer.params_dtype=bfloat16"]
    old = _trainer(bf16, old_norms=True)
    out: dict = {"old_dtypes": sorted({str(p.dtype) for p in old.model.module.parameters()})}
    out["old_warned"] = _step(old, batches[0])
    old.save(ckpt)
    old_states = _norm_states(old)
    old_norm = old.model.module.decoder.final_layernorm.weight.detach().clone()

    new = _trainer(bf16, old_norms=False)
    out["new_dtypes"] = sorted({str(p.dtype) for p in new.model.module.parameters()})
    norm = new.model.module.decoder.final_layernorm.weight
    before = norm.detach().clone()
    out["new_warned"] = _step(new, batches[0])
    out["moved"] = float((norm.detach().float() - before.float()).abs().max())
    states = _norm_states(new)
    out["main_dtypes"] = sorted({str(s["param"].dtype) for s in states})
    # The model's bf16 norm weights are their fp32 main copies rounded, as for a linear.
    norms = [p for n, p in new.model.module.named_parameters() if "layernorm" in n]
    out["rounded_main"] = all(
        torch.equal(p.detach(), s["param"].view_as(p).to(p.dtype))
        for p, s in zip(norms, states, strict=True)
    )

    resumed = _trainer(bf16, old_norms=False)
    resumed.load(ckpt)
    got = _norm_states(resumed)
    out["loaded_exact"] = all(
        torch.equal(a[k], b[k])
        for a, b in zip(old_states, got, strict=True)
        for k in ("param", "exp_avg")
    )
    loaded = resumed.model.module.decoder.final_layernorm.weight.detach()
    out["loaded_rounded"] = torch.equal(loaded, old_norm.to(loaded.dtype))

    lp = []
    for keep in (True, False):
        tr = _trainer(["trainer.attention=dot_product", "trainer.packing=false"], old_norms=keep)
        for b in batches:
            _step(tr, b)
        lp.append(tr.logprobs(batches[0]))
    out["fp32_bit_equal"] = torch.equal(*lp)
    return out


def fused_norm_rank(batch, overrides: list[str]) -> dict:
    """A bf16 trainer's step, both paths: whether torch warned that a norm ran unfused."""
    bf16 = ["trainer.params_dtype=bfloat16", *overrides]
    return {
        "old_warned": _step(_trainer(bf16, old_norms=True), batch),
        "new_warned": _step(_trainer(bf16, old_norms=False), batch),
    }
