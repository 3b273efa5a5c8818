"""DDMA plans executed bucket by bucket and compared, bit for bit, with what SGLang's own
weight loaders make of the full HF weights (SGLang's real model classes, run in this
process at a faked TP rank by tests/helpers/sglang_reference.py): every Megatron TP x PP
(x EP) -> SGLang TP combination of tests/unit/test_ddma_plan.py, and FP8 payloads.
"""

from __future__ import annotations

import pytest
import torch

from rl.ddma import sglang_receiver as rx
from rl.ddma.layout import expert_owner
from rl.ddma.plan import DstLayout, SrcLayout, coverage_errors, make_plan
from tests.helpers.ddma_util import (
    COMBOS,
    FAMILY_COMBOS,
    expert_slabs,
    hf_state,
    make_models,
    megatron_globals,
    model_dims,
    run_in_process,
)
from tests.helpers.sglang_reference import sglang_rank_params, write_fp8_checkpoint


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return make_models(tmp_path_factory.mktemp("ddma_models"))


@pytest.mark.parametrize("kind,src_tp,src_pp,dst_tp", COMBOS)
def test_executed_plan_matches_sglang_loaders(ckpts, kind, src_tp, src_pp, dst_tp):
    path = ckpts[kind]
    d = model_dims(path)
    plan = make_plan(d, SrcLayout(src_tp, src_pp), DstLayout(dst_tp), 4, 2048)
    got = run_in_process(plan, megatron_globals(hf_state(path), d), torch.float32)
    for rank in range(dst_tp):
        want = sglang_rank_params(path, dst_tp, rank)
        assert set(got[rank]) == set(want)
        for name, t in want.items():
            torch.testing.assert_close(got[rank][name], t, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("kind,src_tp,src_pp,src_ep,dst_tp", FAMILY_COMBOS)
def test_every_family_matches_sglang_loaders(ckpts, kind, src_tp, src_pp, src_ep, dst_tp):
    """Megatron TP x PP (x EP) -> SGLang TP, bit for bit against SGLang's own loaders;
    with EP every expert comes from a trainer rank of its owner."""
    path = ckpts[kind]
    d = model_dims(path)
    src = SrcLayout(src_tp, src_pp, dp=src_ep, ep=src_ep)
    plan = make_plan(d, src, DstLayout(dst_tp), 4, 4096)
    assert coverage_errors(plan) == []
    assert plan.sent_bytes() == plan.dst_bytes(real_only=True)
    got = run_in_process(plan, megatron_globals(hf_state(path), d), torch.float32)
    for rank in range(dst_tp):
        want = expert_slabs(sglang_rank_params(path, dst_tp, rank), plan.dst_shapes)
        assert set(got[rank]) == set(want)
        for name, t in want.items():
            torch.testing.assert_close(got[rank][name], t, rtol=0, atol=0, msg=name)
    if src_ep > 1:
        for b in plan.buckets:
            for p in b.pieces:
                owner = expert_owner(d, src, p.key)
                assert owner is None or src.coords(b.src).ep == owner, p


# (model, block, Megatron tp, pp, ep, SGLang tp): FP8 blocks must not straddle a shard on
# either side, so each tiny model takes the largest block its widths allow (llama's MLP is
# 176 wide: 88 per rank at TP 2; the MoE experts 32: 16 per rank; qwen2_moe's shared
# expert 48: 24 per rank). Real models use 128 with widths to match.
FP8_COMBOS = [
    ("llama", 8, 1, 1, 1, 1),
    ("llama", 8, 2, 2, 1, 2),
    ("qwen3_moe", 16, 1, 1, 1, 1),
    ("qwen3_moe", 16, 2, 1, 2, 2),
    ("qwen3_moe", 16, 1, 2, 2, 1),
    ("qwen2_moe", 8, 2, 1, 2, 2),
]


@pytest.fixture(scope="module")
def fp8_ckpts(ckpts, tmp_path_factory):
    root = tmp_path_factory.mktemp("ddma_fp8")
    return {(k, b): write_fp8_checkpoint(ckpts[k], root / f"{k}_{b}", b)
            for k, b, *_ in FP8_COMBOS}  # fmt: skip


@pytest.mark.parametrize("kind,block,src_tp,src_pp,src_ep,dst_tp", FP8_COMBOS)
def test_fp8_plan_matches_sglang_fp8_loaders(
    ckpts, fp8_ckpts, kind, block, src_tp, src_pp, src_ep, dst_tp
):
    """Each trainer rank quantizes only its own slices (routed experts from their EP
    owner); every generator rank ends up with exactly the e4m3 bytes and float32 scales an
    FP8 SGLang server holds after loading the checkpoint quantized by SGLang's own block
    quantizer, through its FP8 linear and FusedMoE loaders (``w13_weight_scale_inv``,
    ``w2_weight_scale_inv``)."""
    path = ckpts[kind]
    d = model_dims(path)
    src = SrcLayout(src_tp, src_pp, dp=src_ep, ep=src_ep)
    plan = make_plan(d, src, DstLayout(dst_tp), 4, 4096, fp8_block=block)
    assert coverage_errors(plan) == []
    assert plan.sent_bytes() == plan.dst_bytes()
    got = run_in_process(plan, megatron_globals(hf_state(path), d), torch.float32)
    for rank in range(dst_tp):
        held = sglang_rank_params(fp8_ckpts[(kind, block)], dst_tp, rank)
        # Llama's attention holds its KV cache's scales: not weights, never sent.
        want = expert_slabs({n: t for n, t in held.items() if not n.endswith(rx.KV_SCALES)},
                            plan.dst_shapes)  # fmt: skip
        assert set(got[rank]) == set(want)
        assert any(t.dtype == torch.float8_e4m3fn for t in want.values())
        for name, t in want.items():
            mine = got[rank][name]
            assert mine.dtype == t.dtype, name
            assert torch.equal(
                mine.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)
            ), name
    # FP8 sends about a quarter of the fp32 bytes of the linear layers.
    full = make_plan(d, src, DstLayout(dst_tp), 4, 4096)
    assert plan.sent_bytes() < 0.45 * full.sent_bytes()


def _module_of(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A module whose named parameters are ``params`` (copies), as a server's model."""
    root = torch.nn.Module()
    for name, t in params.items():
        mod = root
        *path, leaf = name.split(".")
        for part in path:
            if part not in mod._modules:
                mod.add_module(part, torch.nn.Module())
            mod = mod._modules[part]  # type: ignore[assignment]
        mod.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
    return root


def _receive_rank(plan, shards: dict, rank: int, staging: str, want: dict) -> None:
    """Generator rank ``rank`` of a server holding 0.5 everywhere (the served version):
    one version that misses its last bucket, then a complete one."""
    from rl.ddma import wire

    spec, f32 = rx.plan_spec(plan, torch.float32), torch.float32
    empty, buf = (
        torch.zeros(1, dtype=torch.uint8),
        torch.empty(plan.bucket_bytes, dtype=torch.uint8),
    )
    before = {n: torch.full_like(t, 0.5) for n, t in want.items()}
    model, recv = _module_of(before), rx.Receiver()

    def send(op: str, version: int, bucket=None) -> dict:
        ctl = {"op": op, "plan": spec, "version": version, "staging": staging}
        if bucket is None:
            return recv.handle(model, ctl, empty, rank)
        ctl.update(transport="cuda_ipc", shared=True)  # the bucket is the entry's tensor
        get = lambda k, i, s=shards[bucket.src]: s[(k, i)]  # noqa: E731
        return recv.handle(model, ctl, wire.pack(buf, plan, bucket, get, f32, version), rank)

    mine = plan.receives(rank)
    assert len(mine) > 2
    send("discard", 1)
    for b in mine[:-1]:
        send("receive", 1, b)
    with pytest.raises(ValueError, match=r"1 of \d+ buckets never arrived"):
        send("prepare", 1)
    untouched = all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert untouched == (staging != "none")
    assert recv.state()["torn"] == (staging == "none")

    send("discard", 2)
    for b in mine:
        send("receive", 2, b)
    assert send("prepare", 2)["ok"]
    state = send("commit", 2)
    assert state["committed"] == 2 and not state["torn"]
    held = sum(t.numel() * t.element_size() for t in want.values())
    assert state["staging_bytes"] == (0 if staging == "none" else held)
    got = dict(model.named_parameters())
    assert set(got) == set(want)
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("staging", ["device", "host", "none"])
@pytest.mark.parametrize(
    "kind,src", [("llama", SrcLayout(2)), ("qwen3_moe", SrcLayout(1, dp=2, ep=2))]
)
def test_receiver_staging_matches_sglang_loaders(ckpts, kind, src, staging):
    """The receiver as each SGLang TP rank runs it (rl.ddma.sglang_receiver), through each
    staging option: a version missing its last bucket changes no parameter (device, host)
    or leaves them torn (none); the complete version then leaves exactly what SGLang's
    own loaders make of the checkpoint, bit for bit, fused expert slabs included."""
    from tests.helpers.ddma_util import megatron_shards

    path = ckpts[kind]
    d = model_dims(path)
    plan = make_plan(d, src, DstLayout(2), 4, 4096)
    glob = megatron_globals(hf_state(path), d)
    shards = {r: megatron_shards(glob, plan, r) for r in range(src.world)}
    for rank in range(2):
        _receive_rank(plan, shards, rank, staging, sglang_rank_params(path, 2, rank))
