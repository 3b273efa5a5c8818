"""A server that a failed request marked dead, and that answers again, is routed to again
(rl/generator/client.py, ``_probe_lost``), against stand-in servers: first as behind, then
once a weight update reaches it. A server its generator rank is restarting is left to the
recovery, and a version adopted while a server was away does not make it routable."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread

import pytest

from rl.generator import client as gc
from rl.generator.types import ModelLimits
from rl.serving import server_api as api


class _Server(BaseHTTPRequestHandler):
    version = "3"  # what /model_info reports

    def _answer(self, text: str) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(text.encode())

    def do_GET(self) -> None:
        self._answer(json.dumps({"weight_version": self.version}))  # /model_info

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self._answer("Cache flushed.")  # /flush_cache

    def log_message(self, *args: object) -> None:
        pass


def _serve(port: int = 0) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Server)
    Thread(target=server.serve_forever, daemon=True).start()
    return server


def _stop(server: ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()


@pytest.fixture
def servers() -> Iterator[list[ThreadingHTTPServer]]:
    up = [_serve(), _serve()]
    yield up
    for s in up:
        _stop(s)


def _client(servers: list[ThreadingHTTPServer]) -> gc.GeneratorClient:
    urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
    return gc.GeneratorClient(urls, ModelLimits(100, 64), keys=api.ServerKeys.random())


def _until(what, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_server_that_answers_again_is_routed_to_after_the_next_update(
    servers, monkeypatch, capsys
):
    monkeypatch.setattr(gc, "PROBE_S", 0.1)
    with _client(servers) as client:
        port = servers[1].server_address[1]
        _stop(servers[1])
        client.flush_cache()  # server 1 refuses the connection: dead
        assert client.dead() == {1}
        time.sleep(0.5)  # probed a few times, still down
        assert client.dead() == {1} and client.stats()["revived_servers"] == 0
        servers[1] = _serve(port)
        _until(lambda: client.dead() == set())
        assert client.stats()["revived_servers"] == 1
        assert 1 in client._stale  # behind: it may not serve the client's version
        assert "generator server 1" in capsys.readouterr().out
        client.adopt_version(4, serving=[0, 1])  # the next weight update reached it
        assert client._stale == set()


def test_a_server_its_rank_restarts_is_left_to_the_recovery(servers, monkeypatch):
    """Reported lost by its rank, or back with an older version than the client had when
    its request failed (restarted, before its rank's report arrived)."""
    monkeypatch.setattr(gc, "PROBE_S", 0.1)
    with _client(servers) as client:
        client.mark_dead(1)  # its rank reported it lost
        port = servers[0].server_address[1]
        _stop(servers[0])
        client.flush_cache()  # server 0 refuses: dead, and probed
        monkeypatch.setattr(_Server, "version", "0")  # its start-up weights
        servers[0] = _serve(port)
        time.sleep(0.5)
        assert client.dead() == {0, 1}  # both answer, but only revive() routes to them
        client.revive(1)
        assert client.dead() == {0}


def test_a_version_adopted_while_a_server_was_away_leaves_it_behind(servers, monkeypatch):
    monkeypatch.setattr(gc, "PROBE_S", 60.0)  # no probe in this test
    with _client(servers) as client:
        port = servers[1].server_address[1]
        _stop(servers[1])
        client.flush_cache()
        assert client.dead() == {1}
        client.adopt_version(4)  # asks the live servers: server 0 does not report 4 either
        assert client._stale == {0, 1}
        servers[1] = _serve(port)
        client.revive(1)  # reports 3, not 4
        assert client.dead() == set() and client._stale == {0, 1}
