"""LoRA (trainer.lora) on one CUDA GPU: from one base checkpoint, a CUDA trainer and a CPU
trainer take the same Adam steps on their adapters; the base stays bit-identical on the
GPU, the two end with the same logits, and DDMA's merge runs on the GPU (its merged shards
there equal the CPU's)."""

from __future__ import annotations

import torch

from rl.batch import TrainBatch
from rl.runtime.launch import spawn
from rl.weights.convert import prepare_hf_to_mcore
from tests.gpu.test_megatron_cuda import TOKENS, TOL
from tests.helpers.hf_models import SHAPES, make_model
from tests.helpers.workers import convert_then_logits, random_batches


def lora_steps(ckpt: str, m, dtype: str, batches: list[TrainBatch], device: str) -> dict:
    from rl.algorithms.losses import nll_loss
    from rl.compose import compose
    from rl.ddma.megatron_source import shard_getter, shard_map, source_rank
    from rl.ddma.plan import plan_for
    from rl.engine.trainer import build_trainer
    from rl.models import lora

    cfg = compose(["trainer.tp=1", "trainer.pp=1", "trainer.micro_batch_size=1",
                   f"trainer.global_batch_size={batches[0].tokens.shape[0]}",
                   f"trainer.params_dtype={dtype}", f"trainer.device={device}",
                   "trainer.optim.lr=1e-2", "trainer.lora.rank=4", "rollout.tp=1"])  # fmt: skip
    tr = build_trainer(m, cfg.trainer, total_steps=len(batches))
    tr.load(ckpt, load_optimizer=False)
    module = tr.model.module
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    before = tr.logits(TrainBatch(TOKENS)).cpu()
    losses = [tr.train_step(b, nll_loss)["loss"] for b in batches]
    named = dict(module.named_parameters())
    plan = plan_for(m, cfg.trainer, cfg.rollout)
    get = shard_getter(module, plan, source_rank(tr.layout, plan.src))
    adapters = lora.adapters_by_weight(module)
    merged = {k: get(*k) for k, t in shard_map(module).items() if id(t) in adapters}
    return {
        "device": next(module.parameters()).device.type,
        "losses": losses,
        "before": before,
        "logits": tr.logits(TrainBatch(TOKENS)).cpu(),
        "frozen_changed": [n for n, t in frozen.items() if not torch.equal(named[n], t)],
        "merged_device": {t.device.type for t in merged.values()},
        "merged": {k: t.cpu() for k, t in merged.items()},
    }


def test_lora_on_cuda_matches_its_cpu_steps(tmp_path):
    hf = make_model("llama", tmp_path / "llama")
    m, dtype = prepare_hf_to_mcore(str(hf), 1, 1, vocab_multiple=128, dtype=None)
    ckpt = str(tmp_path / "mcore")
    spawn(convert_then_logits, 1, str(hf), ckpt, m, 1, 1, dtype, TOKENS)  # on CPU
    batches = random_batches(2, rows=4, seq=16, vocab=SHAPES["vocab_size"])
    cpu = spawn(lora_steps, 1, ckpt, m, dtype, batches, "cpu")[0]
    gpu = spawn(lora_steps, 1, ckpt, m, dtype, batches, "cuda", device="cuda")[0]
    assert gpu["device"] == "cuda" and gpu["frozen_changed"] == [] == cpu["frozen_changed"]
    assert gpu["merged_device"] == {"cuda"} and gpu["merged"].keys() == cpu["merged"].keys()
    assert (cpu["logits"] - cpu["before"]).abs().max() > 100 * TOL  # the adapters moved it
    torch.testing.assert_close(gpu["losses"], cpu["losses"], atol=TOL, rtol=TOL)
    torch.testing.assert_close(gpu["logits"], cpu["logits"], atol=10 * TOL, rtol=0)
    for k, t in cpu["merged"].items():
        torch.testing.assert_close(gpu["merged"][k], t, atol=TOL, rtol=TOL)
    gap = (gpu["logits"] - cpu["logits"]).abs().max().item()
    print(f"LoRA on cuda: losses {gpu['losses']}, |logits cuda - cpu| {gap:.2e}")
