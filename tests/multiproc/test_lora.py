"""LoRA on Megatron's parallel linears (trainer.lora), on the tiny model:

- only the adapters train: every base weight is bit-identical after the steps, and only
  adapter tensors require gradients;
- at TP=2 and PP=2 the adapted model trains as it does at TP=1 (the same losses and
  log-probs within the sharded-parity tolerance, from one checkpoint whose adapters
  reshard on load);
- the adapted model's log-probs equal those of its merged dense model (``W + s B A``
  written into the weights, adapters zeroed);
- DDMA from the live adapted model (merged shard by shard as it is packed) sends the very
  bytes DDMA sends from that merged dense model;
- a checkpoint saved at TP=2 (or PP=2) with trained adapters holds them alone and names
  its base by content; it loads at TP=1 with the same log-probs, and exports merged to
  an HF directory whose transformers logits are the adapted model's, and as a PEFT
  adapter that peft's LoRA layers on the base model turn into the same logits.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from rl.batch import TrainBatch
from rl.runtime.launch import spawn
from rl.weights.convert import mcore_to_hf
from rl.weights.peft_export import mcore_to_peft
from tests.helpers.hf_models import hf_logits
from tests.helpers.workers import random_batches

STEPS = 3
BASE = ["trainer.micro_batch_size=2", "trainer.global_batch_size=8", "trainer.optim.lr=1e-2",
        "trainer.optim.warmup_steps=0", "trainer.lora.rank=4", "trainer.lora.alpha=8",
        "rollout.tp=1"]  # fmt: skip
TOL, RTOL = 1e-5, 1e-5  # as tests/multiproc/test_parallel_parity.py


def _layout(tp: int, pp: int) -> list[str]:
    return [*BASE, f"trainer.tp={tp}", f"trainer.pp={pp}", "trainer.dp=1"]


def _sent(module, plan, layout) -> list[bytes]:
    """The bytes of every DDMA bucket this rank sends (SGLang TP=1 layout)."""
    from rl.ddma import wire
    from rl.ddma.megatron_source import shard_getter, source_rank

    rank = source_rank(layout, plan.src)
    getter = shard_getter(module, plan, rank)
    buf = torch.empty(plan.bucket_bytes, dtype=torch.uint8)
    return [wire.pack(buf, plan, b, getter, torch.float32, 1).numpy().tobytes()
            for b in plan.sends(rank)]  # fmt: skip


def lora_rank(overrides: list[str], batches: list, load: str = "", save_init: str = "",
              save_final: str = "") -> dict:  # fmt: skip
    from rl.algorithms.losses import nll_loss
    from rl.compose import compose
    from rl.ddma.plan import plan_for
    from rl.engine.trainer import build_trainer
    from rl.models.shapes import lora_layer_params

    cfg = compose(overrides)
    tr = build_trainer(cfg.model, cfg.trainer, total_steps=max(len(batches), 1))
    if save_init:
        tr.save(save_init)
    if load:
        tr.load(load)
    module, probe = tr.model.module, random_batches(1)[0]
    frozen = {n: p.detach().clone() for n, p in module.named_parameters() if not p.requires_grad}
    res: dict = {"logprobs": [tr.logprobs(probe)], "losses": []}
    for b in batches:
        res["losses"].append(tr.train_step(b, nll_loss)["loss"])
        res["logprobs"].append(tr.logprobs(probe))
    named = dict(module.named_parameters())
    res["trainable"] = sorted(n for n, p in named.items() if p.requires_grad)
    res["frozen_changed"] = [n for n, t in frozen.items() if not torch.equal(named[n], t)]
    res["adapter_params"], res["params"] = tr.adapter_params, sum(p.numel() for p in named.values())
    t = cfg.trainer  # the planner's count (rl/plan/memory.py), for this rank
    res["planned"] = (
        cfg.model.num_layers
        // t.pp
        * lora_layer_params(cfg.model, t.lora.rank, list(t.lora.targets), t.tp)
    )
    res["logits"] = tr.logits(TrainBatch(probe.tokens))
    if save_final:
        tr.save(save_final)
    plan = plan_for(cfg.model, cfg.trainer, cfg.rollout)
    res["sent_live"] = _sent(module, plan, tr.layout)
    with torch.no_grad():  # the merged dense model: W + s B A in the weights, adapters off
        for m in module.modules():
            if hasattr(m, "adapter"):
                m.weight.copy_(m.adapter.merged(m.weight))
                m.adapter.lora_B.zero_()
    res["merged_logprobs"] = tr.logprobs(probe)
    res["sent_merged"] = _sent(module, plan, tr.layout)
    return res


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    init = str(root / "init")
    res = spawn(lora_rank, 1, _layout(1, 1), random_batches(STEPS), "", init)[0]
    return root, init, res


def test_only_the_adapters_train_and_the_model_learns(reference):
    _, _, ref = reference
    assert ref["frozen_changed"] == []
    assert ref["trainable"] and all(".adapter.lora_" in n for n in ref["trainable"])
    # 4 layers x (qkv, proj, fc1, fc2) x (A and B)
    assert len(ref["trainable"]) == 4 * 4 * 2
    assert 0 < ref["adapter_params"] == ref["planned"] < ref["params"] // 10
    mask = random_batches(1)[0].loss_mask.bool()
    before, after = ref["logprobs"][0][mask].mean(), ref["logprobs"][-1][mask].mean()
    assert after > before + 0.02, (before, after)


def test_the_adapted_model_equals_its_merged_dense_model(reference):
    _, _, ref = reference
    torch.testing.assert_close(ref["merged_logprobs"], ref["logprobs"][-1], atol=TOL, rtol=RTOL)
    # DDMA merges on the fly: bit for bit the bytes the merged dense model sends
    assert ref["sent_live"] == ref["sent_merged"] and len(ref["sent_live"]) > 0


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_sharded_lora_matches_tp1(reference, tp: int, pp: int):
    root, init, ref = reference
    save = str(root / f"final_tp{tp}_pp{pp}")
    out = spawn(lora_rank, tp * pp, _layout(tp, pp), random_batches(STEPS), init, "", save)
    for r in out:
        assert r["frozen_changed"] == [] and r["adapter_params"] == r["planned"]
        torch.testing.assert_close(r["losses"], ref["losses"], atol=TOL, rtol=0)
        for got, want in zip(r["logprobs"], ref["logprobs"], strict=True):
            torch.testing.assert_close(got, want, atol=TOL, rtol=RTOL)
        torch.testing.assert_close(r["merged_logprobs"], r["logprobs"][-1], atol=TOL, rtol=RTOL)
        assert r["sent_live"] == r["sent_merged"]
    # Saved: the adapters and their Adam state only, naming the base they were loaded from
    # (init: weights and fresh adapters) by content (rl/config/lora_base.py).
    from megatron.core import dist_checkpointing

    from rl.config import lora_base
    from rl.models.lora import is_adapter_key
    from rl.weights.megatron_io import checkpoint_tensors

    stored = checkpoint_tensors(save)
    assert stored and all(is_adapter_key(k) for k in stored), sorted(stored)[:3]
    ref = dist_checkpointing.load_common_state_dict(save)["lora"]["base"]
    assert ref["relpath"] == "init" and ref["digest"] == lora_base.digest(init)
    # The trained adapters, saved sharded, load at TP=1 (no steps) on their base: the same
    # model.
    back = spawn(lora_rank, 1, _layout(1, 1), [], save)[0]
    torch.testing.assert_close(back["logprobs"][0], out[0]["logprobs"][-1], atol=TOL, rtol=RTOL)
    # Exported merged (rl.save_hf, tools/convert_mcore_to_hf.py): transformers computes
    # the adapted model's logits.
    hf = root / f"hf_tp{tp}_pp{pp}"
    mcore_to_hf(save, str(hf))
    tokens = random_batches(1)[0].tokens
    want = hf_logits(hf, tokens)
    torch.testing.assert_close(back["logits"][..., : want.shape[-1]], want, atol=1e-4, rtol=0)
    if tp == 1:  # the PEFT layout (B's rows) is the one the TP=2 save shows too
        return
    # Exported as a PEFT adapter (tools/convert_mcore_to_hf.py --peft): peft's LoRA layers
    # on the base, exported from init (its adapters start at B = 0), give the same logits.
    base, adapter = root / "hf_base", root / f"peft_tp{tp}_pp{pp}"
    mcore_to_hf(init, str(base))
    got = mcore_to_peft(save, str(adapter), base_model=str(base))
    assert got["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                     "up_proj", "v_proj"]  # fmt: skip
    torch.testing.assert_close(hf_logits(base, tokens, adapter), want, atol=1e-4, rtol=0)
    assert (hf_logits(base, tokens) - want).abs().max() > 1e-2  # the adapters matter


def test_a_save_over_its_own_base_keeps_the_base(reference):
    """A LoRA checkpoint that holds its base (saved before any base was known), resumed and
    saved in place: the save replaces the base, so it writes the base again instead of
    naming itself."""
    from megatron.core import dist_checkpointing

    root, init, _ = reference
    here = root / "in_place"
    shutil.copytree(init, here)
    out = spawn(lora_rank, 1, _layout(1, 1), random_batches(1), str(here), "", str(here))[0]
    assert "base" not in dist_checkpointing.load_common_state_dict(str(here))["lora"]
    back = spawn(lora_rank, 1, _layout(1, 1), [], str(here))[0]
    torch.testing.assert_close(back["logprobs"][0], out["logprobs"][-1], atol=TOL, rtol=RTOL)
