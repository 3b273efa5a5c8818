"""The scheduler-store patch of CPU servers (rl/generator/loopback_store.py), without a
server: only a loopback ``tcp://`` method becomes a file, and the patch goes in once.
A server listening on nothing but loopback: tests/servers/test_generator_launcher.py."""

from __future__ import annotations

import types

import pytest

from rl.generator import loopback_store as ls


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
