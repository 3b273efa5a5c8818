"""The controller's rollout stream against a real SGLang server (CPU, TP=1, fp32).

Partial rollouts: every response is cut after 3 tokens and parked; the weights change;
the parked responses resume under the new version. Each token must keep the version and
the behaviour log-prob it was sampled with (checked against transformers run on each
version's weights), all the way into the trainer's batch.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest
import torch
from safetensors.torch import load_file

from rl.config import compose
from rl.config.sampling import SamplingParams
from rl.controller.batch import build_batch
from rl.controller.rollouts import RolloutStream
from rl.controller.staleness import StalenessGate
from rl.generator.client import GeneratorClient
from rl.generator.launcher import ServerConfig, ServerLauncher
from rl.tasks.common import Example
from rl.tasks.scoring import ScoreResult
from tests.helpers.hf_models import make_model
from tests.helpers.hf_reference import HFReferenceGenerator

PROMPTS = [[1, 5, 6, 7], [1, 9, 9], [1, 40, 41, 42], [1, 3, 4], [1, 77, 12], [1, 60, 61]]
T = 0.8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("llama", tmp_path_factory.mktemp("stream") / "tiny")


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    server = ServerConfig.from_rollout(compose([]).rollout, model_dir)
    with (
        ServerLauncher(server, n=1, log_dir=tmp_path_factory.mktemp("logs")) as launcher,
        GeneratorClient.for_launcher(launcher) as client,
    ):
        yield client
        launcher.stop(grace=0)  # the module is done, nothing in flight: no drain


def _score(group) -> Future:
    """Rewards 1, 0, 1, 0... at once (the reward executor has tests of its own)."""
    f: Future = Future()
    f.set_result([ScoreResult(float(i % 2 == 0)) for i in range(len(group.rollouts))])
    return f


def test_partial_rollouts_resume_across_a_weight_update(client, model_dir):
    v0 = client.version
    sampling = SamplingParams(temperature=T, max_new_tokens=6, ignore_eos=True, n=2)
    gate = StalenessGate(max_lag=1, mode="throttle", per_step=2)  # 4 groups may start at v0
    prompts = iter(Example(f"p{i}", tuple(p), "") for i, p in enumerate(PROMPTS))
    stream = RolloutStream(
        client,
        _score,
        lambda: next(prompts),
        sampling,
        gate,
        v0,
        segment_tokens=3,
        eager_resume=False,
    ).start()
    try:
        deadline = time.monotonic() + 120
        while stream.parked < 8:  # 4 groups x 2 samples, each cut after 3 tokens
            assert time.monotonic() < deadline, f"only {stream.parked} rollouts parked"
            time.sleep(0.05)
        g = torch.Generator().manual_seed(5)
        new = [
            (n, t + 0.05 * torch.randn(t.shape, generator=g))
            for n, t in sorted(load_file(model_dir / "model.safetensors").items())
        ]
        client.update_weights(new, v0 + 1)
        stream.commit(v0 + 1)
        groups, stats = stream.next_batch(trainer_version=v0 + 1)
    finally:
        stream.close()
    assert len(groups) == 2 and stats["lag_max"] == 1 and stats["resumed_segments"] >= 4
    before, after = HFReferenceGenerator(model_dir), HFReferenceGenerator(model_dir)
    after.load_weights(new)
    for grp in groups:
        for r in grp.rollouts:
            assert r.segments == 2 and r.versions == [v0] * 3 + [v0 + 1] * 3
            p, out = r.prompt_ids, r.output_ids
            want = before.score(p, out[:3], T) + after.score(p + out[:3], out[3:], T)
            assert max(abs(a - b) for a, b in zip(r.logprobs, want, strict=True)) < 1e-4
    # ... and the trainer's batch carries them token by token.
    batch = build_batch([g.rollouts for g in groups], [g.rewards for g in groups])
    rows = [r for g in groups for r in g.rollouts]
    for i, r in enumerate(rows):
        span = slice(len(r.prompt_ids) - 1, len(r.prompt_ids) - 1 + 6)
        assert batch.versions[i, span].tolist() == r.versions
        torch.testing.assert_close(batch.behaviour_logprobs[i, span], torch.tensor(r.logprobs))
