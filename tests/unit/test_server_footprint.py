"""The footprint patches of CPU servers (rl/serving/server_footprint.py), without a
server: only a loopback ``tcp://`` store becomes a file, tqdm makes no multiprocessing
lock, and each patch goes in once. A server listening on nothing but loopback and leaving
no semaphore: tests/servers/test_generator_launcher.py."""

from __future__ import annotations

import types

import pytest

from rl.serving import server_footprint as ls


@pytest.mark.parametrize(
    ("method", "expect"),
    [
        ("tcp://127.0.0.1:29500", "file:///run/s.store"),
        ("tcp://localhost:1", "file:///run/s.store"),
        ("tcp://[::1]:29500", "file:///run/s.store"),
        ("tcp://10.0.0.7:29500", "tcp://10.0.0.7:29500"),  # a group spanning nodes
        ("env://", "env://"),
        (None, None),
    ],
)
def test_only_a_loopback_tcp_store_becomes_a_file(method, expect):
    assert ls.local_method(method, "/run/s.store") == expect


def test_a_relative_store_path_becomes_an_absolute_file_url(tmp_path, monkeypatch):
    """``file://outputs/s.store`` would name host "outputs": the main job's relative
    output directory hung its server at the store."""
    monkeypatch.chdir(tmp_path)
    got = ls.local_method("tcp://127.0.0.1:5", "outputs/s.store")
    assert got == f"file://{tmp_path}/outputs/s.store"


def test_the_bootstrap_is_wrapped_once(monkeypatch):
    seen = []
    module = types.ModuleType(ls.BOOTSTRAP)
    module.init_distributed_environment = lambda **kw: seen.append(kw["distributed_init_method"])
    ls.patch_bootstrap(module)
    ls.patch_bootstrap(module)
    monkeypatch.setenv(ls.STORE_ENV, "/run/s.store")
    module.init_distributed_environment(distributed_init_method="tcp://127.0.0.1:5")
    monkeypatch.delenv(ls.STORE_ENV)
    module.init_distributed_environment(distributed_init_method="tcp://127.0.0.1:5")
    assert seen == ["file:///run/s.store", "tcp://127.0.0.1:5"]


def test_tqdm_makes_no_semaphore():
    """tqdm makes its lock only if the class has none: with ``mp_lock`` set to None, no
    named semaphore (``/dev/shm/sem.mp-*``, left behind by a killed process tree)."""

    class Lock:  # tqdm.std.TqdmDefaultWriteLock's logic
        @classmethod
        def create_mp_lock(cls):
            if not hasattr(cls, "mp_lock"):
                cls.mp_lock = "a multiprocessing RLock"

    module = types.ModuleType(ls.TQDM)
    module.TqdmDefaultWriteLock = Lock
    ls.patch_tqdm(module)
    ls.patch_tqdm(module)
    Lock.create_mp_lock()
    assert Lock.mp_lock is None
