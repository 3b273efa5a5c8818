"""Relayed DDMA into two live SGLang servers (CPU, TP=1, fp32): the trainer ranks feed the
first server only, which forwards every bucket to the second while it receives the next
(rl/ddma/relay.py). Both must then serve exactly the trainer's weights: greedy outputs and
log-probs equal transformers' on the same weights. Then the same with the servers
generating while the buckets arrive (rollout.weight_sync.overlap). Tests run in order."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from rl.compose import compose
from rl.config.sampling import SamplingParams
from rl.ddma.plan import DstLayout, SrcLayout, make_plan
from rl.generator.client import GeneratorClient
from rl.runtime.launch import spawn
from rl.runtime.net import free_port
from rl.serving.launcher import ServerConfig, ServerLauncher
from tests.helpers.ddma_util import hf_state, megatron_globals, model_dims
from tests.helpers.ddma_workers import p2p_sync
from tests.helpers.hf_models import make_model
from tests.helpers.hf_reference import HFReferenceGenerator

PROMPTS = [[1, 5, 6, 7], [1, 40, 41, 42, 43]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=8)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("llama", tmp_path_factory.mktemp("ddma_relay") / "llama")


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    cfg = compose([])
    server = replace(ServerConfig.from_rollout(cfg.rollout, model_dir))
    with (
        ServerLauncher(server, n=2, log_dir=tmp_path_factory.mktemp("logs")) as launcher,
        GeneratorClient.for_launcher(launcher) as client,
    ):
        yield client
        launcher.stop(grace=0)  # the module is done, nothing in flight: no drain


def _perturbed(model_dir, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g) for n, t in hf_state(model_dir).items()}


def _assert_each_serves(client: GeneratorClient, ref: HFReferenceGenerator) -> None:
    for server in range(2):  # route to one server at a time
        client.mark_dead(1 - server)
        try:
            for prompt, got in zip(PROMPTS, client.generate(PROMPTS, GREEDY), strict=True):
                want = ref.generate(prompt, GREEDY)
                assert got.output_ids == want.output_ids, server
                diff = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
                assert diff < 1e-4, (server, diff)
        finally:
            client.revive(1 - server)


def test_a_chain_of_two_live_servers_serves_the_trainers_weights(client, model_dir):
    hf = _perturbed(model_dir, 7)
    d = model_dims(model_dir, 2)
    version = max(client.weight_versions()) + 1
    out = spawn(p2p_sync, 2, client.urls, client.keys, free_port(), megatron_globals(hf, d),
                str(model_dir), version, "chain")  # fmt: skip
    assert out[0]["parents"] == (-1, 0)  # the second server's parent is the first
    # The trainer ranks sent each byte once (one server's worth), not once per server.
    plan = make_plan(d, SrcLayout(2), DstLayout.sglang(1, "cpu"), 4, 1 << 14)
    assert sum(o["stats"].payload_bytes for o in out) == plan.dst_bytes()
    assert client.weight_versions() == [version, version]
    client.adopt_version(version)  # what the controller does after a DDMA commit
    ref = HFReferenceGenerator(model_dir)
    ref.load_weights(hf.items())
    before = HFReferenceGenerator(model_dir)
    assert any(before.generate(p, GREEDY).output_ids != ref.generate(p, GREEDY).output_ids
               for p in PROMPTS)  # fmt: skip
    _assert_each_serves(client, ref)


def test_servers_generate_while_the_buckets_arrive(client, model_dir):
    """Overlapped: once the servers have started receiving, and before the trainer sends a
    byte, each answers a request, on the weights it served before the sync; after the
    commit both serve the new weights exactly."""
    old = HFReferenceGenerator(model_dir)
    old.load_weights(_perturbed(model_dir, 7).items())  # the previous test's version
    hf = _perturbed(model_dir, 8)
    d = model_dims(model_dir, 2)
    version = max(client.weight_versions()) + 1
    out = spawn(p2p_sync, 2, client.urls, client.keys, free_port(), megatron_globals(hf, d),
                str(model_dir), version, "chain", PROMPTS[0])  # fmt: skip
    assert out[0]["during"] == [old.generate(PROMPTS[0], GREEDY).output_ids] * 2
    assert client.weight_versions() == [version, version]
    client.adopt_version(version)
    ref = HFReferenceGenerator(model_dir)
    ref.load_weights(hf.items())
    assert ref.generate(PROMPTS[0], GREEDY).output_ids != out[0]["during"][0]
    _assert_each_serves(client, ref)
