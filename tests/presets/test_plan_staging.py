"""The generator's staging of an incoming version (rollout.weight_sync.staging) in the
planner: a device copy is counted on the GPU (and takes KV cache), a host copy in each
generation node's host memory, none nowhere; a plan it breaks is refused naming it."""

from __future__ import annotations

import json

import pytest

from rl.config import ConfigError
from rl.plan import PlanRefused, plan_cluster
from rl.plan.__main__ import main
from rl.plan.cluster import suggested_staging
from rl.plan.memory import GIB
from tests.helpers.configs import config_of as _cfg

BIG = "experiment=llama3_405b_1024gpu"
SMALL = "experiment=llama3_8b_256gpu"


def _staged(experiment: str, staging: str, *more: str):
    return plan_cluster(_cfg(experiment, f"rollout.weight_sync.staging={staging}", *more), False)


@pytest.mark.parametrize("experiment", [SMALL, BIG])
def test_each_option_is_counted_where_it_lives(experiment: str) -> None:
    """device: the rank's whole weight shard again on the GPU, out of the KV cache; host:
    the same bytes per server GPU in its node's host memory; none: nothing anywhere."""
    plans = {s: _staged(experiment, s) for s in ("device", "host", "none")}
    gens = {s: p.generator for s, p in plans.items()}
    assert all(g is not None for g in gens.values())
    dev, host, none = gens["device"], gens["host"], gens["none"]
    assert dev and host and none
    w = none.weights
    assert w == dev.weights == host.weights > 0
    assert (dev.staged, dev.host_staged) == (w, 0)
    assert (host.staged, host.host_staged) == (0, w)
    assert (none.staged, none.host_staged) == (0, 0)
    free = 80 * GIB - none.reserved
    assert none.kv_capacity == host.kv_capacity == (free - w) // none.kv_bytes_per_token
    assert dev.kv_capacity == max(0, free - 2 * w) // dev.kv_bytes_per_token
    # Every generation node carries 8 server GPUs' copies (TP8 x 1 or TP1 x 8).
    assert plans["host"].host_staging == 8 * w
    assert plans["device"].host_staging == plans["none"].host_staging == 0
    assert none.total == host.total <= plans["none"].gpu_bytes


def test_405b_device_staging_is_refused_naming_the_option() -> None:
    """47.8 GB of FP8 weights per GPU: a second copy on an 80 GB GPU leaves no room for
    SGLang's reserve, let alone a KV cache; host and none keep ~17.7 GB of KV cache."""
    plan = _staged(BIG, "device")
    g = plan.generator
    assert g is not None and 47 * GIB < g.weights < 48 * GIB and g.staged == g.weights
    assert not plan.fits and g.kv_capacity == 0
    problem = plan.problems[0]
    assert "staging copy (rollout.weight_sync.staging=device)" in problem
    assert "set rollout.weight_sync.staging=host or none" in problem
    with pytest.raises(PlanRefused, match=r"rollout\.weight_sync\.staging=device"):
        plan_cluster(_cfg(BIG, "rollout.weight_sync.staging=device"))
    for staging in ("host", "none"):
        ok = _staged(BIG, staging)
        assert ok.fits and ok.generator is not None
        kv = ok.generator.kv_tokens * ok.generator.kv_bytes_per_token
        assert 17 * GIB < kv < 18 * GIB and ok.generator.kv_tokens >= ok.sequence


def test_8b_device_staging_fits_with_less_kv_cache() -> None:
    """15 GB of bf16 weights: a device copy fits, and costs the KV cache exactly its bytes."""
    dev, host = _staged(SMALL, "device"), _staged(SMALL, "host")
    assert dev.fits and host.fits and dev.generator and host.generator
    per_token = dev.generator.kv_bytes_per_token
    lost = (host.generator.kv_tokens - dev.generator.kv_tokens) * per_token
    assert abs(lost - dev.generator.weights) < per_token


def test_device_copy_that_shrinks_kv_below_a_sequence_is_refused() -> None:
    """A GPU that holds the weights twice and the reserve, but a KV cache one token short
    of a sequence beside the copy (the trainer does not fit such a GPU: only the
    generator's verdict is read)."""
    g = _staged(SMALL, "none").generator
    assert g is not None
    need = 2 * g.weights + g.reserved + 8191 * g.kv_bytes_per_token
    gb = f"cluster.gpu_memory_gb={need / GIB}"
    gen = [p for p in _staged(SMALL, "none", gb).problems if p.startswith("generator")]
    assert gen == []
    gen = [p for p in _staged(SMALL, "device", gb).problems if p.startswith("generator")]
    assert len(gen) == 1 and gen[0].startswith("generator KV cache holds 8191 tokens")
    assert "rollout.weight_sync.staging=host or none" in gen[0]


def test_host_copies_past_the_nodes_memory_are_refused() -> None:
    """8 x 47.8 GB of host copies on a node with 256 GB."""
    plan = _staged(BIG, "host", "cluster.host_memory_gb=256")
    assert not plan.fits
    (problem,) = plan.problems
    assert "382.0 GB of host memory" in problem and "cluster.host_memory_gb=256" in problem
    assert "rollout.weight_sync.staging=none" in problem
    assert _staged(BIG, "host", "cluster.host_memory_gb=null").fits  # unknown: not checked


def test_unknown_staging_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"rollout\.weight_sync\.staging='gpu' must be one of"):
        plan_cluster(_cfg(SMALL, "rollout.weight_sync.staging=gpu"))


def test_suggestion_follows_the_kv_and_host_shares() -> None:
    """device only where its copy costs <= 10% of the KV cache; else host where a node's
    copies take <= 25% of its host memory; else none; CPU: device."""
    assert suggested_staging(_cfg(BIG), _staged(BIG, "none")) == "none"
    roomy = _cfg(BIG, "cluster.host_memory_gb=2048")
    assert suggested_staging(roomy, plan_cluster(roomy)) == "host"  # 382 GB <= 512 GB
    assert suggested_staging(_cfg(SMALL), _staged(SMALL, "host")) == "host"
    small_weights = _cfg(SMALL, "model=qwen3_0_6b")
    assert suggested_staging(small_weights, plan_cluster(small_weights, False)) == "device"
    cpu = _cfg()
    assert suggested_staging(cpu, plan_cluster(cpu)) == "device"


def test_cli_shows_the_staging(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([SMALL, "rollout.weight_sync.staging=device"]) == 0
    text = capsys.readouterr().out
    assert "weights 15.0 GB + staging copy 15.0 GB + SGLang reserve" in text
    assert main([SMALL, "rollout.weight_sync.staging=host"]) == 0
    text = capsys.readouterr().out
    assert "staging in host memory" in text
    assert "host memory per generation node: staging copies 119.7 GB" in text
    assert main([BIG, "rollout.weight_sync.staging=none", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    gen = out["memory"]["generator"]
    assert (gen["staging"], gen["staged"], gen["host_staged"]) == ("none", 0, 0)
    assert out["host_staging_per_node"] == 0
