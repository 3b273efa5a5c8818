"""Megatron-Core MoE on CPU/gloo: the three MoE patches, and expert parallelism is exact.

The patch checks run in one fresh rank (the patches mutate Megatron's modules): first the
failures each patch exists for, then each patch applied twice, then the same calls.
The parity test trains a tiny GPTModel with MoE layers (4 experts, top-2, aux loss on)
for 3 Adam steps on one batch: EP=2 on 2 gloo ranks (each rank 2 experts and half the
batch) must give the losses of EP=1 on one rank, for both token dispatchers.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl.runtime.launch import spawn
from tests.helpers.moe_workers import NUM_EXPERTS, patch_checks, train_moe

DISPATCHERS = ["alltoall", "allgather"]
STEPS = 3
RTOL = 1e-5


@pytest.fixture(scope="module")
def checks() -> dict:
    return spawn(patch_checks, 1, setup=False, fresh=True)[0]  # nothing patched yet


def test_without_the_moe_patches_moe_fails(checks: dict) -> None:
    """The failures the three patches exist for (so the tests below mean something)."""
    before = checks["before"]
    assert checks["base_applied"]
    assert not before["has_te_general_gemm"]
    assert before["forward_allgather"].startswith("NameError"), before
    assert before["alltoall_dispatcher"] != "ok"  # torch.cuda.Stream() without CUDA
    assert before["dtoh_stream"] == "None"
    assert before["host_splits_type"] == "Tensor"
    assert before["all_to_all_tensor_splits"].startswith("TypeError"), before


def test_moe_patches_apply_once(checks: dict) -> None:
    assert checks["first"] == [True, True, True]
    assert checks["second"] == [False, False, False]
    assert checks["applied"] == ["moe_cuda_stream", "moe_split_sizes", "moe_te_gemm"]


def test_te_general_gemm_is_none(checks: dict) -> None:
    after = checks["after"]
    assert after["te_general_gemm"] == "None"
    assert math.isfinite(after["forward_allgather"])


def test_alltoall_dispatcher_gets_a_null_stream(checks: dict) -> None:
    after = checks["after"]
    assert after["alltoall_dispatcher"] == "ok"
    assert not after["stream_is_cuda"]
    assert after["stream_ops"] == ["None", "None"]  # wait_stream; record_event().synchronize()
    # Same weights, same batch: the two dispatchers give one loss at EP=1.
    assert after["forward_alltoall"] == pytest.approx(after["forward_allgather"], rel=1e-6)


def test_split_sizes_reach_all_to_all_as_numpy(checks: dict) -> None:
    after = checks["after"]
    assert after["host_splits_type"] == "ndarray"
    assert after["host_splits"] == "array([3])"
    assert after["not_numpy_is_same"]  # as_numpy=False: the tensor itself, as before
    assert after["moe_utils_original_kept"]  # only the dispatcher's reference is replaced
    assert after["all_to_all_numpy_splits"] == [0.0, 1.0, 2.0]


@pytest.fixture(scope="module")
def ep1() -> dict:
    return spawn(train_moe, 1, DISPATCHERS, 1, STEPS)[0]


@pytest.fixture(scope="module")
def ep2() -> list[dict]:
    return spawn(train_moe, 2, DISPATCHERS, 2, STEPS)


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_reference_learns(ep1: dict, dispatcher: str) -> None:
    """The comparison means something only if the steps change the model."""
    ref = ep1[dispatcher]
    assert ep1["ep_size"] == 1 and ref["local_expert_indices"] == list(range(NUM_EXPERTS))
    assert len(ref["losses"]) == STEPS
    assert ref["losses"][-1] < ref["losses"][0] - 0.5, ref["losses"]


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_ep2_matches_ep1(ep1: dict, ep2: list[dict], dispatcher: str) -> None:
    ref = ep1[dispatcher]
    for rank, r in enumerate(ep2):
        assert (r["ep_size"], r["ep_rank"], r["dp_size"]) == (2, rank, 2)
        got = r[dispatcher]
        torch.testing.assert_close(got["losses"], ref["losses"], rtol=RTOL, atol=0)
        torch.testing.assert_close(got["aux_losses"], ref["aux_losses"], rtol=RTOL, atol=0)
        # Each rank holds its half of the experts, named by local index.
        half = NUM_EXPERTS // 2
        assert got["local_expert_indices"] == list(range(rank * half, (rank + 1) * half))
        assert [n.split("local_experts.")[1] for n in got["expert_params"]] == [
            f"{i}.{fc}.weight" for i in range(half) for fc in ("linear_fc1", "linear_fc2")
        ]
        assert got["local_params"] < ref["local_params"]


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_router_aux_loss_is_logged(ep1: dict, ep2: list[dict], dispatcher: str) -> None:
    """Megatron's tracker reports the load-balancing loss (aux / coeff, per MoE layer):
    finite, positive, and about 1 (its value for a uniform router) on this tiny model."""
    for aux in [ep1[dispatcher]["aux_losses"], *(r[dispatcher]["aux_losses"] for r in ep2)]:
        assert all(math.isfinite(a) and 0.5 < a < 2.0 for a in aux), aux
