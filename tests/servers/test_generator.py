"""The generator executor against real SGLang servers on CPU (two servers, TP=1, fp32).

A tiny random Llama is made locally and served; Hugging Face transformers running the same
weights is the reference. Tests run in file order on one pair of servers. First the lock:
a server's admin routes refuse a call without the admin key (the API key included) and
leave the served weights and version alone, its other routes refuse a call without the
API key, the keys show on no command line and in no leftover file, and it listens on
127.0.0.1 only. Then parity,
then weight updates (the reference follows every update) and the controller's rollout
stream across one, then killing and restarting a server, last.
"""

from __future__ import annotations

import concurrent.futures as cf
import itertools
import json
import os
import signal
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from rl.checks import check
from rl.compose import compose
from rl.config.sampling import RequestError, SamplingParams
from rl.controller.batch import build_batch
from rl.controller.rollouts import RolloutStream
from rl.controller.staleness import StalenessGate
from rl.generator.client import REQUEUE_REPORT_S, GeneratorClient
from rl.generator.weight_payload import FlatBucket, buckets
from rl.runtime.net import free_port
from rl.serving import server_api as api
from rl.serving.launcher import ServerConfig, ServerError, ServerLauncher
from rl.tasks.common import Example
from rl.tasks.scoring import ScoreResult
from tests.helpers.hf_models import make_model
from tests.helpers.hf_reference import HFReferenceGenerator
from tests.helpers.procs import assert_group_gone, group_listeners

TOL = 1e-4
PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 40, 41, 42, 43, 44, 45], [1, 3], [1, 77, 12, 60]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=12)
LONG = SamplingParams(temperature=0, max_new_tokens=110, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("llama", tmp_path_factory.mktemp("gen") / "tiny")


@pytest.fixture(scope="module")
def rollout_cfg():
    """The generator settings as the main job composes them (conf/rollout/cpu.yaml)."""
    cfg = compose(["rollout.servers=2"])
    check(cfg)
    return cfg.rollout


@pytest.fixture(scope="module")
def launcher(model_dir, rollout_cfg, tmp_path_factory):
    server = ServerConfig.from_rollout(rollout_cfg, model_dir)
    logs = tmp_path_factory.mktemp("logs")
    with ServerLauncher(server, n=rollout_cfg.servers, log_dir=logs) as launcher:
        yield launcher
        launcher.stop(grace=0)  # the module is done, nothing in flight: no drain


@pytest.fixture(scope="module")
def client(launcher, rollout_cfg):
    r = rollout_cfg
    kw = {"max_in_flight": r.max_in_flight, "request_timeout": r.request_timeout}
    with GeneratorClient.for_launcher(launcher, **kw) as client:
        yield client


@pytest.fixture(scope="module")
def ref(model_dir):
    return HFReferenceGenerator(model_dir)


@pytest.fixture(scope="module")
def weights(model_dir):
    """Named weights of every version pushed so far: {version: [(name, tensor)]}."""
    return {0: sorted(load_file(model_dir / "model.safetensors").items())}


def _new_version(weights: dict, version: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    named = [(n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in weights[0]]
    weights[version] = named
    return named


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want, strict=True)) < TOL


def _assert_matches_greedy(rollout, ref) -> None:
    want = ref.generate(rollout.prompt_ids, rollout.sampling)
    assert rollout.output_ids == want.output_ids
    assert _close(rollout.logprobs, want.logprobs), (rollout.logprobs, want.logprobs)
    assert rollout.finish_reason == want.finish_reason


def _generate_posts(launcher) -> int:
    return sum(s.log_path.read_text().count('"POST /generate') for s in launcher.servers)


def _wait_active(client, rollout_rid: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while rollout_rid not in client.in_flight():
        assert time.monotonic() < deadline, "request never became active"
        time.sleep(0.01)


# ------------------------------------------------------------- locked (first, at version 0)
# The locked server. SGLang on CPU is not bit-reproducible across identical requests to
# one server: greedy ids match, but a log-prob moved by 4.8e-7 between two calls on one
# machine (docs/testing.md). "Unchanged" is therefore exact ids and versions and
# log-probs within SAME; a weight swap moves them by far more than MOVED.
PROMPT = [1, 5, 6, 7, 8]
GREEDY_BODY = {"temperature": 0, "max_new_tokens": 6}
OTHER = "z" * 32  # a key the server does not hold
SAME = 1e-5
MOVED = 1e-3


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """Weights the server does not serve, for a swap from disk."""
    return make_model("llama", tmp_path_factory.mktemp("gen") / "other", seed=1)


@dataclass(frozen=True)
class Served:
    """The version, and greedy tokens with their log-probs: what the server serves."""

    version: int
    ids: list[int]
    logprobs: list[float]

    def moved(self, other: Served) -> float:
        """The largest log-prob change from ``other``; infinite when the ids differ."""
        if self.ids != other.ids:
            return float("inf")
        return max(abs(a - b) for a, b in zip(self.logprobs, other.logprobs, strict=True))


def _served(launcher: ServerLauncher) -> Served:
    url, keys = launcher.urls[0], launcher.keys
    version = api.weight_version(api.call(url, api.model_info(), keys))
    out = api.call(url, api.generate([PROMPT], [GREEDY_BODY]), keys)
    logprobs = [lp for lp, *_ in out["meta_info"]["output_token_logprobs"]]
    return Served(version, out["output_ids"], logprobs)


def _refused(url: str, call: api.Call, keys: api.ServerKeys | None) -> int:
    with pytest.raises(api.CallError) as e:
        api.call(url, call, keys, timeout=60)
    assert e.value.answered, e.value
    return e.value.status


def _from_disk(path: Path, version: int) -> api.Call:
    body = {"model_path": str(path), "weight_version": str(version)}
    return api.Call("/update_weights_from_disk", body)


def test_admin_routes_refuse_no_key_and_the_api_key(launcher, other_model):
    url, keys = launcher.urls[0], launcher.keys
    before = _served(launcher)
    calls = [
        _from_disk(other_model, 7),
        api.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "intruder", "gloo"),
        api.pause_generation("abort"),
        api.update_weight_version(9),
        api.begin_weight_update(),
        api.flush_cache(),
    ]
    api_key_as_admin = api.ServerKeys(OTHER, keys.api)  # sends the API key to admin routes
    for call in calls:
        for wrong in (None, api_key_as_admin, api.ServerKeys(keys.api, OTHER)):
            assert _refused(url, call, wrong) == 401, call.route
    after = _served(launcher)  # not paused, same version, same weights
    assert after.version == before.version == 0
    assert after.moved(before) < SAME, (before, after)


def test_other_routes_need_the_api_key(launcher):
    url, keys = launcher.urls[0], launcher.keys
    admin_key_as_api = api.ServerKeys(keys.admin, OTHER)  # SGLang takes only the API key
    for call in (api.generate([PROMPT], [GREEDY_BODY]), api.model_info()):
        for wrong in (None, admin_key_as_api):
            assert _refused(url, call, wrong) == 401, call.route
    assert api.healthy(url)  # health answers anyone: the launcher polls it without a key


def test_admin_key_updates_weights_and_version(launcher, model_dir, other_model):
    url, keys = launcher.urls[0], launcher.keys
    start = _served(launcher)
    reply = api.call(url, _from_disk(other_model, 7), keys, timeout=300)
    assert reply["success"], reply
    swapped = _served(launcher)
    assert swapped.version == 7 and swapped.moved(start) > MOVED, (start, swapped)
    api.call(url, api.pause_generation("retract"), keys)
    api.call(url, api.continue_generation(), keys)
    assert api.call(url, _from_disk(model_dir, 0), keys, timeout=300)["success"]
    back = _served(launcher)
    assert back.version == start.version and back.moved(start) < SAME, (start, back)


def test_keys_show_on_no_command_line_and_in_no_leftover_file(launcher):
    keys, s = launcher.keys, launcher.servers[0]
    # -ww: whole command lines (ps cuts them to the terminal's width otherwise).
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True, check=True)
    assert keys.api not in ps.stdout and keys.admin not in ps.stdout
    assert f"--config {s.key_file}" in ps.stdout  # SGLang got them from the file ...
    assert not s.key_file.exists()  # ... deleted once the server answered
    # SGLang logs its arguments, redacted as /server_info is (rl/serving/hide_keys.py); the
    # log is readable by this user only.
    log = s.log_path.read_text()
    assert "'admin_api_key': '<redacted>'" in log and keys.admin not in log
    assert stat.S_IMODE(s.log_path.stat().st_mode) == 0o600
    assert keys.admin not in s.error("test").args[0]


def test_the_api_key_cannot_read_the_keys(launcher):
    """SGLang's /server_info (API key) returns its arguments, which held the admin key at
    its top level and in ``internal_states`` (an API-key holder could update weights);
    rl/serving/hide_keys.py has SGLang redact both keys."""
    info = api.call(launcher.urls[0], api.Call("/server_info", method="GET"), launcher.keys)
    assert info["admin_api_key"] == info["api_key"] == "<redacted>"
    assert info["tp_size"] == 1  # the rest of it is there
    where = [k for k, v in info.items() if launcher.keys.admin in json.dumps(v)]
    assert where == [] and launcher.keys.api not in json.dumps(info)


def test_server_listens_on_localhost_only(launcher):
    """Its HTTP port, and every other socket: the scheduler's torch.distributed store,
    which torch's TCPStore would open on every interface, is a file on a CPU server
    (rl/serving/server_footprint.py; without it this found ``::`` and the scheduler)."""
    s = launcher.servers[0]
    assert s.proc is not None
    listening = group_listeners(os.getpgid(s.proc.pid))
    http = [ip for ip, port, _ in listening if port == s.port]
    assert http == ["127.0.0.1"], listening
    assert [x for x in listening if x[0] != "127.0.0.1"] == [], listening


# ---------------------------------------------------------------------------- parity
def test_greedy_tokens_and_logprobs_match_transformers_on_both_servers(client, ref):
    futures = [f for p in PROMPTS * 2 for f in client.submit(p, GREEDY)]
    rollouts = [f.result() for f in futures]
    for r in rollouts:
        _assert_matches_greedy(r, ref)
        assert r.versions == [0] * len(r.output_ids) and r.segments == 1
    assert {r.server for r in rollouts} == {0, 1}  # load-balanced over both servers


def test_stop_token_ends_the_rollout_and_is_kept(client, ref):
    full = ref.generate(PROMPTS[0], GREEDY).output_ids
    cut = next(i for i, t in enumerate(full) if i >= 2 and full.index(t) == i)
    stop = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(full[cut],))
    (r,) = client.generate([PROMPTS[0]], stop)
    assert r.output_ids == full[: cut + 1] and r.finish_reason == "stop"


def test_sampled_tokens_carry_their_behaviour_logprobs(client, ref):
    sampling = SamplingParams(temperature=0.7, top_p=0.9, n=8, max_new_tokens=10)
    rollouts = list(client.as_completed(client.submit(PROMPTS[2], sampling)))
    assert len(rollouts) == 8 and len({tuple(r.output_ids) for r in rollouts}) > 1
    for r in rollouts:
        want = ref.score(r.prompt_ids, r.output_ids, temperature=0.7)
        assert _close(r.logprobs, want), (r.logprobs, want)


def test_segmented_generation_equals_one_shot(client, ref):
    rollouts = client.generate(PROMPTS, GREEDY, segment_tokens=5)
    for r in rollouts:
        assert r.segments == -(-len(r.output_ids) // 5)  # cut every 5 tokens
        _assert_matches_greedy(r, ref)
    assert max(r.segments for r in rollouts) == 3  # 12 tokens: 5 + 5 + 2


def test_seeded_samples_depend_on_neither_the_batch_nor_the_cuts(client):
    """rollout.sampling.seed: each token is drawn from (seed, position), which a CPU server
    does through rl/serving/cpu_seeds.py. A sampled rollout is the same alone, batched
    with other prompts (on either server) and cut into segments; unseeded samples of one
    prompt still differ."""
    seeded = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=3)
    alone = client.generate([PROMPTS[2]], seeded)[0].output_ids
    batched = [r.output_ids for r in client.generate(PROMPTS * 2, seeded)]
    cut = client.generate([PROMPTS[2]], seeded, segment_tokens=5)[0].output_ids
    assert alone == batched[2] == batched[7] == cut
    free = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True, n=4)
    assert len({tuple(r.output_ids) for r in client.generate([PROMPTS[2]], free)}) > 1


def test_rollouts_stream_back_as_they_finish(client):
    long = client.submit(PROMPTS[0], LONG)
    two = SamplingParams(max_new_tokens=2, ignore_eos=True)  # a sampled EOS would end one early
    short = [f for p in PROMPTS for f in client.submit(p, two)]
    order = list(client.as_completed(long + short))
    assert order[-1] is long[0].result()  # the long rollout does not hold back the others
    assert all(len(r.output_ids) == 2 for r in order[:-1])


def test_bad_requests_fail_before_reaching_a_server(client, launcher):
    before = _generate_posts(launcher)
    with pytest.raises(RequestError, match="exceeds the context length 128"):
        client.submit([1] * 125, SamplingParams(max_new_tokens=8))
    with pytest.raises(RequestError, match="unknown sampling field 'temprature'"):
        client.submit([1, 2], SamplingParams.from_dict({"temprature": 0.0}))
    with pytest.raises(RequestError, match=r"sampling\.max_new_tokens=-5 must be"):
        client.submit([1, 2], SamplingParams(max_new_tokens=-5))
    with pytest.raises(RequestError, match="prompt token id 1000 out of range"):
        client.submit([1, 1000], GREEDY)
    client.generate([PROMPTS[1]], GREEDY)  # the log counter itself works
    assert _generate_posts(launcher) == before + 1


def test_submit_needs_no_event_loop_of_its_own(client):
    """Futures are plain concurrent.futures: callable from any thread (the controller's)."""
    with cf.ThreadPoolExecutor(2) as pool:
        out = list(pool.map(lambda p: client.generate([p], GREEDY)[0], PROMPTS[:2]))
    assert [len(r.output_ids) for r in out] == [12, 12]


def test_idle_servers_leave_the_cpu_to_others(launcher):
    """An idle SGLang scheduler spins a core unless told to sleep: two such servers would
    starve the trainer on a 2-core machine. Spinning measures ~100% of a core each."""
    procs = [
        p for s in launcher.servers for p in psutil.Process(s.proc.pid).children(recursive=True)
    ]
    for p in procs:
        p.cpu_percent()
    time.sleep(3.0)
    busy = {p.pid: p.cpu_percent() for p in procs}
    assert sum(busy.values()) < 50 * len(launcher.servers), busy


# ---------------------------------------------------------------------------- abort and pause
def test_aborted_request_returns_its_partial_tokens(client, ref):
    # An idle server can finish all 110 tokens before a fixed delay ends: shorten it until
    # the abort lands mid-request.
    for delay in (0.3, 0.15, 0.08, 0.04, 0.02):
        (future,) = client.submit(PROMPTS[0], LONG)
        _wait_active(client, future.rollout.rid)
        time.sleep(delay)
        client.abort(future.rollout)
        r = future.result(timeout=60)
        if r.finish_reason == "abort":
            break
    assert r.finish_reason == "abort" and 0 < len(r.output_ids) < LONG.max_new_tokens
    full = ref.generate(r.prompt_ids, LONG)
    assert r.output_ids == full.output_ids[: len(r.output_ids)]
    assert _close(r.logprobs, full.logprobs[: len(r.output_ids)])


def test_pause_in_abort_mode_hands_back_resumable_rollouts(client, ref):
    for delay in (0.3, 0.15, 0.08, 0.04):  # until the pause lands mid-request (see above)
        futures = client.submit(PROMPTS[1], LONG) + client.submit(PROMPTS[3], LONG)
        time.sleep(delay)
        client.pause("abort")
        try:
            partial = [f.result(timeout=60) for f in futures]
        finally:
            client.continue_generation()
        if not any(r.finished for r in partial):
            break
    assert all(not r.finished and len(r.output_ids) < LONG.max_new_tokens for r in partial)
    for r in partial:
        while not r.finished:
            r = client.resume(r).result(timeout=120)
        assert r.segments >= 2
        _assert_matches_greedy(r, ref)


# ---------------------------------------------------------------------------- weight updates
def test_update_weights_then_outputs_match_transformers_with_the_new_weights(client, ref, weights):
    new = _new_version(weights, 1, seed=1)
    assert len(list(buckets(iter(new), 20_000))) > 3  # several buckets, not one
    client.update_weights(new, version=1, bucket_bytes=20_000)
    assert client.weight_versions() == [1, 1] and client.version == 1
    ref.load_weights(new)
    for r in client.generate(PROMPTS, GREEDY):
        _assert_matches_greedy(r, ref)
        assert set(r.versions) == {1}


def test_rollout_resumed_across_an_update_keeps_per_token_versions(client, ref, weights):
    """Partial rollouts: segment 1 under v1, then an update to v2 (sent as ready buckets),
    then the rest; every token keeps the version and log-prob it was sampled with."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16, ignore_eos=True, n=4)
    first = [f.result() for f in client.submit(PROMPTS[0], sampling, segment_tokens=6)]
    assert all(len(r.output_ids) == 6 and not r.finished for r in first)
    new = _new_version(weights, 2, seed=2)
    client.update_weights([FlatBucket.pack(g) for g in buckets(iter(new), 50_000)], version=2)
    done = [client.resume(r).result() for r in first]
    for r in done:
        assert r.finished and r.versions == [1] * 6 + [2] * 10
        ref.load_weights(weights[1])
        assert _close(r.logprobs[:6], ref.score(r.prompt_ids, r.output_ids[:6]))
        ref.load_weights(weights[2])
        assert _close(r.logprobs[6:], ref.score(r.prompt_ids, r.output_ids)[6:])


def test_update_while_requests_run_tags_every_token_with_its_version(client, ref, weights):
    """Requests running on the servers during an update are retracted, resumed under the
    new weights (cache flushed), and report per-token version spans."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=110, ignore_eos=True, n=6)
    futures = [f for p in PROMPTS[:3] for f in client.submit(p, sampling)]
    for f in futures:
        _wait_active(client, f.rollout.rid)
    time.sleep(0.3)  # let them decode a little under v2 (110 tokens take over a second)
    client.update_weights(_new_version(weights, 3, seed=3), version=3)
    rollouts = [f.result(timeout=300) for f in futures]
    straddling = [r for r in rollouts if set(r.versions) == {2, 3}]
    assert straddling, [sorted(set(r.versions)) for r in rollouts]
    for r in rollouts:
        assert r.versions == sorted(r.versions) and set(r.versions) <= {2, 3}
    for r in straddling[:3]:
        k = r.versions.index(3)
        ref.load_weights(weights[2])
        assert _close(r.logprobs[:k], ref.score(r.prompt_ids, r.output_ids)[:k])
        ref.load_weights(weights[3])
        assert _close(r.logprobs[k:], ref.score(r.prompt_ids, r.output_ids)[k:])


def _half(group) -> cf.Future:
    """Rewards 1, 0, 1, 0... at once (the reward executor has tests of its own)."""
    f: cf.Future = cf.Future()
    f.set_result([ScoreResult(float(i % 2 == 0)) for i in range(len(group.rollouts))])
    return f


def test_the_stream_resumes_parked_rollouts_under_the_next_version_into_the_batch(
    client, model_dir, ref, weights
):
    """The controller's rollout stream with partial rollouts: every response is cut after
    3 tokens and parked; the weights change; the parked responses resume under the new
    version. Each token keeps the version and the behaviour log-prob it was sampled with
    (transformers on each version's weights), all the way into the trainer's batch."""
    v0, t = client.version, 0.8
    sampling = SamplingParams(temperature=t, max_new_tokens=6, ignore_eos=True, n=2)
    gate = StalenessGate(max_lag=1, mode="throttle", per_step=2)  # 4 groups may start at v0
    prompts = (Example(f"p{i}", tuple(PROMPTS[i % 5]), "") for i in itertools.count())
    stream = RolloutStream(client, _half, lambda: next(prompts), sampling, gate=gate, version=v0,
                           segment_tokens=3, eager_resume=False).start()  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while stream.parked < 8:  # 4 groups x 2 samples, each cut after 3 tokens
            assert time.monotonic() < deadline, f"only {stream.parked} rollouts parked"
            time.sleep(0.05)
        new = _new_version(weights, v0 + 1, seed=5)
        client.update_weights(new, v0 + 1)
        stream.commit(v0 + 1)
        groups, stats = stream.next_batch(trainer_version=v0 + 1)
    finally:
        stream.close()
    assert len(groups) == 2 and stats["lag_max"] == 1 and stats["resumed_segments"] >= 4
    before, after = HFReferenceGenerator(model_dir), ref  # the reference follows the update
    before.load_weights(weights[v0])
    after.load_weights(new)
    for grp in groups:
        for r in grp.rollouts:
            assert r.segments == 2 and r.versions == [v0] * 3 + [v0 + 1] * 3
            p, out = r.prompt_ids, r.output_ids
            want = before.score(p, out[:3], t) + after.score(p + out[:3], out[3:], t)
            assert max(abs(a - b) for a, b in zip(r.logprobs, want, strict=True)) < 1e-4
    # ... and the trainer's batch carries them token by token.
    batch = build_batch([g.rollouts for g in groups], [g.rewards for g in groups])
    rows = [r for g in groups for r in g.rollouts]
    for i, r in enumerate(rows):
        span = slice(len(r.prompt_ids) - 1, len(r.prompt_ids) - 1 + 6)
        assert batch.versions[i, span].tolist() == r.versions
        torch.testing.assert_close(batch.behaviour_logprobs[i, span], torch.tensor(r.logprobs))


# ---------------------------------------------------------------------------- failures (last)
def test_no_ready_server_makes_requests_wait_not_fail(client, ref):
    """With ``wait_for_server``, requests that find every server behind wait for one to be
    routable again (as a restarted server is, once re-pushed), and the wait is counted."""
    version, before = client.version, client.stats()["no_server_s"]
    client.adopt_version(version + 100)  # no server serves it: none is routable
    client.wait_for_server = 60.0
    try:
        futures = client.submit(PROMPTS[0], GREEDY)
        time.sleep(2.0)
        assert not any(f.done() for f in futures)
        client.adopt_version(version)
        _assert_matches_greedy(futures[0].result(timeout=60), ref)
    finally:
        client.wait_for_server = 0.0
    assert client.stats()["no_server_s"] - before >= 2.0
    client.adopt_version(version + 100)
    with pytest.raises(ServerError, match=r"no generator server is alive at weight version"):
        client.generate([PROMPTS[0]], GREEDY)  # no wait: fails at once
    client.adopt_version(version)


def test_killed_server_loses_no_rollout_then_is_restarted_and_brought_up_to_date(
    client, launcher, ref, weights, capsys
):
    dead = launcher.servers[1]
    pgid = dead.proc.pid  # the server's guard leads its process group
    (sglang_main,) = psutil.Process(dead.proc.pid).children()
    sglang_main.kill()  # a crash: SIGKILL, no cleanup by SGLang itself
    assert dead.proc.wait(timeout=30) == -signal.SIGKILL
    requeued = client.stats()["requeued_rollouts"]
    # Requests routed to the dead server are re-sent to the live one: none is lost.
    futures = [f for p in PROMPTS * 2 for f in client.submit(p, GREEDY)]
    rollouts = [f.result(timeout=120) for f in futures]
    for r in rollouts:
        _assert_matches_greedy(r, ref)
    assert {r.server for r in rollouts} == {0}
    moved = int(client.stats()["requeued_rollouts"] - requeued)
    assert moved >= 1
    time.sleep(2 * REQUEUE_REPORT_S)
    said = capsys.readouterr().out
    # One line for the lost server, counting every rollout its requests held.
    assert said.count("re-queued") == 1, said
    assert "generator server 1" in said and "died (exit code -9)" in said
    assert f"re-queued {moved} rollout(s)" in said, (moved, said)
    assert_group_gone(pgid)  # SGLang's scheduler and detokenizer went with it

    assert client.restart_server(1) == 0  # back with its checkpoint's weights: behind
    assert {r.server for r in client.generate(PROMPTS * 2, GREEDY)} == {0}
    latest = max(weights)
    client.update_weights(weights[latest], version=latest + 1)
    assert client.weight_versions() == [latest + 1] * 2
    ref.load_weights(weights[latest])
    rollouts = client.generate(PROMPTS * 2, GREEDY)
    assert {r.server for r in rollouts} == {0, 1}
    for r in rollouts:
        _assert_matches_greedy(r, ref)
