"""Routing replay on the generator's side (rl/generator/routing.py, ``Rollout.routing``):
the rows a reply adds, which weights routed each row, the client's requests and what it
does with a reply that does not fit, the rows through a saved rollout state, and the CPU
server's host buffer patch, against a stand-in SGLang server (threads, no process). What
a live SGLang server returns: tests/servers/test_ddma_sglang_families.py."""

from __future__ import annotations

import base64
import json
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import Future
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import ModuleType
from typing import ClassVar

import numpy as np
import pytest
import torch

from rl.compose import compose
from rl.config.sampling import SamplingParams
from rl.controller import rollout_state
from rl.controller.rollouts import Group, RolloutStream, StreamState
from rl.controller.staleness import StalenessGate
from rl.generator import client as gc
from rl.generator import routing, service, startup
from rl.generator.types import ModelLimits, Rollout, RoutingShape, routing_versions
from rl.serving import cpu_routed_experts as cre
from rl.serving import server_api as api
from rl.serving.launcher import ServerConfig, ServerError, ServerLauncher
from rl.tasks.common import Example
from tests.helpers.fake_generator import ScriptedClient

SHAPE = RoutingShape(layers=2, topk=2, experts=6)


def experts(token: int) -> list[list[int]]:
    """The stand-in's routing of ``token``: a function of the token alone, per layer."""
    return [[(token + layer + k) % SHAPE.experts for k in range(SHAPE.topk)] for layer in (0, 1)]


def rows_of(ids: list[int]) -> torch.Tensor:
    return torch.tensor([experts(t) for t in ids], dtype=torch.int8).reshape(-1, 2, 2)


def b64(rows: list[list[list[int]]]) -> str:
    return base64.b64encode(np.array(rows, dtype="<i4").tobytes()).decode()


# ------------------------------------------------------------------ rows and versions
def test_a_rollouts_rows_follow_its_tokens_and_the_weights_that_routed_them():
    r = Rollout([1, 5, 6], SamplingParams(max_new_tokens=9))
    r.append([7, 8], [-0.1, -0.2], [3, 3], "length", rows_of([1, 5, 6, 7]))
    r.append([9, 2], [-0.3, -0.4], [4, 5], "stop", rows_of([8, 9]))  # resumed: 8 now an input
    r.observe([40, 41])  # an environment's tokens: rows come with the next turn
    assert r.routed == 6 and r.next_request(None)[0][6:] == [2, 40, 41]
    with pytest.raises(ValueError, match="2 routing rows for 3 new input tokens"):
        r.append([11], [-0.5], [6], None, rows_of([2, 40]))
    r.append([11, 12], [-0.5, -0.6], [6, 6], "stop", rows_of([2, 40, 41, 11]))
    assert torch.equal(r.routing, rows_of([1, 5, 6, 7, 8, 9, 2, 40, 41, 11]))
    assert r.routing.dtype == torch.int8 and r.routing.shape == (10, 2, 2)
    # Row i: the version of the next sampled token after token i (the observations' rows
    # were prefilled by the turn after them, not by the version they were stamped with).
    assert routing_versions(r) == [3, 3, 3, 3, 4, 5, 6, 6, 6, 6]
    assert r.versions[4:6] == [5, 5]
    assert routing_versions(Rollout([1, 2], SamplingParams())) == []
    # The rows it held between requests: a segment's came with it, an observation's not.
    assert [r.rows_at(n) for n in (0, 2, 4, 6, 8)] == [0, 4, 6, 6, 10]


def test_the_routing_shape_comes_from_the_config_and_sets_the_dtype(tmp_path):
    cfg = {"vocab_size": 99, "max_position_embeddings": 64, "num_hidden_layers": 3,
           "num_experts": 128, "num_experts_per_tok": 8}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert ModelLimits.from_model_dir(tmp_path).routing is None
    shape = ModelLimits.from_model_dir(tmp_path, routing=True).routing
    assert shape == RoutingShape(3, 8, 128) and shape.dtype == "int16"
    assert RoutingShape.from_config({**cfg, "num_experts": 127}).dtype == "int8"
    assert RoutingShape.from_config({"num_hidden_layers": 2, "n_routed_experts": 64,
                                     "num_experts_per_tok": 6}).experts == 64  # fmt: skip
    with pytest.raises(Exception, match="needs a Mixture-of-Experts model"):
        RoutingShape.from_config({"num_hidden_layers": 2})


def _reply(ids: list[int], start: int, extra: list | None = None) -> dict:
    rows = [experts(t) for t in ids[start:-1]] + (extra or [])
    return {"meta_info": {"routed_experts": b64(rows)}}


def test_a_reply_gives_the_rows_the_rollout_lacks_and_refuses_what_does_not_fit():
    r = Rollout([1, 5, 6], SamplingParams(max_new_tokens=9))
    r.append([7, 8], [-0.1, -0.2], [3, 3], "length", rows_of([1, 5, 6, 7]))
    seq = [1, 5, 6, 7, 8, 9, 10]  # two new tokens
    # Asked from row 2 (another rollout of the batch held 2): rows 2, 3 are dropped.
    got = routing.new_rows(_reply(seq, 2), r, 2, 2, SHAPE)
    assert torch.equal(got, rows_of([8, 9])) and got.dtype == torch.int8
    with pytest.raises(routing.RoutingMismatch, match=r"12 routed expert ids, expected 2 rows"):
        routing.new_rows(_reply(seq, 4, [experts(0)]), r, 2, 4, SHAPE)
    wide = RoutingShape(2, 3, 6)  # another top-k: the byte count differs
    with pytest.raises(routing.RoutingMismatch, match="x top-3"):
        routing.new_rows(_reply(seq, 4), r, 2, 4, wide)
    bad = {"meta_info": {"routed_experts": b64([[[0, 6], [1, 2]], [[0, 1], [1, 2]]])}}
    with pytest.raises(routing.RoutingMismatch, match=r"span \[0, 6\], the model has 6"):
        routing.new_rows(bad, r, 2, 4, SHAPE)
    with pytest.raises(routing.RoutingMissing, match="no routed_experts"):
        routing.new_rows({"meta_info": {}}, r, 2, 4, SHAPE)
    empty = {"meta_info": {"routed_experts": ""}}  # aborted before a token: no new input
    assert routing.new_rows(empty, r, 0, 4, SHAPE).shape == (0, 2, 2)


# ------------------------------------------------------------------ the client
class _SGLang(BaseHTTPRequestHandler):
    """``/generate`` as SGLang answers it with ``--enable-return-routed-experts``, each new
    token the last plus one; ``script`` says how the next replies misbehave."""

    bodies: ClassVar[list[dict]] = []
    script: ClassVar[list[str]] = []  # "ok", "extra_row", "no_routing", "queued_abort"

    def _answer(self, reply: object) -> None:
        self.send_response(200)
        self.end_headers()
        self.wfile.write(json.dumps(reply).encode())

    def do_GET(self) -> None:
        self._answer({"weight_version": "0"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(body)
        how = self.script.pop(0) if self.script else "ok"
        one = isinstance(body["input_ids"][0], int)
        inputs = [body["input_ids"]] if one else body["input_ids"]
        sps = [body["sampling_params"]] if one else body["sampling_params"]
        outs = []
        for ids, sp in zip(inputs, sps, strict=True):
            new = (
                []
                if how == "queued_abort"
                else [ids[-1] + 1 + i for i in range(sp["max_new_tokens"])]
            )
            meta = {"finish_reason": {"type": "abort" if how == "queued_abort" else "length"},
                    "output_token_logprobs": [[-0.5, t, None] for t in new],
                    "weight_version": "0"}  # fmt: skip
            if body.get("return_routed_experts") and how not in ("no_routing", "queued_abort"):
                seq = ids + new
                rows = [experts(t) for t in seq[body["routed_experts_start_len"] : -1]]
                meta["routed_experts"] = b64(rows + ([experts(0)] if how == "extra_row" else []))
            outs.append({"output_ids": new, "meta_info": meta})
        self._answer(outs[0] if one else outs)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def client() -> Iterator[gc.GeneratorClient]:
    _SGLang.bodies, _SGLang.script = [], []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SGLang)
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    limits = ModelLimits(99, 128, (2,), routing=SHAPE)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    with gc.GeneratorClient([url], limits, keys=api.ServerKeys.random()) as c:
        yield c
    server.shutdown()
    server.server_close()


def test_partial_rollouts_ask_from_the_rows_they_hold_and_keep_one_per_input(client):
    (r,) = client.generate([[5, 6, 7]], SamplingParams(max_new_tokens=5), segment_tokens=2)
    assert r.output_ids == [8, 9, 10, 11, 12] and r.segments == 3
    assert [b["routed_experts_start_len"] for b in _SGLang.bodies] == [0, 4, 6]
    assert all(b["return_routed_experts"] is True for b in _SGLang.bodies)
    assert torch.equal(r.routing, rows_of([5, 6, 7, 8, 9, 10, 11]))
    # One batch of rollouts holding 4 and 3 rows: asked from 3, each keeps its own.
    a, b = (
        Rollout([5, 6, 7], SamplingParams(max_new_tokens=4)),
        Rollout([5, 6, 7], SamplingParams(max_new_tokens=4)),
    )
    a.append([8, 9], [-0.1, -0.2], [0, 0], "length", rows_of([5, 6, 7, 8]))
    b.append([8], [-0.1], [0], "length", rows_of([5, 6, 7]))
    for f in client.resume_many([a, b], 1):
        f.result(timeout=10)
    assert _SGLang.bodies[-1]["routed_experts_start_len"] == 3
    assert torch.equal(a.routing, rows_of([5, 6, 7, 8, 9])) and a.routed == 5
    assert torch.equal(b.routing, rows_of([5, 6, 7, 8])) and b.routed == 4
    assert client.stats()["routing_dropped"] == 0


def test_a_reply_whose_routing_does_not_fit_is_sampled_again_and_counted(client, capsys):
    _SGLang.script = ["extra_row"]
    (f,) = client.submit([5, 6], SamplingParams(max_new_tokens=2))
    r = f.result(timeout=10)
    assert len(_SGLang.bodies) == 2 and client.stats()["routing_dropped"] == 1
    assert r.output_ids == [7, 8] and torch.equal(r.routing, rows_of([5, 6, 7]))
    assert "expected 3 rows" in capsys.readouterr().out
    _SGLang.script = ["extra_row"] * gc.ROUTING_RETRIES  # a server that always does: fatal
    (f,) = client.submit([5, 6], SamplingParams(max_new_tokens=2))
    with pytest.raises(ServerError, match="answered 3 times in a row with routing that does"):
        f.result(timeout=10)


def test_a_server_started_without_the_flag_fails_every_request(client):
    _SGLang.script = ["queued_abort"]  # aborted in the queue: no routing, nothing lost
    (f,) = client.submit([5, 6], SamplingParams(max_new_tokens=2))
    r = f.result(timeout=10)
    assert (r.output_ids, r.routing, r.finished) == ([], None, False)
    _SGLang.script = ["no_routing"]
    with pytest.raises(ServerError, match=r"returns no routed experts .* --enable-return-routed"):
        client.resume(r).result(timeout=10)
    with pytest.raises(ServerError, match="returns no routed experts"):  # and every later one
        client.submit([5, 6], SamplingParams(max_new_tokens=2))[0].result(timeout=10)


def test_servers_get_the_flag_and_requests_ask_only_with_replay(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(ServerLauncher, "spawn", lambda self: self)  # no process
    monkeypatch.setattr(api, "job_keys", api.ServerKeys.random)
    for replay in (False, True):
        cfg = compose([f"algorithm.routing_replay={str(replay).lower()}",
                       f"run.output_dir={tmp_path}"])  # fmt: skip
        launched = service.launch(startup.settings(cfg), 0, 1, model_path=lambda out: str(tmp_path))
        assert launched.launcher.config.return_routed_experts is replay
    plain = ServerConfig(str(tmp_path))
    assert "--enable-return-routed-experts" not in plain.argv(1)
    on = ServerConfig(str(tmp_path), return_routed_experts=True)
    assert "--enable-return-routed-experts" in on.argv(1)
    assert "return_routed_experts" not in api.generate([[1]], [{}]).body
    body = api.generate([[1, 2], [3]], [{}, {}], routed_from=1).body
    assert (body["return_routed_experts"], body["routed_experts_start_len"]) == (True, 1)


# ------------------------------------------------------------------ saved state
def _until(pred, what: str) -> None:
    deadline = time.monotonic() + 5
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def test_the_rows_go_through_a_saved_state_bit_for_bit_cut_to_the_tokens_kept():
    client = ScriptedClient()
    gate = StalenessGate(max_lag=0, mode="throttle", per_step=1)
    item = Example("p0", (1, 5, 6), "prompt")
    stream = RolloutStream(client, lambda g: Future(), lambda: item,
                           SamplingParams(max_new_tokens=6), gate=gate, version=3,
                           segment_tokens=2, eager_resume=False).start()  # fmt: skip
    try:
        _until(lambda: len(client.sent) == 1, "a group")
        r = client.sent[0]
        r.append([7, 8], [-0.1, -0.2], [3, 3], "length", rows_of([1, 5, 6, 7]))
        client.futures.pop(r.rid).set_result(r)
        _until(lambda: stream.parked == 1, "parked")
        stream.commit(4)
        _until(lambda: r in client.sent[1:], "resumed")
        _until(lambda: len(client.sent) == 3, "a second group")
        r.append([9, 10], [-0.3, -0.4], [4, 4], None, rows_of([8, 9]))  # the client, mid-way
        fresh = client.sent[2] if client.sent[1] is r else client.sent[1]
        fresh.append([7], [-0.1], [4], None, rows_of([1, 5, 6]))
        state = stream.snapshot()
    finally:
        stream.close()
    (cut,) = {g.gid: g for g in state.groups}[0].rollouts
    assert cut.output_ids == [7, 8] and torch.equal(cut.routing, rows_of([1, 5, 6, 7]))
    (none,) = {g.gid: g for g in state.groups}[1].rollouts  # its first segment: no rows yet
    assert (none.output_ids, none.routing) == ([], None)
    text = json.dumps(rollout_state.to_json(state))
    assert "routing" in text and '"data"' in text
    back = rollout_state.from_json(json.loads(text)).groups[0].rollouts[0]
    assert back.routing.dtype == torch.int8 and torch.equal(back.routing, cut.routing)
    # int16 (more than 127 experts), negative and large ids: the same bits back.
    wide = torch.tensor([[[-1, 300]], [[32767, -32768]], [[5, 129]]], dtype=torch.int16)
    r16 = Rollout([1, 2], SamplingParams(max_new_tokens=4), 0, 0)
    r16.append([3, 4], [-0.1, -0.2], [1, 1], None, wide)
    g = Group(0, Example("u", (1, 2), "p"), 1, [r16])
    d = json.loads(json.dumps(rollout_state.to_json(StreamState(1, 1, 1, {}, groups=[g]))))
    back16 = rollout_state.from_json(d).groups[0].rollouts[0].routing
    assert back16.dtype == torch.int16 and torch.equal(back16, wide)
    d["groups"][0]["rollouts"][0]["routing"]["shape"] = [5, 1, 2]
    with pytest.raises(rollout_state.RolloutStateError, match="routing data holds 6 ids"):
        rollout_state.from_json(d, "f.json")
    old = json.loads(text)  # a file from before routing replay: no routing key
    del old["groups"][0]["rollouts"][0]["routing"]
    assert rollout_state.from_json(old).groups[0].rollouts[0].routing is None


# ------------------------------------------------------------------ the CPU server patch
def test_cpu_servers_get_a_plain_host_buffer_for_routed_experts():
    def registers(*args: object, **kw: object) -> torch.Tensor:
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess")

    shared = defaultdict(lambda: registers, {"npu": registers})
    base = ModuleType(cre.BASE)
    base.ALLOC_MEMORY_FUNCS = shared  # type: ignore[attr-defined]
    base._cuda_host_unregister = registers  # type: ignore[attr-defined]
    cre.patch_base(base)
    table = base.ALLOC_MEMORY_FUNCS  # type: ignore[attr-defined]
    cre.patch_base(base)  # idempotent
    assert base.ALLOC_MEMORY_FUNCS is table  # type: ignore[attr-defined]
    buf = table["cpu"]((4, 2, 2), dtype=torch.int32, device="cpu", pin_memory=True, allocator=None)
    assert buf.shape == (4, 2, 2) and not buf.any() and not buf.is_pinned()
    assert table["npu"] is registers and table["cuda"] is registers  # the rest as before
    assert shared["cpu"] is registers  # the HiCache pools' table is left alone
    base._cuda_host_unregister(buf)  # type: ignore[attr-defined]
