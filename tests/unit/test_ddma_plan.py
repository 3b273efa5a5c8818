"""The DDMA planner and wire format, in one process (milliseconds per case).

Every Megatron TP x PP -> SGLang TP combination is planned and checked for exact coverage
and byte accounting. tests/servers/test_ddma_sglang_loaders.py executes the same plans and
compares every destination shard with what SGLang's own weight loaders make of the full HF
weights.
"""

from __future__ import annotations

import pytest
import torch

from rl.ddma import wire
from rl.ddma.plan import (
    DstLayout,
    PlanError,
    SrcLayout,
    coverage_errors,
    is_scale,
    make_plan,
    scale_name,
)
from rl.weights import keymap as km
from tests.helpers.ddma_util import (
    COMBOS,
    hf_state,
    make_models,
    megatron_globals,
    model_dims,
)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("ddma_models"))


@pytest.fixture(params=["llama", "llama_tied", "qwen2"])
def ckpt(request, ckpts):
    return request.param, ckpts[request.param]


@pytest.mark.parametrize("kind,src_tp,src_pp,dst_tp", COMBOS)
def test_every_destination_byte_is_written_once(ckpts, kind, src_tp, src_pp, dst_tp):
    path = ckpts[kind]
    d = model_dims(path)
    plan = make_plan(d, SrcLayout(src_tp, src_pp), DstLayout(dst_tp), 4, 4096)
    assert coverage_errors(plan) == []
    # No broadcast of whole tensors: the wire carries exactly the destination's bytes.
    assert plan.sent_bytes() == plan.dst_bytes(real_only=True)
    for b in plan.buckets:
        assert b.nbytes <= plan.bucket_bytes
        assert b.src < plan.src.world and b.dst < dst_tp
    for r in range(plan.rounds()):
        this = [b for b in plan.buckets if b.round == r]
        assert len({b.src for b in this}) == len(this) == len({b.dst for b in this})
    # Each pair's buckets keep their order and the global order is by round.
    assert [b.round for b in plan.buckets] == sorted(b.round for b in plan.buckets)


def test_same_tp_sends_rank_to_rank(ckpt):
    """Megatron TP=2 -> SGLang TP=2: each generator rank is fed by its own trainer rank,
    except the replicated norms (spread over both) and vocab rows (the two sides pad the
    vocab differently, so shard boundaries differ)."""
    _, path = ckpt
    plan = make_plan(model_dims(path), SrcLayout(2), DstLayout(2), 4, 1 << 20)
    for b in plan.buckets:
        for p in b.pieces:
            if km.tp_dim(p.key) is not None and p.key not in (km.EMBED, km.OUTPUT):
                assert b.src == b.dst, p


def test_data_parallel_replicas_share_the_sending(ckpt):
    _, path = ckpt
    plan = make_plan(model_dims(path), SrcLayout(2, 1, dp=2), DstLayout(2), 4, 1 << 20)
    assert coverage_errors(plan) == []
    sent = [sum(plan.piece_bytes(p) for b in plan.sends(r) for p in b.pieces) for r in range(4)]
    assert min(sent) > 0.6 * max(sent), sent


def test_uneven_pipeline_stages(ckpt):
    _, path = ckpt
    d = model_dims(path)
    plan = make_plan(d, SrcLayout(1, 2, layers_per_stage=(1, 3)), DstLayout(2), 4, 4096)
    layers_from = {b.src: set() for b in plan.buckets}
    for b in plan.buckets:
        layers_from[b.src] |= {p.layer for p in b.pieces if p.layer is not None}
    assert layers_from[0] == {0} and layers_from[1] == {1, 2, 3}


def test_digest_differs_with_anything_that_changes_bytes(ckpt):
    _, path = ckpt
    d = model_dims(path)
    base = make_plan(d, SrcLayout(2), DstLayout(2), 4, 4096).digest
    assert make_plan(d, SrcLayout(2), DstLayout(2), 4, 4096).digest == base
    for other in (
        make_plan(d, SrcLayout(1), DstLayout(2), 4, 4096),
        make_plan(d, SrcLayout(2), DstLayout(1), 4, 4096),
        make_plan(d, SrcLayout(2), DstLayout(2), 2, 4096),
        make_plan(d, SrcLayout(2), DstLayout(2), 4, 8192),
        make_plan(km.Dims(**{**d.__dict__, "layers": 2}), SrcLayout(2), DstLayout(2), 4, 4096),
    ):
        assert other.digest != base


@pytest.mark.parametrize(
    "src,dst,match",
    [
        (SrcLayout(3), DstLayout(1), "trainer.tp=3 does not divide num_attention_heads=4"),
        (SrcLayout(1), DstLayout(8), "rollout.tp=8 does not divide num_attention_heads=4"),
        (SrcLayout(4, 1), DstLayout(1), "trainer.tp=4 does not divide num_query_groups=2"),
        (SrcLayout(1, 3), DstLayout(1), r"do not split 4 layers over pp=3"),
        (SrcLayout(1, 2, layers_per_stage=(2, 3)), DstLayout(1), r"\[2, 3\]"),
    ],
)
def test_bad_layouts_are_named(ckpt, src, dst, match):
    _, path = ckpt
    with pytest.raises(PlanError, match=match):
        make_plan(model_dims(path, src_tp=1), src, dst, 4, 4096)


def test_bucket_bound_and_minimum(ckpt):
    _, path = ckpt
    d = model_dims(path)
    with pytest.raises(PlanError, match="bucket_bytes=16"):
        make_plan(d, SrcLayout(1), DstLayout(1), 4, 16)
    small = make_plan(d, SrcLayout(1), DstLayout(1), 4, 1024)
    assert max(b.nbytes for b in small.buckets) <= 1024
    assert coverage_errors(small) == []


# ------------------------------------------------------------------ wire format
@pytest.fixture
def packed(ckpt):
    _, path = ckpt
    d = model_dims(path)
    plan = make_plan(d, SrcLayout(2), DstLayout(2), 4, 4096)
    glob = megatron_globals(hf_state(path), d)
    from tests.helpers.ddma_util import megatron_shards

    shards = megatron_shards(glob, plan, plan.buckets[0].src)
    b = plan.buckets[0]
    buf = torch.empty(plan.bucket_bytes, dtype=torch.uint8)
    msg = wire.pack(buf, plan, b, lambda k, i: shards[(k, i)], torch.float32, 7)
    return plan, b, msg


def test_verify_accepts_intact_message(packed):
    plan, b, msg = packed
    wire.verify(msg, plan, b, 7)


def test_verify_rejects_flipped_payload_byte(packed):
    plan, b, msg = packed
    msg[b.nbytes - 1] ^= 0x10
    with pytest.raises(wire.BucketError, match="checksum mismatch"):
        wire.verify(msg, plan, b, 7)


def test_verify_rejects_other_version_and_plan(packed, ckpt):
    plan, b, msg = packed
    with pytest.raises(wire.BucketError, match="carries version 7, expected 8"):
        wire.verify(msg, plan, b, 8)
    other = make_plan(plan.dims, SrcLayout(2), DstLayout(1), 4, 4096)
    with pytest.raises(wire.BucketError, match="architecture, layouts"):
        wire.verify(msg, other, other.buckets[0], 7)
    with pytest.raises(wire.BucketError, match=f"got bucket {b.index}"):
        wire.verify(msg, plan, plan.buckets[1], 7)


def test_fp8_refuses_pieces_off_block_boundaries(ckpts):
    # SGLang TP=2 splits the MLP at row 88 of 176: not a multiple of 16.
    with pytest.raises(PlanError, match=r"fp8_block=16: model.layers.0.mlp.gate_up_proj.weight"):
        make_plan(model_dims(ckpts["llama"]), SrcLayout(1), DstLayout(2), 4, 4096, fp8_block=16)
    with pytest.raises(PlanError, match="GPU layout"):
        make_plan(model_dims(ckpts["llama"]), SrcLayout(1), DstLayout.sglang(1, "cpu"), 4, 4096,
                  fp8_block=16)  # fmt: skip


def test_fp8_expert_slabs_are_quantized_with_their_fused_scales(ckpts):
    """A routed expert's slab travels as FP8, and its scales land in the same slab of
    FusedMoE's fused scale (``w13_weight_scale_inv[e]``); the router stays in dtype. An
    expert split off block boundaries (gate 32 wide: 16 per rank at SGLang TP 2, not a
    block of 32) is refused."""
    d = model_dims(ckpts["qwen3_moe"])
    plan = make_plan(d, SrcLayout(1), DstLayout(2), 4, 4096, fp8_block=16)
    w13, w2 = "model.layers.0.mlp.experts.w13_weight[3]", "model.layers.1.mlp.experts.w2_weight[0]"
    assert plan.quantized(w13) and plan.quantized(w2)
    assert not plan.quantized("model.layers.0.mlp.gate.weight")
    assert scale_name(w13) == "model.layers.0.mlp.experts.w13_weight_scale_inv[3]"
    assert scale_name("a.qkv_proj.weight") == "a.qkv_proj.weight_scale_inv"
    assert is_scale(scale_name(w13)) and not is_scale(w13)
    assert plan.dst_shapes[scale_name(w13)] == (2, 4)  # [2 * 16 / 16, 64 / 16]
    assert plan.dst_shapes[scale_name(w2)] == (4, 1)  # [64 / 16, 16 / 16]
    off_block = r"experts.w13_weight\[0\] on generator rank 0 takes \[0, 16\)"
    with pytest.raises(PlanError, match=off_block):
        make_plan(d, SrcLayout(1), DstLayout(2), 4, 4096, fp8_block=32)


def test_servers_are_started_with_this_receiver():
    from rl.ddma import sglang_receiver
    from rl.serving.launcher import ServerConfig
    from rl.serving.server_api import DDMA_LOAD_FORMAT

    assert f"{sglang_receiver.__name__}.{sglang_receiver.load.__name__}" == DDMA_LOAD_FORMAT
    argv = ServerConfig(model_path="m").argv(1234)
    assert argv[argv.index("--custom-weight-loader") + 1] == DDMA_LOAD_FORMAT
