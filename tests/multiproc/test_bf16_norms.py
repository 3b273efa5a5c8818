"""bf16 training keeps its norm weights in bf16 (rl/models/megatron_gpt.py,
``norms_in_compute_dtype``), so torch runs its fused RMSNorm kernel, while the optimizer
keeps their fp32 master copies as for every other weight. Checked on the host in bf16: no
"Cannot dispatch to fused implementation" warning (the old path, float32 norms, warns);
the norms train; a checkpoint of the old path resumes with its exact master weights and
Adam moments; and fp32 training is unchanged bit for bit."""

from __future__ import annotations

import pytest

from rl.runtime.launch import spawn
from tests.helpers.attention_workers import norm_paths_rank
from tests.helpers.workers import random_batches


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("ckpt") / "old")
    return spawn(norm_paths_rank, 1, random_batches(2, rows=4), ckpt)[0]


def test_bf16_norms_run_fused_and_train_from_fp32_master_copies(res):
    assert res["old_dtypes"] == ["torch.bfloat16", "torch.float32"] and res["old_warned"]
    assert res["new_dtypes"] == ["torch.bfloat16"] and not res["new_warned"]
    assert res["main_dtypes"] == ["torch.float32"] and res["rounded_main"]
    assert res["moved"] > 0  # lr 1e-2: the norm weights step by about one bf16 ulp at 1.0


def test_a_checkpoint_with_fp32_norms_resumes_exactly(res):
    assert res["loaded_exact"] and res["loaded_rounded"]


def test_fp32_training_is_unchanged_bit_for_bit(res):
    assert res["fp32_bit_equal"]
