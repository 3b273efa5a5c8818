"""The Megatron trainer on one CUDA GPU (trainer.device=cuda): a converted checkpoint's
logits match transformers, one Adam step lands where the same step on CPU lands, its
checkpoint loads on CPU, and DDMA from its live CUDA parameters (FP8 quantized on the
device) gives the bytes DDMA from that CPU copy gives.

The layer spec is Transformer Engine's when TE imports (requirements/gpu.txt), else
Megatron's local spec; the result records which one ran."""

from __future__ import annotations

import torch

from rl.batch import TrainBatch
from rl.runtime.launch import spawn
from rl.weights.convert import prepare_hf_to_mcore
from tests.helpers.hf_models import SHAPES, hf_logits, make_model
from tests.helpers.workers import convert_then_logits, random_batches

TOKENS = torch.randint(0, SHAPES["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(7))
# fp32 against transformers, summed in another order over 4 layers (as on CPU: tests/multiproc)
TOL = 1e-4
FP8_BLOCK = 16  # divides this model's query groups (32 rows) and MLP (176 rows)


def _trainer(ckpt: str, m, dtype: str, rows: int, device: str):
    from rl.compose import compose
    from rl.engine.trainer import build_trainer

    cfg = compose(["trainer.tp=1", "trainer.pp=1", "trainer.micro_batch_size=1",
                   f"trainer.global_batch_size={rows}", f"trainer.params_dtype={dtype}",
                   f"trainer.device={device}", "trainer.optim.lr=1e-3", "rollout.tp=1",
                   "rollout.device=cuda",
                   f"rollout.weight_sync.fp8_block={FP8_BLOCK}"])  # fmt: skip
    tr = build_trainer(m, cfg.trainer, total_steps=1)
    tr.load(ckpt, load_optimizer=False)
    return tr, cfg


def _ddma(tr, m, cfg) -> dict[str, torch.Tensor]:
    """DDMA from the trainer's live parameters, on its device, into an FP8 SGLang TP=1
    layout: pack (quantizing), verify, scatter; the destination tensors, on the host."""
    from rl.ddma import wire
    from rl.ddma.megatron_source import shard_getter, source_rank
    from rl.ddma.plan import plan_for

    plan = plan_for(m, cfg.trainer, cfg.rollout)
    rank = source_rank(tr.layout, plan.src)
    shards = shard_getter(tr.model.module, plan, rank)
    out = {n: torch.zeros(s, device=tr.device, dtype=wire.dst_dtype(plan, n, torch.float32))
           for n, s in plan.dst_shapes.items()}  # fmt: skip
    buf = torch.empty(plan.bucket_bytes, dtype=torch.uint8, device=tr.device)
    for b in plan.sends(rank):
        msg = wire.pack(buf, plan, b, shards, torch.float32, 1)
        wire.verify(msg, plan, b, 1)
        wire.unpack(msg, plan, b, out.__getitem__, torch.float32)
    wire.zero_fill(plan, 0, out.__getitem__)
    return {n: t.cpu() for n, t in out.items()}


def step_rank(ckpt: str, m, dtype: str, batch: dict, device: str, save: str = "") -> dict:
    """Load ``ckpt`` into a trainer on ``device``; logits, one Adam step, logits again;
    then save to ``save`` and DDMA the new weights from the live parameters."""
    from rl.algorithms.losses import nll_loss
    from rl.models.megatron_gpt import have_transformer_engine

    tr, cfg = _trainer(ckpt, m, dtype, batch.tokens.shape[0], device)
    before = tr.logits(TrainBatch(TOKENS))
    metrics = tr.train_step(batch, nll_loss)
    out = {
        "device": next(tr.model.parameters()).device.type,
        "te": have_transformer_engine(),
        "before": before,
        "after": tr.logits(TrainBatch(TOKENS)),
        "loss": metrics["loss"],
    }
    if save:
        tr.save(save)
        out["ddma"] = _ddma(tr, m, cfg)
    return out


def load_rank(ckpt: str, m, dtype: str, rows: int) -> dict:
    """A CPU trainer from ``ckpt``: its logits, and DDMA from its parameters."""
    tr, cfg = _trainer(ckpt, m, dtype, rows, "cpu")
    return {"logits": tr.logits(TrainBatch(TOKENS)), "ddma": _ddma(tr, m, cfg)}


def test_trainer_on_cuda_matches_transformers_and_its_cpu_step(tmp_path):
    hf = make_model("llama", tmp_path / "llama")
    m, dtype = prepare_hf_to_mcore(str(hf), 1, 1, vocab_multiple=128, dtype=None)
    ckpt, stepped = str(tmp_path / "mcore"), str(tmp_path / "stepped")
    spawn(convert_then_logits, 1, str(hf), ckpt, m, 1, 1, dtype, TOKENS)  # on CPU
    batch = random_batches(1, rows=4, seq=16, vocab=SHAPES["vocab_size"])[0]
    cpu = spawn(step_rank, 1, ckpt, m, dtype, batch, "cpu")[0]
    gpu = spawn(step_rank, 1, ckpt, m, dtype, batch, "cuda", stepped, device="cuda")[0]
    assert gpu["device"] == "cuda" and cpu["device"] == "cpu"
    vocab = SHAPES["vocab_size"]
    want = hf_logits(hf, TOKENS)
    assert (gpu["before"][..., :vocab] - want).abs().max() < TOL
    moved = (cpu["after"] - cpu["before"]).abs().max()
    assert moved > 100 * TOL  # the step changed the model far beyond the tolerance
    assert abs(gpu["loss"] - cpu["loss"]) < TOL * abs(cpu["loss"])
    assert (gpu["after"][..., :vocab] - cpu["after"][..., :vocab]).abs().max() < 10 * TOL
    print(
        f"trainer on cuda (TE layers: {gpu['te']}): |logits - transformers| "
        f"{(gpu['before'][..., :vocab] - want).abs().max():.2e}, after one Adam step "
        f"|cuda - cpu| {(gpu['after'] - cpu['after']).abs().max():.2e} (step moved {moved:.2e})"
    )

    # The GPU trainer's checkpoint, loaded on CPU, holds its weights: the same logits, and
    # DDMA from the live CUDA parameters (FP8 quantized on the device) gives every byte
    # that DDMA from the CPU copy gives.
    back = spawn(load_rank, 1, stepped, m, dtype, batch.tokens.shape[0])[0]
    assert (back["logits"] - gpu["after"]).abs().max() < TOL
    assert set(back["ddma"]) == set(gpu["ddma"]) and any("scale_inv" in n for n in back["ddma"])
    for name, t in back["ddma"].items():
        assert torch.equal(gpu["ddma"][name].view(torch.uint8), t.view(torch.uint8)), name
