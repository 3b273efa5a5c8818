"""The local spec's fast path on one CUDA GPU, in bf16: the SDPA core attention (the
default ``trainer.attention``) runs a fused kernel (flash, memory-efficient or cuDNN: the
math fallback is switched off) and its logits are as close to an fp32 reference as
Megatron's ``DotProductAttention`` in bf16 is; and bf16 norm weights take torch's fused
RMSNorm (no "Cannot dispatch to fused implementation" warning, which the old float32
norms give). The fp32 parity of the two attentions is tests/multiproc/test_sdpa_attention.py;
the throughput, tools/bench/trainer_throughput.py --device cuda."""

from __future__ import annotations

import torch

from rl.runtime.launch import spawn
from tests.helpers.attention_workers import fused_norm_rank, gpt_outputs
from tests.helpers.workers import random_batches

# 8 heads of 64 over 2 KV groups, 2 layers, 512 tokens: flash's shapes, still seconds.
SHAPE = ["trainer=cpu_tp1", "trainer.device=cuda", "model=tiny", "model.num_layers=2",
         "model.hidden_size=512", "model.ffn_hidden_size=1024", "model.num_attention_heads=8",
         "model.num_query_groups=2", "model.vocab_size=1024",
         "model.max_position_embeddings=512"]  # fmt: skip
# bf16 rounds each product to 8 bits of mantissa: the two bf16 paths may differ from the
# fp32 reference by different amounts, but SDPA (fp32 softmax inside the kernel) may not
# be further from it than DotProductAttention by more than this share plus an absolute
# allowance of one bf16 ulp at the logits' scale.
REL = 1.5


def test_sdpa_matches_dot_product_attention_in_bf16_on_cuda():
    tokens = torch.randint(0, 1024, (2, 512), generator=torch.Generator().manual_seed(0))
    runs = [("dot_product", "float32"), ("dot_product", "bfloat16"), ("sdpa", "bfloat16")]
    out = spawn(gpt_outputs, 1, SHAPE, runs, tokens, True, device="cuda")[0]
    assert out["core"] == ["DotProductAttention", "DotProductAttention", "SDPAttention"]
    assert out["norm_dtype"] == [torch.float32, torch.bfloat16, torch.bfloat16]
    ref, old, new = out["logits"]
    scale = float(ref.abs().max())
    err_old, err_new = float((old - ref).abs().max()), float((new - ref).abs().max())
    between = float((new - old).abs().max())
    print(f"bf16 logits against fp32 (max |logit| {scale:.3f}): DotProductAttention "
          f"{err_old:.2e}, SDPA {err_new:.2e}; between them {between:.2e}")  # fmt: skip
    assert scale > 0.1
    assert err_new <= REL * err_old + scale * 2**-8
    assert between <= 2 * max(err_old, err_new) + scale * 2**-8


def test_bf16_norms_take_the_fused_kernel_on_cuda():
    batch = random_batches(1, rows=4, seq=64)[0]
    res = spawn(fused_norm_rank, 1, batch, ["trainer.device=cuda"], device="cuda")[0]
    assert res["old_warned"], "the check must see the old path's warning"
    assert not res["new_warned"]
