"""The trainer's determinism on CUDA (``rl.deterministic``): two fresh trainer processes
take the same Adam steps from the same checkpoint on cuda:0 and end with the same losses,
logits and weights, bit for bit. The same pair without the switch is measured and
printed, to say what the switch buys on this GPU."""

from __future__ import annotations

import torch

from rl.batch import TrainBatch
from rl.runtime.launch import spawn
from rl.weights.convert import prepare_hf_to_mcore
from tests.gpu.test_megatron_cuda import TOKENS, _trainer
from tests.helpers.hf_models import SHAPES, make_model
from tests.helpers.workers import convert_then_logits, random_batches

STEPS = 3


def steps_rank(
    ckpt: str, m, dtype: str, batches: list[TrainBatch], deterministic: bool, device: str = "cuda"
) -> dict:
    """A fresh trainer from ``ckpt``: ``len(batches)`` Adam steps; what they left."""
    from rl.algorithms.losses import nll_loss
    from rl.engine.determinism import deterministic_kernels

    if deterministic:
        deterministic_kernels(device)
    tr, _ = _trainer(ckpt, m, dtype, batches[0].tokens.shape[0], device)
    losses = [tr.train_step(b, nll_loss)["loss"] for b in batches]
    return {
        "losses": losses,
        "logits": tr.logits(TrainBatch(TOKENS)).cpu(),
        "params": {n: p.detach().cpu().clone() for n, p in tr.model.named_parameters()},
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


def _differ(a: dict, b: dict) -> list[str]:
    """Where two runs part: the loss steps, the logits, the parameters that differ."""
    pairs = enumerate(zip(a["losses"], b["losses"], strict=True))
    out = [f"loss@{i}" for i, (x, y) in pairs if x != y]
    out += [] if torch.equal(a["logits"], b["logits"]) else ["logits"]
    return out + [n for n, t in a["params"].items() if not torch.equal(t, b["params"][n])]


def test_two_deterministic_cuda_trainers_end_bit_identical(tmp_path):
    hf = make_model("llama", tmp_path / "llama")
    m, dtype = prepare_hf_to_mcore(str(hf), 1, 1, vocab_multiple=128, dtype=None)
    ckpt = str(tmp_path / "mcore")
    spawn(convert_then_logits, 1, str(hf), ckpt, m, 1, 1, dtype, TOKENS)  # on CPU
    batches = random_batches(STEPS, rows=8, seq=64, vocab=SHAPES["vocab_size"])
    runs = {
        flag: [spawn(steps_rank, 1, ckpt, m, dtype, batches, flag, device="cuda")[0]
               for _ in range(2)]
        for flag in (False, True)
    }  # fmt: skip
    free = _differ(*runs[False])
    print(f"without rl.deterministic, two CUDA runs differ in {len(free)} place(s): {free[:6]}")
    a, b = runs[True]
    assert a["deterministic"] and not runs[False][0]["deterministic"]
    assert a["losses"][0] != a["losses"][-1]  # the steps trained
    assert _differ(a, b) == []
    moved = (a["logits"] - runs[False][0]["logits"]).abs().max().item()
    print(f"with it: bit-identical; its logits vs the free run's: max |diff| {moved:.2e}")
