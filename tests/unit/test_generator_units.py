"""Generator logic that needs no server: request checks, rollout segments, result parsing,
weight buckets, the server API against a stand-in HTTP server, the CPU shim and the
launcher's config checks. Milliseconds each."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import json
import pickle
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import aiohttp
import pytest
import torch
from omegaconf import OmegaConf

from rl.config.sampling import RequestError, SamplingParams
from rl.config.schema import SamplingConfig
from rl.generator.types import ModelLimits, Rollout, ServerResponseError, parse_result
from rl.generator.weight_payload import (
    ALIGN,
    FlatBucket,
    buckets,
    update_call,
    use_file_system_sharing,
)
from rl.runtime.net import free_port
from rl.serving import server_api as api
from rl.serving.launcher import INIT_METHOD_ENV, ServerConfig, ServerError, ServerLauncher

LIMITS = ModelLimits(vocab_size=99, context_len=128, eos_ids=(2,))
KEYS = api.ServerKeys.random()


# ------------------------------------------------------------------ sampling and limits
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_new_tokens": -1}, "sampling.max_new_tokens=-1 must be an integer >= 1"),
        ({"max_new_tokens": 0}, "sampling.max_new_tokens=0 must be an integer >= 1"),
        ({"max_new_tokens": 2.5}, "sampling.max_new_tokens=2.5 must be an integer >= 1"),
        ({"temperature": -0.1}, "sampling.temperature=-0.1 must be >= 0"),
        ({"temperature": "hot"}, "sampling.temperature='hot' must be >= 0"),
        ({"top_p": 0.0}, "sampling.top_p=0.0 must be in (0, 1]"),
        ({"top_k": 0}, "sampling.top_k=0 must be -1 (off) or an integer >= 1"),
        ({"n": True}, "sampling.n=True must be an integer >= 1"),
        ({"seed": -3}, "sampling.seed=-3 must be None or an integer >= 0"),
        ({"stop_token_ids": (2, -1)}, "sampling.stop_token_ids=(2, -1) must be token ids >= 0"),
        ({"ignore_eos": "yes"}, "sampling.ignore_eos='yes' must be true or false"),
    ],
)
def test_bad_sampling_field_is_named(fields, message):
    with pytest.raises(RequestError) as e:
        SamplingParams(**fields)
    assert str(e.value) == message


def test_unknown_sampling_field_is_rejected_with_the_known_ones():
    with pytest.raises(RequestError, match=r"unknown sampling field 'temprature' \(known: "):
        SamplingParams.from_dict({"temprature": 0.5, "max_new_tokens": 4})
    assert SamplingParams.from_dict({"temperature": 0.5}).temperature == 0.5


def test_sampling_from_config_reads_every_schema_field():
    """``rollout.sampling`` as composed (a DictConfig of SamplingConfig) becomes the same
    params as its items would: no schema field is left behind."""
    section = OmegaConf.structured(
        SamplingConfig(temperature=0.5, top_p=0.9, top_k=7, max_new_tokens=9, n=3, seed=11)
    )
    assert SamplingParams.from_config(section) == SamplingParams.from_dict(dict(section))
    assert SamplingParams.from_config(section, n=8).n == 8
    read: set[str] = set()

    class Spy:
        def __getattr__(self, name: str) -> object:
            read.add(name)
            return getattr(section, name)

    SamplingParams.from_config(Spy())
    assert read == {f.name for f in dataclasses.fields(SamplingConfig)}


def test_ignore_eos_with_stop_tokens_is_contradictory():
    with pytest.raises(RequestError, match=r"cannot be used with sampling\.ignore_eos=True"):
        SamplingParams(stop_token_ids=(5,), ignore_eos=True)


def test_sglang_params_keep_the_stop_token_and_pass_the_seed():
    p = SamplingParams(temperature=0.7, top_p=0.9, stop_token_ids=(5,))
    d = p.to_sglang(max_new_tokens=3, seed=11)
    assert d["max_new_tokens"] == 3 and d["sampling_seed"] == 11 and d["no_stop_trim"]
    assert d["stop_token_ids"] == [5] and d["temperature"] == 0.7 and d["top_p"] == 0.9
    assert "sampling_seed" not in p.to_sglang(3, None)
    assert p.stops((2,)) == {2, 5}
    assert SamplingParams(ignore_eos=True).stops((2,)) == frozenset()


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        ([], SamplingParams(), "prompt_ids is empty"),
        ([1, 99], SamplingParams(), "prompt token id 99 out of range for vocab_size=99"),
        ([1, -2], SamplingParams(), "prompt token id -2 out of range for vocab_size=99"),
        ([1, "7"], SamplingParams(), "prompt token id '7' out of range for vocab_size=99"),
        (
            [1] * 120,
            SamplingParams(max_new_tokens=9),
            "prompt of 120 tokens + sampling.max_new_tokens=9 exceeds the context length 128",
        ),
        (
            [1] * 200,
            SamplingParams(max_new_tokens=1),
            "prompt of 200 tokens + sampling.max_new_tokens=1 exceeds the context length 128",
        ),
        (
            [1],
            SamplingParams(stop_token_ids=(150,)),
            "sampling.stop_token_ids has 150, out of range for vocab_size=99",
        ),
    ],
)
def test_request_outside_the_model_is_rejected(prompt, sampling, message):
    with pytest.raises(RequestError) as e:
        LIMITS.check(prompt, sampling)
    assert str(e.value) == message


def test_limits_from_model_dir_read_vocab_context_and_every_eos(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"vocab_size": 50, "max_position_embeddings": 64, "eos_token_id": 2})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    lim = ModelLimits.from_model_dir(tmp_path)
    assert lim == ModelLimits(vocab_size=50, context_len=64, eos_ids=(2, 7))
    assert ModelLimits.from_model_dir(tmp_path, context_len=32).context_len == 32


# ------------------------------------------------------------------ rollouts and segments
def test_rollout_cut_into_segments_keeps_tokens_logprobs_and_versions():
    r = Rollout([1, 5, 6], SamplingParams(max_new_tokens=7))
    ids, budget, _ = r.next_request(segment_tokens=3)
    assert ids == [1, 5, 6] and budget == 3
    r.append([10, 11, 12], [-0.1, -0.2, -0.3], [0, 0, 0], "length")
    assert not r.finished and r.remaining == 4  # a segment boundary, not the end
    ids, budget, _ = r.next_request(segment_tokens=3)
    assert ids == [1, 5, 6, 10, 11, 12] and budget == 3
    r.append([13], [-0.4], [1], "abort")  # interrupted by a pause: still resumable
    assert not r.finished
    ids, budget, _ = r.next_request(segment_tokens=3)
    assert ids[-1] == 13 and budget == 3
    r.append([14, 15, 16], [-0.5, -0.6, -0.7], [1, 2, 2], "length")
    assert r.finish_reason == "length" and r.remaining == 0 and r.segments == 3
    assert r.output_ids == [10, 11, 12, 13, 14, 15, 16]
    assert r.versions == [0, 0, 0, 1, 1, 2, 2]
    assert r.logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5, -0.6, -0.7]
    with pytest.raises(RequestError, match="is finished"):
        r.next_request(None)


def test_stop_ends_a_rollout_and_user_abort_is_final():
    r = Rollout([1], SamplingParams(max_new_tokens=8))
    r.append([4, 2], [-1.0, -0.5], [0, 0], "stop")
    assert r.finish_reason == "stop"
    a = Rollout([1], SamplingParams(max_new_tokens=8))
    a.append([4], [-1.0], [0], "abort")
    a.finish("abort")
    assert a.finished
    with pytest.raises(ValueError, match="3 ids, 2 logprobs, 3 versions"):
        Rollout([1], SamplingParams()).append([1, 2, 3], [0.0, 0.0], [0, 0, 0], None)


def test_seeds_are_stable_differ_by_prompt_and_sample_and_hold_across_segments():
    p = SamplingParams(seed=7, n=2)

    def seed(prompt, sample, done=()):
        r = Rollout(list(prompt), p, sample)
        r.output_ids = list(done)
        return r.next_request(None)[2]

    a = seed([1, 5], 0)
    assert a == seed([1, 5], 0)  # stable (no Python hash randomisation)
    assert len({a, seed([1, 6], 0), seed([1, 5], 1)}) == 3
    assert seed([1, 5], 0, [9]) == a  # a resumed segment: the position moves the draw on
    assert Rollout([1], SamplingParams()).next_request(None)[2] is None


# ------------------------------------------------------------------ parsing server results
def _result(ids, spans, finish="length", lps=None):
    lps = lps if lps is not None else [[-0.5 - i, t, None] for i, t in enumerate(ids)]
    meta = {"finish_reason": {"type": finish}, "output_token_logprobs": lps}
    meta |= {"weight_version": spans[-1]["version"] if spans else "0", "weight_versions": spans}
    return {"output_ids": ids, "meta_info": meta}


def test_parse_result_expands_version_spans_per_token():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    ids, lps, versions, reason = parse_result(_result([7, 8, 9, 10, 11], spans, "stop"))
    assert ids == [7, 8, 9, 10, 11] and reason == "stop"
    assert versions == [3, 3, 4, 4, 4]
    assert lps == [-0.5, -1.5, -2.5, -3.5, -4.5]
    # No spans: the single weight_version covers every token.
    out = _result([7, 8], [])
    out["meta_info"]["weight_version"] = "5"
    assert parse_result(out)[2] == [5, 5]


def _span(version="1", start=0, end=2):
    return [{"version": version, "start": start, "end": end}]


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (_result([7, 8], _span(), lps=[[-1.0, 7, None]]), "do not match"),
        (_result([7, 8], _span(), lps=[[-1.0, 7, None], [-1.0, 9, None]]), "do not match"),
        (_result([7, 8], _span(start=1)), "not contiguous"),
        (_result([7, 8], _span(end=1)), "cover 1 of 2 tokens"),
        (_result([7], _span("default", end=1)), "reports weight version 'default'"),
        (_result([7], _span(end=1), finish="weird"), "unknown finish reason"),
        ({"output_ids": [7]}, "malformed generation result"),
    ],
)
def test_malformed_results_raise_instead_of_misaligning(result, message):
    with pytest.raises(ServerResponseError, match=message):
        parse_result(result)


# ------------------------------------------------------------------ weight buckets
def test_flat_bucket_round_trip_is_bit_exact_and_aligned():
    g = torch.Generator().manual_seed(0)
    named = [
        ("a", torch.randn(3, 5, generator=g)),
        ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
        ("c", torch.arange(5, dtype=torch.int64)),
        ("d", torch.randn(4, 6, generator=g)[:, ::2]),  # non-contiguous source
    ]
    bucket = FlatBucket.pack(named)
    assert bucket.names == ["a", "b", "c", "d"]
    assert all(m.start_idx % ALIGN == 0 for m in bucket.meta)
    for (name, want), (got_name, got) in zip(named, bucket.unpack(), strict=True):
        assert name == got_name and got.dtype == want.dtype and torch.equal(got, want)


def test_buckets_respect_the_byte_budget_and_keep_order():
    named = [(f"t{i}", torch.zeros(100)) for i in range(10)]  # 400 bytes each
    groups = list(buckets(named, bucket_bytes=1000))
    assert [len(g) for g in groups] == [2, 2, 2, 2, 2]
    assert [n for g in groups for n, _ in g] == [n for n, _ in named]
    big = list(buckets([("big", torch.zeros(1000)), ("s", torch.zeros(1))], 1000))
    assert [[n for n, _ in g] for g in big] == [["big"], ["s"]]
    with pytest.raises(ValueError, match="bucket_bytes=0 must be > 0"):
        list(buckets(named, 0))


def test_update_call_carries_one_payload_per_server_rank_and_round_trips():
    use_file_system_sharing()  # what the client does: the server opens storages by name
    bucket = FlatBucket.pack([("w", torch.arange(6.0).view(2, 3)), ("b", torch.ones(2))])
    call, keep = update_call(bucket, tp=2)
    assert call.route == "/update_weights_from_tensor"
    body = call.body
    assert body["load_format"] == "flattened_bucket" and body["flush_cache"] is False
    assert len(body["serialized_named_tensors"]) == 2
    got = pickle.loads(base64.b64decode(body["serialized_named_tensors"][1]))
    assert torch.equal(got["flattened_tensor"], bucket.flat)
    assert [m.name for m in got["metadata"]] == ["w", "b"]
    plain = update_call([("w", torch.zeros(2))], tp=1)[0].body
    assert plain["load_format"] is None and len(plain["serialized_named_tensors"]) == 1
    del keep


# ------------------------------------------------------------------ the server API
class _StandIn(BaseHTTPRequestHandler):
    """Answers like SGLang: /generate echoes its body, /model_info names a version,
    /flush_cache answers in plain text, /refuse with HTTP 400."""

    def _answer(self, status: int, text: str) -> None:
        self.send_response(status)
        self.end_headers()
        self.wfile.write(text.encode())

    def do_GET(self) -> None:
        if self.path == "/model_info":
            self._answer(200, json.dumps({"weight_version": "3"}))
        else:
            self._answer(200 if self.path == "/health" else 404, "")

    dropped: ClassVar[list[str]] = []  # the routes of requests closed unanswered

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"])).decode()
        if self.path in ("/drop_once", "/drop") and (
            self.path == "/drop" or self.path not in self.dropped
        ):
            self.dropped.append(self.path)
            self.close_connection = True  # closed without an answer, as a timed-out keep-alive
            return
        if self.path in ("/generate", "/drop_once"):
            self._answer(200, body)
        elif self.path == "/flush_cache":
            self._answer(200, "Cache flushed.")
        else:
            self._answer(400, f"no route {self.path}")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def stand_in() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_server_api_calls_and_errors_name_the_server_and_route(stand_in):
    one = api.call(stand_in, api.generate([[1, 2]], [{"max_new_tokens": 1}], ["r0"]), KEYS)
    assert one == {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1},
                   "return_logprob": True, "rid": "r0"}  # fmt: skip
    two = api.call(stand_in, api.generate([[1], [2]], [{}, {}]), KEYS)
    assert two["input_ids"] == [[1], [2]] and "rid" not in two
    assert api.generate_results(one, 1) == [one]
    assert api.weight_version(api.call(stand_in, api.model_info(), KEYS)) == 3
    assert api.call(stand_in, api.flush_cache(), KEYS) == {"text": "Cache flushed."}
    assert api.healthy(stand_in)
    with pytest.raises(api.CallError, match=f"{stand_in}/refuse answered HTTP 400: no route"):
        api.call(stand_in, api.Call("/refuse"), KEYS)
    gone = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(api.CallError, match=f"{gone}/continue_generation unreachable") as e:
        api.call(gone, api.continue_generation(), KEYS)
    assert not e.value.answered and e.value.route == "/continue_generation"
    assert not api.healthy(gone)
    assert api.refusal({"success": False, "message": "no"}) == "no"
    assert api.refusal({"success": True}) is None


def test_server_api_async_calls_answer_and_fail_the_same(stand_in):
    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            got = await api.acall(session, stand_in, api.model_info(), KEYS)
            assert api.weight_version(got) == 3
            with pytest.raises(api.CallError, match="/refuse answered HTTP 400") as e:
                await api.acall(session, stand_in, api.Call("/refuse"), KEYS)
            assert e.value.answered and e.value.status == 400
            gone = f"http://127.0.0.1:{free_port()}"
            with pytest.raises(api.CallError, match="/abort_request unreachable") as e:
                await api.acall(session, gone, api.abort_all(), KEYS)
            assert not e.value.answered
            # A connection closed before the answer is tried once more; twice is a failure.
            _StandIn.dropped.clear()
            assert await api.acall(session, stand_in, api.Call("/drop_once", {"a": 1}), KEYS) == {
                "a": 1
            }
            assert _StandIn.dropped == ["/drop_once"]
            with pytest.raises(api.CallError, match="/drop unreachable: ServerDisconnected"):
                await api.acall(session, stand_in, api.Call("/drop"), KEYS)
            assert _StandIn.dropped.count("/drop") == 2

    asyncio.run(run())


# ------------------------------------------------------------------ CPU shim and launcher
def _model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))
    return str(tmp_path)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tp": 2}, "server.tp=2: SGLang runs on CPU only at tp=1"),
        ({"dtype": "float8_e4m3fn"}, "server.dtype='float8_e4m3fn' must be one of"),
        ({"device": "tpu"}, "server.device='tpu' must be 'cpu' or 'cuda'"),
        ({"startup_timeout": 0}, "server.startup_timeout=0 must be > 0"),
        ({"threads": 0}, "server.threads=0 must be >= 1"),
    ],
)
def test_server_config_rejects_what_cannot_start(tmp_path, fields, message):
    with pytest.raises(ServerError) as e:
        ServerConfig(model_path=_model_dir(tmp_path), **fields).validate()
    assert str(e.value).startswith(message)


def test_server_config_needs_a_model_dir_and_builds_sglang_flags(tmp_path):
    with pytest.raises(ServerError, match=r"has no config\.json"):
        ServerConfig(model_path=str(tmp_path / "nothing")).validate()
    argv = ServerConfig(model_path=_model_dir(tmp_path), weight_version=3).argv(port=1234)
    flags = dict(zip(argv[3::2], argv[4::2], strict=False))
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert flags["--port"] == "1234" and flags["--device"] == "cpu"
    assert "--skip-tokenizer-init" in argv and "--weight-version" in argv
    assert "--sleep-on-idle" in argv  # idle schedulers must not spin a core each


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_server_store_is_a_file_of_its_own_on_every_device(tmp_path, monkeypatch, device):
    """SGLang's default store, ``tcp://127.0.0.1:<port>``, listens on every interface:
    each server gets a file store in its log directory instead, a GPU one included (the
    CPU shim does not run there). That SGLang honours it: tests/servers/test_generator.py
    finds no socket of a server beyond loopback."""
    monkeypatch.setenv(INIT_METHOD_ENV, "tcp://0.0.0.0:1")  # one for every server: not used
    config = ServerConfig(model_path=_model_dir(tmp_path), device=device)
    launcher = ServerLauncher(config, n=2, log_dir=tmp_path / "logs")
    got = [launcher.env(s)[INIT_METHOD_ENV] for s in launcher.servers]
    assert got == [f"file://{tmp_path}/logs/server{i}.store" for i in range(2)]


def test_serialize_retries_a_shared_memory_manager_timeout(monkeypatch):
    """torch_shm_manager times out under load; the payload is pickled again, and any other
    error is raised at once."""
    import base64

    from rl.generator import weight_payload as wp

    calls = []
    real = wp.ForkingPickler.dump

    def flaky(self, obj):
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("Shared memory manager connection has timed out")
        return real(self, obj)

    monkeypatch.setattr(wp.ForkingPickler, "dump", flaky)
    monkeypatch.setattr(wp.time, "sleep", lambda s: None)
    assert base64.b64decode(wp.serialize({"a": 1}))
    assert len(calls) == 3

    def broken(self, obj):
        raise RuntimeError("something else")

    monkeypatch.setattr(wp.ForkingPickler, "dump", broken)
    with pytest.raises(RuntimeError, match="something else"):
        wp.serialize({"a": 1})


def test_an_fp8_server_starts_from_its_checkpoint_with_the_fp8_config_and_dummy_weights(
    tmp_path,
):
    """rollout.weight_sync.fp8_block: SGLang builds blockwise-FP8 layers from the config's
    quantization_config (it cannot run them on CPU: tests/gpu starts one), every other file
    is the checkpoint's own, and the weights come by DDMA, not from the bf16 files."""
    from rl.serving.launcher import fp8_serving_dir

    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (src / "model.safetensors").write_bytes(b"weights")
    (src / "tokenizer.json").write_text("{}")
    dst = fp8_serving_dir(src, tmp_path / "fp8", 128)
    config = json.loads((dst / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert (dst / "model.safetensors").read_bytes() == b"weights"
    assert (dst / "tokenizer.json").resolve() == (src / "tokenizer.json").resolve()
    assert "quantization_config" not in json.loads((src / "config.json").read_text())
    assert fp8_serving_dir(src, tmp_path / "fp8", 64) == dst  # rewritten in place
    argv = ServerConfig(model_path=str(dst), load_format="dummy").argv(1234)
    assert argv[argv.index("--load-format") + 1] == "dummy"
    assert "--load-format" not in ServerConfig(model_path=str(src)).argv(1234)
