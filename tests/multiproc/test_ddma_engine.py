"""The DDMA engine for real: trainer and generator ranks as separate gloo processes.

Trainer ranks hold Megatron shards of a Hugging Face checkpoint; generator ranks receive
into buffers in SGLang's layout, which must equal SGLang's own loaders' output. Faults
(a corrupted bucket, a generator that vanishes) must surface as errors that
name the bucket and the peer, on the side that saw them, instead of hanging.
"""

from __future__ import annotations

import pytest
import torch

from rl.runtime.launch import spawn
from tests.helpers.ddma_util import rank_outcomes
from tests.helpers.ddma_workers import ddma_rank
from tests.helpers.hf_models import make_model
from tests.helpers.sglang_reference import sglang_rank_params


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model("llama", tmp_path_factory.mktemp("ddma_engine") / "llama")


@pytest.mark.parametrize("src,dst_tp", [((2, 1), 2), ((1, 2), 1)])
def test_shards_arrive_in_sglang_layout(llama, src, dst_tp):
    n_src = src[0] * src[1]
    out = spawn(ddma_rank, n_src + dst_tp, str(llama), src, dst_tp, 3000)
    sent = sum(o["stats"].payload_bytes for o in out[:n_src])
    received = sum(o["stats"].payload_bytes for o in out[n_src:])
    assert sent == received
    for o in out[n_src:]:
        want = sglang_rank_params(llama, dst_tp, o["rank"])
        assert set(o["tensors"]) == set(want)
        for name, t in want.items():
            torch.testing.assert_close(o["tensors"][name], t, rtol=0, atol=0, msg=name)
        # Bounded memory: two buckets per rank, whatever the model size.
        assert o["stats"].buffer_bytes == 2 * 3000


@pytest.mark.parametrize(
    "src,dst_tp,replicas,relay",
    [((1, 1), 1, 2, "chain"), ((2, 1), 2, 2, "chain"), ((1, 1), 1, 3, "tree")],
    ids=["tp1-chain-2xtp1", "tp2-chain-2xtp2", "tp1-tree-3xtp1"],
)
def test_relay_servers_forward_the_trainer_buckets(llama, src, dst_tp, replicas, relay):
    """Only server 0 hears from the trainer; the others get every bucket from their parent
    server, forwarded unchanged while the next arrives, and hold SGLang's own layout."""
    from tests.helpers.ddma_workers import relay_rank

    n_src = src[0] * src[1]
    out = spawn(relay_rank, n_src + replicas * dst_tp, str(llama), src, dst_tp, replicas,
                relay, 3000)  # fmt: skip
    servers = out[n_src:]
    once = sum(o["stats"].payload_bytes for o in servers if o["replica"] == 0)
    assert sum(o["stats"].payload_bytes for o in out[:n_src]) == once  # each byte sent once
    for o in servers:
        assert o["stats"].payload_bytes == servers[o["rank"]]["stats"].payload_bytes
        want = sglang_rank_params(llama, dst_tp, o["rank"])
        assert set(o["tensors"]) == set(want)
        for name, t in want.items():
            torch.testing.assert_close(o["tensors"][name], t, rtol=0, atol=0, msg=name)
        assert o["stats"].buffer_bytes == 2 * 3000  # relaying takes no extra buffer
    # Each relaying rank forwards every message it received, once per child server: in a
    # chain every server but the last, in the tree (fan-out 2) server 0 to both others.
    children = [1] * (replicas - 1) + [0] if relay == "chain" else [2, 0, 0]
    for o in servers:
        s = o["stats"]
        assert s.wire_bytes > 0 and s.forwarded_bytes == children[o["replica"]] * s.wire_bytes


def test_fp8_buckets_over_gloo(llama):
    """Each trainer rank quantizes its own slices; the generator receives exactly the
    blocks and scales of quantizing SGLang's own weights."""
    from rl.ddma import fp8

    out = spawn(ddma_rank, 3, str(llama), (2, 1), 1, 3000, None, None, 8)
    got = out[2]["tensors"]
    for name, t in sglang_rank_params(llama, 1, 0).items():
        if fp8.is_quantized_weight(name):
            q, s = fp8.quantize_blockwise(t, 8)
            assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(got[name + "_scale_inv"], s), name
        else:
            assert torch.equal(got[name], t), name


def test_corrupted_bucket_is_refused(llama, tmp_path):
    with pytest.raises(RuntimeError, match="exited with code 3"):
        spawn(ddma_rank, 3, str(llama), (2, 1), 1, 3000, "corrupt", str(tmp_path), timeout_s=120)
    generator = rank_outcomes(tmp_path, 3)[2]
    assert "BucketError" in generator and "checksum mismatch" in generator
    assert "trainer rank 0 -> generator rank 0" in generator


def test_generator_disconnect_fails_the_sender(llama, tmp_path):
    with pytest.raises(RuntimeError, match="exited with code"):
        spawn(ddma_rank, 3, str(llama), (2, 1), 1, 3000, "disconnect", str(tmp_path), timeout_s=120)
    out = rank_outcomes(tmp_path, 3)
    assert out[2] == "disconnected"
    senders = [o for o in out[:2] if o]
    assert senders and all("TransferError" in o and "generator rank 2" in o for o in senders), out


def test_baseline_delivers_the_same_shards(llama):
    """The benchmark's baseline (gather to trainer rank 0, HF names, broadcast, slice)
    must produce the same generator shards, or its timings compare nothing."""
    from tests.helpers.ddma_workers import baseline_rank

    out = spawn(baseline_rank, 3, str(llama), 2, 1)
    want = sglang_rank_params(llama, 1, 0)
    got = out[2]["tensors"]
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=0, atol=0, msg=name)


def test_a_lost_relay_fails_only_the_servers_below_it_at_once(llama, tmp_path):
    """Server 1 of a chain 0 -> 1 -> 2 vanishes after its first bucket: the trainer and
    server 0 finish (server 0 reports its child lost), server 2 fails the version at once
    with UpstreamLost (stand-ins for what server 1 never forwarded), not after a timeout."""
    import time

    from tests.helpers.ddma_workers import relay_rank

    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code"):  # the workers exit early
        spawn(relay_rank, 4, str(llama), (1, 1), 1, 3, "chain", 3000, 2, 1, str(tmp_path),
              timeout_s=120)  # fmt: skip
    trainer, first, middle, last = rank_outcomes(tmp_path, 4)
    assert trainer == "ok lost=[]"
    assert first == "ok lost=[2]"  # group rank 2: server 1
    assert middle == "disconnected"
    assert last.startswith("UpstreamLost") and "relaying generator rank 2" in last, last
    assert time.monotonic() - t0 < 60  # the group's timeout is 120 s
