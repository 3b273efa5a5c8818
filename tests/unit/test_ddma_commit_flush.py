"""A commit never leaves a server serving a new version over the old version's cached KV
(rl/generator/ddma_target.py, ``SGLangTarget.commit``): the real target, over HTTP, into
stand-in servers that answer SGLang 0.5.23's routes and run the real DDMA receiver in this
process, whose ``/flush_cache`` refuses as SGLang's does when its scheduler is not idle
(HTTP 400, "Flush cache failed."). Refused once, the flush is retried and the version
lands; refused for good, the version is aborted on that server (it keeps the previous
weights, says so in one line) and the controller's push reports it lost while the others
take the version. Under a second."""

from __future__ import annotations

import base64
import json
import pickle
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from threading import Thread

import pytest
import torch

from rl.controller.weight_sync import WeightSync
from rl.ddma import sender as sender_module
from rl.ddma import sglang_receiver as rx
from rl.ddma.sender import Sender
from rl.generator.ddma_target import NotFlushed, SGLangTarget
from rl.serving import server_api as api
from tests.unit.test_ddma_lifecycle import (
    F32,
    PLAN,
    SenderHandle,
    _assert_holds,
    _expected,
    _model,
    _shards,
)

NOT_IDLE = "Flush cache failed.\n"  # SGLang's body when its scheduler was not idle
_LOAD = threading.Lock()  # the receiver SGLang's worker calls is a module global


class StandIn(ThreadingHTTPServer):
    """One SGLang server: its weights (all 0.5 at version 0), its own receiver, and a
    flush that refuses the first ``refuse`` times. ``log``: the routes and DDMA ops, in
    the order the server saw them."""

    def __init__(self, refuse: int = 0) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.model, self.receiver = _model(), rx.Receiver()
        self.refuse, self.version = refuse, 0
        self.log: list[str] = []
        Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters())

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: StandIn

    def _answer(self, status: int, text: str) -> None:
        self.send_response(status)
        self.end_headers()
        self.wfile.write(text.encode())

    def do_GET(self) -> None:  # /model_info
        self._answer(200, json.dumps({"weight_version": str(self.server.version)}))

    def do_POST(self) -> None:
        s, route = self.server, self.path
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        if route == "/update_weights_from_tensor":  # one entry per rank: this server has one
            (entry,) = [pickle.loads(base64.b64decode(e)) for e in body["serialized_named_tensors"]]
            s.log += [json.loads(name)["op"] for name, _ in entry]
            with _LOAD:
                rx.RECEIVER = s.receiver
                rx.load(s.model, entry)  # writes its status file, as SGLang's worker does
            return self._answer(200, json.dumps({"success": True, "message": "Success"}))
        s.log.append(route if route != "/pause_generation" else f"pause({body['mode']})")
        if route == "/update_weight_version":
            s.version = int(body["new_version"])
        if route == "/flush_cache" and s.refuse > 0:
            s.refuse -= 1
            return self._answer(400, NOT_IDLE)
        self._answer(200, "Cache flushed.\n" if route == "/flush_cache" else "{}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def serve(monkeypatch) -> Iterator:
    monkeypatch.setattr(rx, "RECEIVER", rx.RECEIVER)  # restored after the test
    monkeypatch.setattr(rx, "_tp_rank", lambda: 0)  # asking SGLang means importing it: ~9 s
    up: list[StandIn] = []

    def start(refuse: int = 0) -> StandIn:
        up.append(StandIn(refuse))
        return up[-1]

    yield start
    for s in up:
        s.stop()


def _target(server: StandIn, deadline: float = 10.0) -> SGLangTarget:
    return SGLangTarget(server.url, PLAN, F32, keys=api.ServerKeys.random(),
                        flush_deadline=deadline)  # fmt: skip


def _after_prepare(log: list[str]) -> list[str]:
    return log[log.index("prepare") + 1 :]


def test_a_flush_refused_once_is_retried_before_the_swap_and_the_version_lands(serve, capsys):
    server = serve(refuse=1)
    target = _target(server)
    target.begin(1)
    target.push(0, _shards(1), 1)
    target.commit(1)
    _assert_holds(server, _expected(_shards(1), 1))  # type: ignore[arg-type]
    assert server.version == 1
    # Refused, generation is retracted again and the flush retried: the cache is empty
    # before the weights change, and nothing runs until they have.
    assert _after_prepare(server.log) == [
        "/flush_cache", "pause(retract)", "/flush_cache", "commit", "/end_weight_update",
        "/update_weight_version", "/continue_generation",
    ]  # fmt: skip
    assert capsys.readouterr().out == ""
    target._senders[0].close()


def test_a_flush_refused_for_good_aborts_the_version_on_that_server_alone(serve, capsys,
                                                                        monkeypatch):  # fmt: skip
    """Through the controller's push: the server that never flushes keeps version 0's
    weights and reports version 0, resumes, and is reported lost; the other one serves
    version 1. One line names the server and the version."""
    shards = _shards(1)
    monkeypatch.setattr(sender_module, "source_rank", lambda layout, src: 0)
    monkeypatch.setattr(sender_module, "shard_getter", lambda model, plan, rank: shards)
    good, stuck = serve(), serve(refuse=10**6)
    targets = {good.url: _target(good), stuck.url: _target(stuck, deadline=0.3)}
    sender = Sender(torch.nn.Module(), None, plan=PLAN, dtype=F32, urls=list(targets),  # type: ignore[arg-type]
                    make_target=lambda url, *a, **k: targets[url], timeout=10,
                    transport="ipc")  # fmt: skip
    sync = WeightSync(SenderHandle(sender), list(targets.values()), weight_version=0)
    before = {n: t.clone() for n, t in stuck.params().items()}
    out = sync.push()
    assert (out.version, out.committed, out.lost, sync.weight_version) == (1, [0], [1], 1)
    _assert_holds(good, _expected(shards, 1))  # type: ignore[arg-type]
    _assert_holds(stuck, before)  # type: ignore[arg-type]
    assert (good.version, stuck.version) == (1, 0)
    tail = _after_prepare(stuck.log)
    assert "commit" not in tail and tail.count("/flush_cache") >= 3
    assert tail[-3:] == ["discard", "/end_weight_update", "/continue_generation"]
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith(f"[ddma] {stuck.url}: weight version 1 aborted on this server")
    assert f"(HTTP 400: {NOT_IDLE.strip()!r})" in line
    # What the target raises, for a caller of its own.
    stuck.refuse, target = 10**6, targets[stuck.url]
    target.begin(2)
    target.push(0, _shards(2), 2)
    with pytest.raises(NotFlushed, match=f"{stuck.url}: weight version 2 aborted"):
        target.commit(2)
    _assert_holds(stuck, before)  # type: ignore[arg-type]
    sender.close()
