"""DDMA into a live SGLang server (CPU, TP=1, fp32).

End to end: a Megatron TP=2 trainer takes one optimizer step and DDMAs its shards into
the server; SGLang's greedy output and log-probs then equal transformers run on the
trainer's checkpoint converted to HF. Then the failure modes: a corrupt bucket, a
trainer whose model differs from the served one, and a trainer that dies mid-transfer
must each be refused with a clear error while the server keeps serving the previous
complete version. Tests run in file order on one server.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rl.batch import TrainBatch
from rl.compose import compose
from rl.config.sampling import SamplingParams
from rl.ddma import wire
from rl.ddma.plan import DstLayout, SrcLayout, make_plan
from rl.generator.client import GeneratorClient
from rl.generator.ddma_target import SGLangTarget, SyncError
from rl.runtime import secret
from rl.runtime.launch import spawn
from rl.serving.launcher import ServerConfig, ServerError, ServerLauncher
from rl.serving.server_api import job_keys
from rl.weights.convert import hf_to_mcore, mcore_to_hf, prepare_hf_to_mcore
from tests.helpers.ddma_util import hf_state, megatron_globals, megatron_shards, model_dims
from tests.helpers.ddma_workers import train_then_sync
from tests.helpers.hf_models import make_model
from tests.helpers.hf_reference import HFReferenceGenerator

CPU_DST = DstLayout.sglang(1, "cpu")  # what a CPU server holds (MLP width padded)
PROMPTS = [[1, 5, 6, 7], [1, 40, 41, 42, 43], [1, 77, 12, 60]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("llama", tmp_path_factory.mktemp("ddma_live") / "llama")


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    """The server's keys derive from a job secret, as in an RL job: the trainer ranks that
    ``synced`` spawns find it through MSRL_SECRET_FILE (inherited) and build their
    targets without keys, as a job's trainer ranks do."""
    cfg = compose([])
    logs = tmp_path_factory.mktemp("logs")
    with pytest.MonkeyPatch.context() as mp:
        # Recorded as unset (setenv first), so the variable secret.ensure sets below is
        # removed again after the module instead of leaking into later tests' jobs.
        mp.setenv(secret.ENV, "")
        mp.delenv(secret.ENV)
        secret.ensure(tmp_path_factory.mktemp("run"))  # sets MSRL_SECRET_FILE
        server = replace(ServerConfig.from_rollout(cfg.rollout, model_dir), keys=job_keys())
        with (
            ServerLauncher(server, n=1, log_dir=logs) as launcher,
            GeneratorClient.for_launcher(launcher) as client,
        ):
            yield client
            launcher.stop(grace=0)  # the module is done, nothing in flight: no drain


def _assert_serves(client: GeneratorClient, ref: HFReferenceGenerator, version: int) -> None:
    assert client.weight_versions() == [version]
    for prompt, got in zip(PROMPTS, client.generate(PROMPTS, GREEDY), strict=True):
        want = ref.generate(prompt, GREEDY)
        assert got.output_ids == want.output_ids
        assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True)) < 1e-4


@pytest.fixture(scope="module")
def synced(client, model_dir, tmp_path_factory):
    """Run the end-to-end step once; later tests start from the version it committed."""
    root = tmp_path_factory.mktemp("ddma_e2e")
    m, _ = prepare_hf_to_mcore(str(model_dir), 2, 1, vocab_multiple=128, dtype=None)
    hf_to_mcore(str(model_dir), str(root / "init"), tp=2)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 99, (4, 16), generator=g)
    batch = TrainBatch(tokens, torch.ones(4, 16))
    out = spawn(
        train_then_sync, 2, str(root / "init"), m, client.urls[0], str(root / "step1"), batch
    )
    mcore_to_hf(str(root / "step1"), str(root / "hf1"))
    return {"out": out, "hf1": root / "hf1", "ref": HFReferenceGenerator(root / "hf1")}


def test_trained_step_reaches_sglang_exactly(client, model_dir, synced):
    out = synced["out"]
    assert out[0]["metrics"]["loss"] > 0
    # The step changed the model (else the test below would prove nothing) ...
    before = HFReferenceGenerator(model_dir)
    changed = [
        before.generate(p, GREEDY).output_ids != synced["ref"].generate(p, GREEDY).output_ids
        for p in PROMPTS
    ]
    assert any(changed)
    # ... and SGLang now serves exactly the trainer's new weights.
    _assert_serves(client, synced["ref"], 1)
    client.adopt_version(1)  # what the controller does after a DDMA commit
    assert client.version == 1
    # Each trainer rank sent only its part; together, exactly the server's real bytes.
    plan = make_plan(model_dims(model_dir, 2), SrcLayout(2), CPU_DST, 4, 1 << 16)
    assert sum(o["stats"].payload_bytes for o in out) == plan.dst_bytes()
    assert all(o["stats"].payload_bytes < 0.6 * plan.dst_bytes() for o in out)


def _stage_all(target: SGLangTarget, glob: dict, version: int, upto: int | None = None):
    plan = target.plan
    for r in range(plan.src.world):
        shards = megatron_shards(glob, plan, r)
        target.push(r, lambda k, i, s=shards: s[(k, i)], version)
        if upto is not None and r + 1 >= upto:
            return


@pytest.fixture
def fresh(model_dir):
    """Megatron globals of a version 2 (perturbed original weights) and a TP=2 plan."""
    d = model_dims(model_dir, 2)
    hf = {n: t + 0.05 * torch.randn_like(t) for n, t in hf_state(model_dir).items()}
    return d, megatron_globals(hf, d), hf


def test_corrupt_bucket_keeps_previous_version(client, synced, fresh, monkeypatch):
    d, glob, _ = fresh
    plan = make_plan(d, SrcLayout(2), CPU_DST, 4, 1 << 14)
    target = SGLangTarget(client.urls[0], plan, torch.float32, keys=client.keys)
    original = wire.write_header

    def flip_one(buf, plan, bucket, version):
        original(buf, plan, bucket, version)
        if bucket.index == 3:
            buf[bucket.nbytes - 1] ^= 0x01

    monkeypatch.setattr(wire, "write_header", flip_one)
    target.begin(2)
    with pytest.raises(SyncError, match="checksum mismatch"):
        _stage_all(target, glob, 2)
    with pytest.raises(SyncError, match="version 2 already failed"):
        target.commit(2)
    _assert_serves(client, synced["ref"], 1)
    # A controller that assumed the version landed routes nothing to the server.
    client.adopt_version(2)
    with pytest.raises(ServerError, match=r"at weight version 2 .*behind: \[0\]"):
        client.generate(PROMPTS[:1], GREEDY)
    client.adopt_version(1)


def test_architecture_mismatch_is_refused(client, synced, fresh):
    d, _, _ = fresh
    other = d.__class__(**{**d.__dict__, "ffn": d.ffn * 2})
    plan = make_plan(other, SrcLayout(1), CPU_DST, 4, 1 << 14)
    target = SGLangTarget(client.urls[0], plan, torch.float32, keys=client.keys)
    glob = {
        k: torch.zeros(s) for k, s in plan.src_shapes.items()
    }  # right shapes for the wrong model
    target.begin(2)
    with pytest.raises(SyncError, match=r"architecture mismatch: .*gate_up_proj.* trainer sends"):
        _stage_all(target, glob, 2)
    target.abort(2)
    _assert_serves(client, synced["ref"], 1)


def test_trainer_lost_mid_transfer_then_next_version_lands(client, synced, fresh, tmp_path):
    d, glob, hf = fresh
    plan = make_plan(d, SrcLayout(2), CPU_DST, 4, 1 << 14)
    target = SGLangTarget(client.urls[0], plan, torch.float32, keys=client.keys)
    target.begin(2)
    _stage_all(target, glob, 2, upto=1)  # trainer rank 1 never sends
    with pytest.raises(SyncError, match=r"buckets never arrived"):
        target.commit(2)
    _assert_serves(client, synced["ref"], 1)
    # A complete version then lands.
    target.begin(2)
    _stage_all(target, glob, 2)
    target.commit(2)
    ref = synced["ref"]
    ref.load_weights(hf.items())
    _assert_serves(client, ref, 2)


def test_point_to_point_transport_into_live_server(client, fresh, model_dir, synced):
    """The cross-host transport: trainer ranks and the server's ranks join one gloo group
    through SGLang's /init_weights_update_group; each server rank receives its own
    buckets point to point into staging, then commits."""
    from rl.runtime.net import free_port
    from tests.helpers.ddma_workers import p2p_sync

    d, glob, hf = fresh
    version = client.weight_versions()[0] + 1
    out = spawn(p2p_sync, 2, client.urls, client.keys, free_port(), glob, str(model_dir),
                version)  # fmt: skip
    plan = make_plan(d, SrcLayout(2), CPU_DST, 4, 1 << 14)
    assert sum(o["stats"].payload_bytes for o in out) == plan.dst_bytes()
    ref = synced["ref"]
    ref.load_weights(hf.items())
    _assert_serves(client, ref, version)


def test_same_host_point_to_point_through_shared_memory(client, model_dir, synced):
    """The same-host transport: the group only signals, the server's rank reads each
    bucket from the trainer ranks' shared-memory rings (rl/ddma/shm.py); two versions
    through the same rings, the server then serves the second."""
    from rl.runtime.net import free_port
    from tests.helpers.ddma_shm_workers import p2p_shm_sync

    d = model_dims(model_dir, 2)
    hfs = [{n: t + s * torch.randn_like(t) for n, t in hf_state(model_dir).items()}
           for s in (0.03, 0.05)]  # fmt: skip
    globs = [megatron_globals(hf, d) for hf in hfs]
    version = client.weight_versions()[0] + 1
    out = spawn(p2p_shm_sync, 2, client.urls[0], client.keys, free_port(), globs,
                str(model_dir), version)  # fmt: skip
    plan = make_plan(d, SrcLayout(2), CPU_DST, 4, 1 << 14)
    for v in range(2):
        assert sum(o["stats"][v].payload_bytes for o in out) == plan.dst_bytes()
    assert all(o["rings"][0] == o["rings"][1] for o in out)  # kept across versions
    ref = synced["ref"]
    ref.load_weights(hfs[1].items())
    _assert_serves(client, ref, version + 1)


def test_buckets_handed_over_as_shared_tensors_cuda_ipc_path_on_cpu(client, synced, fresh):
    """The cuda_ipc transport's code on CPU tensors: each bucket stays in the trainer
    rank's slots and the request carries the slot itself (torch shares a CPU tensor
    through a file where it shares a CUDA one by IPC handle); the server verifies and
    scatters from it. Two versions through the same slots."""
    d, glob, hf = fresh
    plan = make_plan(d, SrcLayout(2), CPU_DST, 4, 1 << 14)
    target = SGLangTarget(client.urls[0], plan, torch.float32, keys=client.keys,
                          transport="cuda_ipc", device="cpu")  # fmt: skip
    other = megatron_globals({n: t + 0.02 * torch.randn_like(t) for n, t in hf.items()}, d)
    version = client.weight_versions()[0]
    for v, g in ((version + 1, other), (version + 2, glob)):
        target.begin(v)
        _stage_all(target, g, v)
        target.commit(v)
    ref = synced["ref"]
    ref.load_weights(hf.items())
    _assert_serves(client, ref, version + 2)


def test_trainers_disagreeing_on_the_version_fail_it(client, synced, fresh):
    d, glob, _ = fresh
    plan = make_plan(d, SrcLayout(2), CPU_DST, 4, 1 << 14)
    target = SGLangTarget(client.urls[0], plan, torch.float32, keys=client.keys)
    version = client.weight_versions()[0]
    target.begin(version + 1)
    shards = [megatron_shards(glob, plan, r) for r in range(2)]
    target.push(0, lambda k, i: shards[0][(k, i)], version + 1)
    with pytest.raises(SyncError, match=rf"version {version + 5} .* while version {version + 1}"):
        target.push(1, lambda k, i: shards[1][(k, i)], version + 5)  # a stale trainer rank
    with pytest.raises(SyncError, match="already failed"):
        target.commit(version + 1)
    assert client.weight_versions() == [version]


@pytest.fixture(scope="module")
def served(model_dir):
    """transformers on whatever the tests below last pushed (they push whole models, so
    they need no earlier test: ``-k staging`` runs them on a fresh server)."""
    return HFReferenceGenerator(model_dir)


def _perturbed(model_dir, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in hf_state(model_dir).items()}


@pytest.mark.parametrize("staging", ["device", "host", "none"])
def test_every_staging_serves_the_trainers_weights(client, served, model_dir, staging):
    """Each option pushes weights of its own (so each changes what is served); greedy
    tokens and log-probs then equal transformers on those weights. device and host keep a
    copy of the weights between versions, none holds nothing."""
    d = model_dims(model_dir, 2)
    hf = _perturbed(model_dir, 10 + ["device", "host", "none"].index(staging))
    plan = make_plan(d, SrcLayout(2), CPU_DST, 4, 1 << 16)
    target = SGLangTarget(client.urls[0], plan, torch.float32, staging=staging)
    version = client.weight_versions()[0] + 1
    target.begin(version)
    _stage_all(target, megatron_globals(hf, d), version)
    target.commit(version)
    served.load_weights(hf.items())
    _assert_serves(client, served, version)
    (state,) = target.receivers  # as the commit reported it
    assert (state["staging"], state["torn"]) == (staging, False)
    assert state["staging_bytes"] == (0 if staging == "none" else plan.dst_bytes(real_only=False))
    client.adopt_version(version)


def test_staging_none_incomplete_version_keeps_the_server_out(client, served, fresh):
    """staging none writes in place. A version refused before a byte is written (another
    model) resumes the server on its version; one that loses a trainer rank midway leaves
    it paused, torn, and reporting NOT_READY, so no client routes to it and a request sent
    straight to it is not served; the next complete version resumes it."""
    from rl.generator.ddma_target import NOT_READY
    from rl.serving import server_api as api

    d, glob, hf = fresh
    url, ref = client.urls[0], served
    version = client.weight_versions()[0]
    other = make_plan(d.__class__(**{**d.__dict__, "ffn": d.ffn * 2}), SrcLayout(1), CPU_DST, 4,
                      1 << 14)  # fmt: skip
    wrong = SGLangTarget(url, other, torch.float32, staging="none")
    wrong.begin(version + 1)
    with pytest.raises(SyncError, match="architecture mismatch"):
        _stage_all(wrong, {k: torch.zeros(s) for k, s in other.src_shapes.items()}, version + 1)
    wrong.abort(version + 1)
    _assert_serves(client, ref, version)  # untouched, back in service

    plan = make_plan(d, SrcLayout(2), CPU_DST, 4, 1 << 14)
    target = SGLangTarget(url, plan, torch.float32, staging="none")
    target.begin(version + 1)
    _stage_all(target, glob, version + 1, upto=1)  # trainer rank 1 never sends
    with pytest.raises(SyncError, match="buckets never arrived"):
        target.commit(version + 1)
    assert client.weight_versions() == [NOT_READY]
    assert target.receivers[0]["torn"]  # as the abort's discard reported it
    client.adopt_version(version)  # what the controller last published
    with pytest.raises(ServerError, match=rf"at weight version {version} .*behind: \[0\]"):
        client.generate(PROMPTS[:1], GREEDY)
    direct = api.generate([PROMPTS[0]], [{"temperature": 0, "max_new_tokens": 2}])
    with pytest.raises(api.CallError) as paused:
        api.call(url, direct, target.keys, timeout=3)
    assert not paused.value.answered  # queued behind the pause, never run

    target.begin(version + 2)
    _stage_all(target, glob, version + 2)
    target.commit(version + 2)
    client.adopt_version(version + 2)  # what the controller does after a commit
    ref.load_weights(hf.items())
    _assert_serves(client, ref, version + 2)
    assert not target.receivers[0]["torn"]


# A prompt long enough that its cached prefix is most of what a request computes.
CACHED = [1, *torch.randint(3, 99, (40,), generator=torch.Generator().manual_seed(5)).tolist()]
SERVED_TOL = 1e-4  # SGLang on CPU against transformers (FACTS: not bit-reproducible)


def _cached_generate(url: str, keys, prompt: list[int]) -> tuple[list[int], list[float], int]:
    """Greedy ids, their log-probs, and how many prompt tokens came from the prefix cache."""
    from rl.generator.types import parse_result
    from rl.serving import server_api as api

    out = api.call(url, api.generate([prompt], [{"temperature": 0, "max_new_tokens": 6}]), keys)
    ids, logprobs, _, _ = parse_result(out)
    return ids, logprobs, int(out["meta_info"]["cached_tokens"])


def test_a_prefix_cached_before_a_commit_is_never_reused_after_it(client, served, model_dir):
    """After each commit a prompt the previous weights cached gets the log-probs transformers
    gives on the new weights, from a cache that held none of it (the commit flushed it);
    asked again, the prefix the new weights cached gives them too. Within SERVED_TOL: each
    version moves these log-probs by more than 100 times that."""
    d = model_dims(model_dir, 2)
    plan = make_plan(d, SrcLayout(2), CPU_DST, 4, 1 << 16)
    url = client.urls[0]
    target = SGLangTarget(url, plan, torch.float32)
    for seed in (20, 21):
        _cached_generate(url, client.keys, CACHED)  # now cached, by the old weights
        assert _cached_generate(url, client.keys, CACHED)[2] >= len(CACHED) - 1
        hf = _perturbed(model_dir, seed)
        version = client.weight_versions()[0] + 1
        target.begin(version)
        _stage_all(target, megatron_globals(hf, d), version)
        target.commit(version)
        ids, first, cached = _cached_generate(url, client.keys, CACHED)
        old = served.score(CACHED, ids)
        served.load_weights(hf.items())
        want = served.score(CACHED, ids)
        assert max(abs(a - b) for a, b in zip(old, want, strict=True)) > 100 * SERVED_TOL
        assert max(abs(a - b) for a, b in zip(first, want, strict=True)) < SERVED_TOL
        assert cached == 0
        again, logprobs, cached = _cached_generate(url, client.keys, CACHED)
        assert (again, cached >= len(CACHED) - 1) == (ids, True)
        assert max(abs(a - b) for a, b in zip(logprobs, want, strict=True)) < SERVED_TOL
        client.adopt_version(version)


def test_status_outside_the_servers_directory_is_refused(client, tmp_path):
    """A status path the server did not start with is never written; the server logs why,
    and its own status files (the target's) still work."""
    import json

    from rl.ddma import sglang_receiver as rx
    from rl.generator.weight_payload import serialize
    from rl.serving import server_api as api

    url = client.urls[0]
    plan = make_plan(model_dims(client.launcher.config.model_path, 2), SrcLayout(2), CPU_DST, 4,
                     1 << 14)  # fmt: skip
    target = SGLangTarget(url, plan, torch.float32)
    version = client.weight_versions()[0]
    target.begin(version + 1)  # SGLang takes DDMA requests only in a weight-update session
    evil = tmp_path / "evil.rank{rank}.json"
    entry = [(json.dumps({"op": "state", "status": str(evil)}), torch.zeros(1, dtype=torch.uint8))]
    call = api.update_weights_from_tensor([serialize(entry)], api.DDMA_LOAD_FORMAT)
    assert api.refusal(api.call(url, call, target.keys)) is None  # SGLang: Success
    assert list(tmp_path.iterdir()) == []
    log = client.launcher.servers[0].log_path.read_text(errors="replace")
    assert f"DDMA status path {str(evil)!r} is outside the server's status directory" in log
    assert rx.STATUS_DIR_ENV in log
    target.abort(version + 1)
    assert target.receivers[0]["ok"]
    assert client.weight_versions() == [version]
    assert len(client.generate(PROMPTS[:1], GREEDY)[0].output_ids) > 0
