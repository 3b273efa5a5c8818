"""A weight update that fails because its receiver or server is gone before it opens the
payload leaves nothing of the sender's in ``/dev/shm``, neither after the failure nor
once the sender's process ended: the gloo-notified rings (rl/ddma/shm.py), the rings a
staged transport names over HTTP (rl/ddma/staged.py, ``ipc``), and the buckets of
``/update_weights_from_tensor`` (rl/generator/client.py, torch's ``file_system``
sharing); and a job killed mid-handshake, by the launcher's sweep. Servers are stand-ins
that are killed on (or refuse) the payload: a few seconds."""

from __future__ import annotations

import os

import pytest

from rl.runtime.launch import RankFailed, spawn
from tests.helpers.ddma_shm_workers import (
    http_update_rank,
    killed_mid_handshake,
    shm_files,
    shm_unmapped_rank,
    staged_push_rank,
)
from tests.helpers.hf_models import make_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_model("llama", tmp_path_factory.mktemp("shm_leaks") / "llama")


@pytest.mark.parametrize("how", ["exit", "refuse"])
def test_a_ring_no_receiver_mapped_is_unlinked(llama, how):
    trainer, generator = spawn(shm_unmapped_rank, 2, str(llama), how, timeout_s=120)
    assert "generator rank 1" in trainer["error"], trainer
    assert how == "exit" or "could not map" in generator["error"]
    assert trainer["left"] == []  # unlinked by the failed send itself
    assert trainer["rings"] == []  # the next send makes a fresh ring
    assert shm_files("ddma-", trainer["pid"]) == []  # and nothing once the rank ended


@pytest.mark.parametrize("how", ["killed", "refuses"])
def test_a_bucket_no_server_opened_is_unlinked(how):
    (out,) = spawn(http_update_rank, 1, how, 8 << 20, timeout_s=120)
    if how == "refuses":
        assert "refused before loading" in out["error"]
    assert out["left"] == []
    assert shm_files("torch_", out["pid"]) == []


@pytest.mark.parametrize("fault", ["killed", "pack"])
def test_a_staged_ring_is_unlinked_when_the_version_fails(fault):
    (out,) = spawn(staged_push_rank, 1, "ipc", fault, timeout_s=120)
    assert ("disconnected" if fault == "killed" else "no shard") in out["error"], out
    assert out["left"] == []
    assert shm_files("ddma-", out["pid"]) == []
    assert out["torch_left"] == []  # nor what named the slots in the lost request


def test_a_job_killed_mid_handshake_leaves_no_ring(tmp_path):
    """A trainer rank killed before its ring was mapped cannot unlink it: the launcher's
    sweep of a failed job does (rl/runtime/tree.py)."""
    with pytest.raises(RankFailed, match="before the handshake"):
        spawn(killed_mid_handshake, 2, str(tmp_path), setup=False, timeout_s=120)
    ring = (tmp_path / "ring").read_text()
    assert ring.startswith("/dev/shm/ddma-") and not os.path.exists(ring)
