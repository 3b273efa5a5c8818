"""``trainer.attention=sdpa`` (rl/models/sdpa_attention.py, the default) computes what
Megatron's ``DotProductAttention`` computes: the same tiny GQA GPTModel's logits and every
parameter's gradient agree within TOL in fp32 on CPU, the module agrees under a padding
mask and for a one-position decode, and what it cannot do it refuses in one line naming
the way back. The bf16 comparison on a GPU is tests/gpu/test_attention_cuda.py."""

from __future__ import annotations

import pytest
import torch

from rl.runtime.launch import spawn
from tests.helpers.attention_workers import TINY, gpt_outputs, module_cases

# fp32, 2 layers: measured 5e-7 (logits) and 5e-7 (largest gradient error over the
# gradient's own scale); the kernels sum the softmax in another order, nothing more. A
# wrong mask, scale or head grouping shows up as errors of order 1e-1.
TOL = 5e-6


@pytest.fixture(scope="module")
def outputs():
    tokens = torch.randint(0, 32, (2, 48), generator=torch.Generator().manual_seed(0))
    runs = [("dot_product", "float32"), ("sdpa", "float32")]
    return spawn(gpt_outputs, 1, TINY, runs, tokens, False)[0]


def test_logits_and_grads_match_dot_product_attention_in_fp32(outputs):
    assert outputs["core"] == ["DotProductAttention", "SDPAttention"]
    ref, new = outputs["logits"]
    assert ref.abs().max() > 0.1  # the comparison is not of zeros
    assert (ref - new).abs().max() < TOL
    gref, gnew = outputs["grads"]
    assert sorted(gref) == sorted(gnew)
    for name, g in gref.items():
        assert g.abs().max() > 0, name  # every parameter is reached
        assert (g - gnew[name]).abs().max() <= TOL * g.abs().max(), name


def test_masks_decode_and_refusals():
    res = spawn(module_cases, 1)[0]
    assert res["causal"] < TOL and res["padding_mask"] < TOL and res["decode"] < TOL
    for name, what in (("dropout", "attention dropout 0.1"), ("softmax", "off-by-one"),
                       ("window", "sliding-window")):  # fmt: skip
        msg = res["refusals"][name]
        assert msg is not None and what in msg and "trainer.attention=dot_product" in msg, msg
        assert "\n" not in msg
