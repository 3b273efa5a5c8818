"""Full activation recomputation (``trainer.recompute=full``) on one CUDA GPU: from one
checkpoint, a trainer that recomputes every layer in the backward takes the same Adam steps
as one that keeps its activations, and runs each layer's forward twice per micro-batch.
(Sequence parallelism needs TP > 1, so two GPUs: tests/multiproc/test_parallel_parity.py
checks both on CPU.)"""

from __future__ import annotations

import torch

from rl.runtime.launch import spawn
from tests.helpers.workers import random_batches, run_layout

STEPS = 3
BASE = ["trainer.device=cuda", "trainer.tp=1", "trainer.micro_batch_size=2",
        "trainer.global_batch_size=8", "trainer.optim.decay_style=constant",
        "trainer.optim.lr=1e-3", "trainer.optim.warmup_steps=0"]  # fmt: skip


def test_recomputation_on_cuda_takes_the_same_steps(tmp_path):
    init = str(tmp_path / "init")
    batches = random_batches(STEPS)
    kept = spawn(run_layout, 1, BASE, batches, init, device="cuda")[0]
    again = spawn(run_layout, 1, [*BASE, "trainer.recompute=full"], batches, None, init,
                  device="cuda")[0]  # fmt: skip
    assert kept["mlp_forwards"] == STEPS * 4 and again["mlp_forwards"] == STEPS * 4 * 2
    torch.testing.assert_close(again["losses"], kept["losses"], atol=1e-5, rtol=0)
    for got, want in zip(again["logprobs"], kept["logprobs"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
