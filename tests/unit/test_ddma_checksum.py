"""DDMA bucket integrity on any device: both checksum kinds catch a flipped byte and two
swapped words, a message names its kind so any receiver verifies it, and a DDMA group's
backend is chosen in one place. The device kind runs here on CPU; tests/gpu/ runs it on
CUDA and checks it gives the same value there."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rl.ddma import checksum as cks
from rl.ddma import group, transport, wire
from rl.ddma.plan import HEADER_BYTES, DstLayout, SrcLayout, make_plan
from tests.helpers.ddma_util import hf_state, megatron_globals, megatron_shards, model_dims
from tests.helpers.hf_models import make_model

ROOT = Path(__file__).resolve().parents[2]
KINDS = [cks.XXH3, cks.WSUM]
# Word counts around the chunk size, and lengths with a tail that is not a whole word.
SIZES = [8, 13, 4096 + 5, (cks.CHUNK_WORDS + 3) * 4 + 3]


def _payload(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("n", SIZES)
def test_a_flipped_byte_changes_the_sum(kind, n):
    x = _payload(n)
    want = kind(x)
    assert kind(x.clone()) == want  # deterministic
    for at in {0, 7, n // 2, n - 1}:
        for bit in (0x01, 0x80):
            y = x.clone()
            y[at] ^= bit
            assert kind(y) != want, (at, bit)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@pytest.mark.parametrize("n", SIZES[2:])
def test_two_swapped_words_change_the_sum(kind, n):
    x = _payload(n, seed=1)
    want = kind(x)
    words = n // 4
    pairs = [(0, 1), (0, words - 1), (3, 3 + 2), (words // 2, words // 2 + 64)]
    if words > cks.CHUNK_WORDS:  # the same position in two chunks
        pairs.append((1, cks.CHUNK_WORDS + 1))
    for i, j in pairs:
        y = x.clone()
        w = y[: words * 4].view(torch.int32)
        assert w[i] != w[j]
        w[i], w[j] = w[j].clone(), w[i].clone()
        assert kind(y) != want, (i, j)


def test_wsum_ignores_alignment_and_sees_length():
    x = _payload(4096 + 9, seed=2)
    odd = torch.empty(len(x) + 1, dtype=torch.uint8)[1:]  # the same bytes, not 4-aligned
    odd.copy_(x)
    assert odd.data_ptr() % 4 != 0
    assert cks.WSUM(odd) == cks.WSUM(x)
    assert cks.WSUM(x[:-1]) != cks.WSUM(x)
    zeros = torch.zeros(64, dtype=torch.uint8)
    assert cks.WSUM(zeros[:60]) != cks.WSUM(zeros)  # lengths differ, bytes all zero


def test_the_kind_follows_the_device():
    assert cks.for_device("cpu") is cks.XXH3
    assert cks.for_device(torch.device("cuda", 0)) is cks.WSUM
    assert cks.for_device("meta") is cks.WSUM


@pytest.fixture(scope="module")
def message(tmp_path_factory):
    path = make_model("llama", tmp_path_factory.mktemp("cks") / "llama")
    d = model_dims(path)
    plan = make_plan(d, SrcLayout(1), DstLayout(1), 4, 8192)
    shards = megatron_shards(megatron_globals(hf_state(path), d), plan, 0)
    return plan, lambda k, i: shards[(k, i)]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_any_receiver_verifies_a_message_by_the_kind_its_header_names(message, monkeypatch, kind):
    plan, src = message
    b = plan.buckets[0]
    monkeypatch.setattr(cks, "for_device", lambda device: kind)  # a sender on that device
    msg = wire.pack(torch.empty(plan.bucket_bytes, dtype=torch.uint8), plan, b, src,
                    torch.float32, 3)  # fmt: skip
    monkeypatch.undo()
    assert wire.read_header(msg)["magic"] == wire.MAGICS[kind.name]
    assert wire.read_header(msg)["checksum"] == kind(msg[HEADER_BYTES:])
    wire.verify(msg, plan, b, 3)  # a CPU receiver, whatever the sender's kind
    msg[HEADER_BYTES + 5] ^= 0x04
    with pytest.raises(wire.BucketError, match=f"{kind.name} checksum mismatch"):
        wire.verify(msg, plan, b, 3)


def test_a_ddma_group_backend_is_chosen_by_device():
    assert group.backend("cpu") == "gloo"
    assert group.backend(torch.device("cuda", 1)) == "cpu:gloo,cuda:nccl"
    with pytest.raises(ValueError, match="not device='mps'"):
        group.backend("mps")
    # Buckets lie on the GPU only when both ends are there; a CPU end takes host buffers.
    assert transport.link_device("cuda", "cuda") == "cuda"
    assert transport.link_device("cuda", "cpu") == transport.link_device("cpu", "cuda") == "cpu"
    assert group.local("cpu") == torch.device("cpu")


def test_no_backend_is_hard_coded_outside_the_group_factory():
    found = []
    for folder in ("rl/ddma", "rl/generator", "rl/controller"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            for n, line in enumerate(f.read_text().splitlines(), 1):
                if re.search(r"[\"'](gloo|nccl)[\"']", line) and f.name != "group.py":
                    found.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, found
