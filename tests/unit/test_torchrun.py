"""rl/runtime/torchrun.py without torchrun: a store it hosts listens on the one address
its name resolves to, a taken port fails as torch's own store fails (torchrun's fallback
to being a client depends on that), and a store only this node can reach is named once.
torchrun itself with it: tests/servers/test_main_job.py (no listener beyond loopback)."""

from __future__ import annotations

import socket
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist

from rl.runtime import torchrun


def _listening(port: int) -> list[str]:
    conns = psutil.Process().net_connections(kind="tcp")
    return [c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port]


def test_a_hosted_store_listens_on_its_address_only_and_serves_clients():
    server = torchrun.bound_store("localhost", 0, 2, True, timedelta(seconds=10),
                                  wait_for_workers=False)  # fmt: skip
    assert server.port > 0 and _listening(server.port) == ["127.0.0.1"]
    client = dist.TCPStore("localhost", server.port, 2, False, timedelta(seconds=10))
    client.set("k", "v")
    assert server.get("k") == b"v"
    # torch's own, given the same host, listens on every interface
    plain = dist.TCPStore("localhost", 0, 1, True, timedelta(seconds=10))
    assert _listening(plain.port) != ["127.0.0.1"]


def test_a_taken_port_fails_as_torchs_store_fails():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(dist.DistNetworkError, match="ddress already in use"):
            torchrun.bound_store("127.0.0.1", port, 1, True, timedelta(seconds=5))


def test_the_host_address_override_names_where_this_nodes_stores_listen(monkeypatch):
    assert torchrun.bind_address("localhost") == "127.0.0.1"
    monkeypatch.setenv(torchrun.HOST_ENV, "127.0.0.1")
    assert torchrun.bind_address("node7.example") == "127.0.0.1"


def test_a_store_other_hosts_cannot_reach_is_named_once(monkeypatch, capsys):
    monkeypatch.setattr(torchrun, "_warned", set())
    monkeypatch.setitem(torchrun._job, "nodes", 1)
    torchrun._warn_if_unreachable("node1", "127.0.1.1")  # one node: nobody else to reach it
    monkeypatch.setitem(torchrun._job, "nodes", 2)
    torchrun._warn_if_unreachable("localhost", "127.0.0.1")  # asked for loopback
    torchrun._warn_if_unreachable("node1", "10.0.0.1")
    assert capsys.readouterr().err == ""
    torchrun._warn_if_unreachable("node1", "127.0.1.1")
    torchrun._warn_if_unreachable("node1", "127.0.1.1")
    assert capsys.readouterr().err.splitlines() == [
        "torchrun: node1 resolves to 127.0.1.1 here, so agents on other hosts cannot reach "
        "the store it hosts; set MSRL_HOST_ADDRESS to this node's address"
    ]
