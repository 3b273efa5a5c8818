"""Same-host DDMA through shared memory (rl/ddma/shm.py), for real: trainer and generator
ranks as separate gloo processes, the buckets in /dev/shm rings, the group only
signalling. The generator's buffers must equal SGLang's own loaders' output, version
after version through the same rings; faults must name the bucket and the peer."""

from __future__ import annotations

import pytest
import torch

from rl.runtime.launch import spawn
from tests.helpers.ddma_shm_workers import shm_rank
from tests.helpers.ddma_util import rank_outcomes
from tests.helpers.hf_models import make_model
from tests.helpers.sglang_reference import sglang_rank_params


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model("llama", tmp_path_factory.mktemp("ddma_shm") / "llama")


@pytest.mark.parametrize("src,dst_tp", [((2, 1), 2), ((1, 2), 1)])
def test_versions_arrive_in_sglang_layout_through_kept_rings(llama, src, dst_tp):
    n_src = src[0] * src[1]
    out = spawn(shm_rank, n_src + dst_tp, str(llama), src, dst_tp, 3000, 2)
    for o in out[n_src:]:
        want = sglang_rank_params(llama, dst_tp, o["rank"])
        for v, got in enumerate(o["tensors"], start=1):
            assert set(got) == set(want)
            for name, t in want.items():
                torch.testing.assert_close(got[name], t * v, rtol=0, atol=0, msg=name)
        assert all(s.buffer_bytes == 0 for s in o["stats"])  # maps the senders' rings
    for o in out[:n_src]:
        first, second = o["rings"]
        assert first == second and len(first) == 1  # the same ring for both versions
        assert o["leftover"] == []  # unlinked once mapped: nothing left in /dev/shm
        assert all(s.buffer_bytes == 2 * 3000 for s in o["stats"])
    sent = sum(s.payload_bytes for o in out[:n_src] for s in o["stats"])
    received = sum(s.payload_bytes for o in out[n_src:] for s in o["stats"])
    assert sent == received > 0


def test_corrupted_bucket_is_refused(llama, tmp_path):
    with pytest.raises(RuntimeError, match="exited with code 3"):
        spawn(shm_rank, 3, str(llama), (2, 1), 1, 3000, 1, "corrupt", str(tmp_path),
              timeout_s=120)  # fmt: skip
    generator = rank_outcomes(tmp_path, 3)[2]
    assert "BucketError" in generator and "checksum mismatch" in generator
    assert "trainer rank 0 -> generator rank 0" in generator


def test_generator_disconnect_fails_the_sender(llama, tmp_path):
    with pytest.raises(RuntimeError, match="exited with code"):
        spawn(shm_rank, 3, str(llama), (2, 1), 1, 3000, 1, "disconnect", str(tmp_path),
              timeout_s=120)  # fmt: skip
    out = rank_outcomes(tmp_path, 3)
    assert out[2] == "disconnected"
    senders = [o for o in out[:2] if o]
    assert senders and all("TransferError" in o and "generator rank 2" in o for o in senders), out
