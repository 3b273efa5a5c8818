"""The shared-memory rings of rl/ddma/shm.py in one process: what a sender keeps, when it
needs a new ring, and that a receiver never creates a ring it was told to map."""

from __future__ import annotations

import os

import pytest

from rl.ddma import shm


@pytest.fixture
def rings():
    yield shm._rings
    for ring in shm._rings.values():
        ring.unlink()
    shm._rings.clear()


def test_a_ring_is_kept_until_an_unmapped_peer_needs_it(rings):
    group = object()  # rings are keyed by the group object, whatever it is
    ring = shm._ring(group, 4096, 2, {2, 3})  # type: ignore[arg-type]
    assert os.path.getsize(ring.path) == 2 * 4096 and ring.data.numel() == 2 * 4096
    assert shm._ring(group, 4096, 2, {2, 3, 4}) is ring  # type: ignore[arg-type]  # linked
    ring.mapped_by |= {2, 3}
    ring.unlink()
    assert not os.path.exists(ring.path)
    assert shm._ring(group, 4096, 2, {3}) is ring  # type: ignore[arg-type]  # mapped already
    fresh = shm._ring(group, 4096, 2, {4})  # type: ignore[arg-type]  # 4 cannot map it now
    assert fresh is not ring and os.path.exists(fresh.path)
    # Another group (even one that reuses a dead group's id) never gets this ring.
    assert shm._ring(object(), 4096, 2, {3}) is not fresh  # type: ignore[arg-type]


def test_slots_are_disjoint_views_of_one_mapping(rings):
    ring = shm._ring(object(), 64, 3, {1})  # type: ignore[arg-type]
    for i in range(3):
        ring.slot(i).fill_(i + 1)
    again = shm._map(ring.path, 3 * 64)  # what a receiver maps
    assert again.view(3, 64)[:, 0].tolist() == [1, 2, 3]


def test_a_receiver_maps_only_what_exists(tmp_path):
    missing = tmp_path / "gone"
    with pytest.raises(FileNotFoundError):
        shm._map(str(missing), 4096)
    assert not missing.exists()  # torch.from_file would have created it
    short = tmp_path / "short"
    short.write_bytes(b"x" * 100)
    with pytest.raises(OSError, match="holds 100 bytes, expected 4096"):
        shm._map(str(short), 4096)


def test_a_ring_needs_two_slots(rings):
    with pytest.raises(ValueError, match="depth=1"):
        shm._ring(object(), 64, 1, {1})  # type: ignore[arg-type]


def test_a_request_can_name_only_a_ring(rings, tmp_path):
    """map_ring maps what a request names: a DDMA ring in /dev/shm, nothing else."""
    other = tmp_path / "ddma-elsewhere"
    other.write_bytes(b"x" * 64)
    for path in (str(other), "/etc/passwd", "/dev/shm/../etc/passwd", "/dev/shm/not-a-ring"):
        with pytest.raises(ValueError, match="is not a DDMA ring"):
            shm.map_ring(path, 64)
    ring = shm._ring(object(), 64, 2, {1})  # type: ignore[arg-type]
    ring.slot(1).fill_(7)
    assert shm.map_ring(ring.path, 128)[64:].tolist() == [7] * 64
    ring.unlink()
    assert shm.map_ring(ring.path, 128)[64] == 7  # mapped once, kept
