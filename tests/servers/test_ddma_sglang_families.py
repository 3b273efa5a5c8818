"""DDMA into a live SGLang server (CPU, TP=1, fp32) for the Qwen families.

The end to end of tests/servers/test_ddma_sglang.py (there for Llama) for more architectures,
one live server per model, started from that model's HF directory, one after the other:

* ``qwen3`` (dense; QK-norm, head_dim 32 != hidden / heads): a Megatron TP=2 trainer;
  the CPU server pads the MLP width 176 to 192, which the plan zero-fills;
* ``qwen3_moe`` (every layer MoE, 4 experts top-2): a Megatron trainer with expert
  parallelism (TP=1, DP=2, EP=2), each rank owning two experts, which it moves into
  SGLang's fused ``w13_weight[e]`` / ``w2_weight[e]`` slabs (width 32: not padded);
* ``qwen2_moe`` (q/k/v biases, 4 experts top-2 not renormalised, and a shared expert of
  width 48 under a sigmoid gate): the same EP=2 trainer; SGLang runs the gated shared
  expert in torch on CPU (rl/serving/cpu_shared_expert_gate.py), and pads its width to 64.

Before any sync, the server as started serves transformers' greedy tokens on the same
checkpoint, log-probs within ``START_TOL``. The trainer then takes one optimizer step at a
small learning rate and DDMAs its shards into the server as version 1; SGLang's greedy
tokens then equal transformers' on the trainer's checkpoint converted to HF, and their
log-probs agree within ``TOL``. The step must have changed what the server serves by far
more than ``TOL`` (and, under EP, each EP rank's experts on their own), so a sync that
delivered nothing, or only part, fails.

The MoE servers also return routed experts (routing replay, rl/generator/routing.py, on
CPU through rl/serving/cpu_routed_experts.py): each rollout holds one row per input
token, transformers' router's choice for that token on the trainer's checkpoint, the
same whether the rollout was cut into segments or not.
"""

from __future__ import annotations

import contextlib
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rl.batch import TrainBatch
from rl.compose import compose
from rl.config.sampling import SamplingParams
from rl.ddma.plan import DstLayout, SrcLayout, make_plan
from rl.generator.client import GeneratorClient
from rl.generator.types import Rollout, RoutingShape, routing_versions
from rl.runtime.launch import spawn
from rl.serving.launcher import ServerConfig, ServerLauncher
from rl.serving.server_api import ServerKeys
from rl.weights.convert import mcore_to_hf, prepare_hf_to_mcore
from rl.weights.keymap import Dims
from tests.helpers.ddma_workers import train_then_sync
from tests.helpers.hf_models import make_model
from tests.helpers.hf_reference import HFReferenceGenerator

PROMPTS = [[1, 5, 6, 7], [1, 40, 41, 42, 43], [1, 77, 12, 60]]
GREEDY = SamplingParams(temperature=0, max_new_tokens=10)
TOL = 1e-4  # SGLang against transformers, as in tests/servers/test_ddma_sglang.py
# The server as started against transformers on the same checkpoint, no sync between: only
# the two fp32 forwards differ (FACTS: CPU SGLang is not bit-reproducible).
START_TOL = 1e-5
# kind -> (trainer tp, trainer ep, lr); dp = world / tp, world 2 in both. One Adam step
# moves every weight by about lr (no warm-up): small, as FACTS advises (lr 1e-3 collapsed a
# real model), yet large enough that the step is visible past TOL. Qwen3 at 3e-5 moves the
# served log-probs by ~2e-3. The routed experts of the tiny MoE weigh ~30x less in its
# output: at 3e-5 reverting one EP rank's experts moves them by only ~4e-5 (< TOL, so a
# stale expert would pass unseen); at 3e-4 by ~3.5e-4, which the parity check catches
# (Qwen2-MoE's, beside its shared expert: 2.5e-4 and 6.0e-4).
CASES = {"qwen3": (2, 1, 3e-5), "qwen3_moe": (1, 2, 3e-4), "qwen2_moe": (1, 2, 3e-4)}
MOE = ("qwen3_moe", "qwen2_moe")
# Qwen2-MoE's q/k/v biases at make_model's default spread (1) add one vector to every token
# that outweighs the tiny embeddings, and its routers then send nearly every token to the
# same experts (the step's batch: layer 1 chose experts 0 and 1 for 64 of 64 tokens, so
# one EP rank's experts were never trained, and the routing rows nearly constant). At 0.05
# the biases still dominate q, k and v and every expert gets tokens. Qwen3 has no biases.
BIAS_STD = 0.05


@dataclass
class Synced:
    kind: str
    tp: int
    ep: int
    hf0: Path  # the served model before the step
    hf1: Path  # the trainer's checkpoint after the step, as HF
    client: GeneratorClient
    versions_before: list[int]
    out: list[dict]  # per trainer rank: metrics, DDMA stats, plan rank
    served0: list[Rollout]  # what the server served before the sync
    m: object  # the trainer's model config
    ref: HFReferenceGenerator  # transformers on hf1
    seconds: dict


@pytest.fixture(scope="module", params=list(CASES))
def synced(request, tmp_path_factory):
    """Per family: a live server on the original model, one trainer step DDMA'd into it.
    Module scope with params: pytest tears one family's server down before the next.

    The trainer ranks convert the HF model and take their step while the server starts
    (about a minute on CPU); they wait for its URL in ``url_file`` to sync."""
    kind = request.param
    tp, ep, lr = CASES[kind]
    root = tmp_path_factory.mktemp(f"ddma_{kind}")
    hf0 = make_model(kind, root / kind, bias_std=BIAS_STD)
    m, dtype = prepare_hf_to_mcore(str(hf0), tp, 1, vocab_multiple=128, dtype=None, ep=ep)
    assert dtype == "float32"
    keys = ServerKeys.random()  # the trainer ranks start before the server: hand them over
    server = replace(ServerConfig.from_rollout(compose([]).rollout, str(hf0)), keys=keys,
                     return_routed_experts=kind in MOE)  # fmt: skip
    assert (server.device, server.tp) == ("cpu", 1)  # the layout train_then_sync plans for
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 99, (4, 16), generator=g)
    batch = TrainBatch(tokens, torch.ones(4, 16))
    url_file = root / "server_url"
    t0 = time.perf_counter()
    with ThreadPoolExecutor(1) as pool, contextlib.ExitStack() as stack:
        trainer = pool.submit(
            spawn, train_then_sync, tp * ep, str(root / "init"), m, str(url_file),
            str(root / "step1"), batch, tp, ep, lr, str(hf0), keys,
        )  # fmt: skip
        url = ""
        try:
            launcher = stack.enter_context(ServerLauncher(server, n=1, log_dir=root / "logs"))
            client = stack.enter_context(GeneratorClient.for_launcher(launcher))
            versions_before = client.weight_versions()  # before the trainer may commit
            served0 = client.generate(PROMPTS, GREEDY)
            url = client.urls[0]
        finally:
            # Atomically (the ranks poll for it); empty: they give up instead of waiting.
            url_file.with_suffix(".tmp").write_text(url)
            url_file.with_suffix(".tmp").rename(url_file)
        t1 = time.perf_counter()
        out = trainer.result()
        t2 = time.perf_counter()
        mcore_to_hf(str(root / "step1"), str(root / "hf1"))
        seconds = {"server_ready": round(t1 - t0, 1), "trainer_done": round(t2 - t0, 1)}
        yield Synced(
            kind, tp, ep, hf0, root / "hf1", client, versions_before, out, served0, m,
            HFReferenceGenerator(root / "hf1"), seconds,
        )  # fmt: skip
        launcher.stop(grace=0)  # the module is done, nothing in flight: no drain


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _served(s: Synced) -> list[Rollout]:
    return s.client.generate(PROMPTS, GREEDY)


def test_the_server_as_started_serves_transformers(synced: Synced):
    """Before any sync, the server serves transformers' greedy tokens on the checkpoint it
    started from, log-probs within ``START_TOL`` (for Qwen2-MoE: its gated shared expert,
    through rl/serving/cpu_shared_expert_gate.py; without it the server dies at start)."""
    ref = HFReferenceGenerator(synced.hf0)
    diffs = []
    for prompt, got in zip(PROMPTS, synced.served0, strict=True):
        want = ref.generate(prompt, GREEDY)
        assert got.output_ids == want.output_ids
        diffs.append(_max_diff(got.logprobs, want.logprobs))
    print(f"[{synced.kind}] as started: max |SGLang - transformers| log-prob {max(diffs):.2e}")
    assert max(diffs) < START_TOL


def test_step_reaches_sglang_exactly(synced: Synced):
    s = synced
    assert s.versions_before == [0]
    assert s.out[0]["metrics"]["loss"] > 0
    assert sorted(o["rank"] for o in s.out) == [0, 1]
    assert s.client.weight_versions() == [1]  # the version moved
    for prompt, got in zip(PROMPTS, _served(s), strict=True):
        want = s.ref.generate(prompt, GREEDY)
        assert got.output_ids == want.output_ids
        assert len(got.output_ids) > 1
        assert _max_diff(got.logprobs, want.logprobs) < TOL


def test_step_changed_what_is_served(synced: Synced):
    """The served model is not the pre-step one: the pre-step model scores the tokens
    SGLang now emits with log-probs far from SGLang's (else the test above proves
    nothing)."""
    before = HFReferenceGenerator(synced.hf0)
    moved = max(
        _max_diff(got.logprobs, before.score(prompt, got.output_ids))
        for prompt, got in zip(PROMPTS, _served(synced), strict=True)
    )
    lr = synced.out[0]["metrics"].get("lr")
    print(
        f"[{synced.kind}] lr {lr}: max |served - pre-step| log-prob {moved:.2e}; {synced.seconds}"
    )
    assert moved > 10 * TOL


def test_each_rank_sent_only_its_part(synced: Synced):
    """Together the trainer ranks sent exactly the server's real bytes, each about half;
    the server's MLP widths are SGLang's CPU padding of them (the commit checked the live
    shapes against the plan)."""
    s = synced
    dst = DstLayout.sglang(1, "cpu")
    assert dst.ffn_multiple == 32
    src = SrcLayout(s.tp, 1, 2 // s.tp, ep=s.ep)
    plan = make_plan(Dims.of(s.m), src, dst, 4, 1 << 16)
    sent = [o["stats"].payload_bytes for o in s.out]
    assert sum(sent) == plan.dst_bytes()
    assert all(b < 0.6 * plan.dst_bytes() for b in sent)
    shapes = plan.dst_shapes
    if s.kind == "qwen3":  # ffn 176 -> 192 on a CPU server; the 16 extra rows are zeros
        assert shapes["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 192, 64)
        assert shapes["model.layers.0.mlp.down_proj.weight"] == (64, 192)
        assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == ((4 + 2 + 2) * 32, 64)
        assert plan.fills
    else:  # expert width 32 is a multiple of 32: no padding
        assert shapes["model.layers.0.mlp.experts.w13_weight[3]"] == (64, 64)
        assert shapes["model.layers.1.mlp.experts.w2_weight[0]"] == (64, 32)
        assert not any("experts" in p.dst_name for p in plan.fills)
    if s.kind == "qwen2_moe":  # the shared expert 48 -> 64; its gate one row
        assert shapes["model.layers.0.mlp.shared_expert.gate_up_proj.weight"] == (2 * 64, 64)
        assert shapes["model.layers.1.mlp.shared_expert.down_proj.weight"] == (64, 64)
        assert shapes["model.layers.0.mlp.shared_expert_gate.weight"] == (1, 64)
        assert {p.dst_name for p in plan.fills if "shared_expert." in p.dst_name}


@pytest.mark.parametrize("synced", MOE, indirect=True)
def test_every_ep_rank_delivered_its_experts(synced: Synced, tmp_path):
    """Under EP each rank owns two experts. Reverting one owner's experts to their
    pre-step weights (everything else post-step) gives a model whose log-probs are more
    than 2 x TOL from what the server serves. So a server still holding that rank's old
    experts would have failed the parity check above: each EP rank's new experts, not
    only the dense weights, reached SGLang's fused slabs."""
    s = synced
    assert s.ep > 1
    old, new = load_file(str(s.hf0 / "model.safetensors")), _tensors(s.hf1)
    served = _served(s)
    per_owner = s.m.num_experts // s.ep
    for owner in range(s.ep):
        mine = [f".mlp.experts.{e}." for e in range(owner * per_owner, (owner + 1) * per_owner)]
        mixed = {n: (old[n] if any(k in n for k in mine) else t) for n, t in new.items()}
        reverted = sum(not torch.equal(mixed[n], new[n]) for n in new)
        assert reverted == s.m.num_layers * 3 * per_owner  # gate, up, down per expert
        d = tmp_path / f"revert{owner}"
        shutil.copytree(s.hf1, d)
        for f in d.glob("*.safetensors*"):
            f.unlink()
        save_file(
            {n: t.contiguous() for n, t in mixed.items()},
            str(d / "model.safetensors"),
            metadata={"format": "pt"},
        )
        ref = HFReferenceGenerator(d)
        moved = max(
            _max_diff(got.logprobs, ref.score(prompt, got.output_ids))
            for prompt, got in zip(PROMPTS, served, strict=True)
        )
        print(f"[{s.kind}] EP rank {owner}'s experts reverted: max log-prob diff {moved:.2e}")
        assert moved > 2 * TOL


@pytest.mark.parametrize("synced", MOE, indirect=True)
def test_routing_rows_are_the_routers_choice_for_each_input_token(synced: Synced):
    """Rollouts cut every 3 tokens hold ``len(prompt) + len(output) - 1`` rows, the rows
    of the uncut rollouts: a resumed segment asks only for the rows it adds. Row ``i`` is
    the top-2 of transformers' router for token ``i`` in each layer (as a set: the order
    within a row is SGLang's), all routed by version 1."""
    s = synced
    assert s.client.limits.routing == RoutingShape(layers=2, topk=2, experts=4)
    cut, whole = s.client.generate(PROMPTS, GREEDY, segment_tokens=3), _served(s)
    assert sum(r.segments for r in cut) > len(PROMPTS)
    picked: list[torch.Tensor] = []
    routers = [m for m in s.ref.model.modules() if type(m).__name__.endswith("MoeTopKRouter")]
    assert len(routers) == 2  # one per layer: Qwen3MoeTopKRouter, Qwen2MoeTopKRouter
    hooks = [m.register_forward_hook(lambda m, i, out: picked.append(out[2])) for m in routers]
    try:
        for prompt, r, w in zip(PROMPTS, cut, whole, strict=True):
            n = len(prompt) + len(r.output_ids) - 1
            assert r.output_ids == w.output_ids and r.routing is not None
            assert r.routing.shape == (n, 2, 2) and r.routing.dtype == torch.int8
            assert torch.equal(r.routing, w.routing)
            picked.clear()
            with torch.no_grad():
                s.ref.model(torch.tensor([prompt + r.output_ids[:-1]]))
            hf = torch.stack(picked, 1)  # [n, layers, topk]
            assert torch.equal(r.routing.long().sort(-1).values, hf.sort(-1).values)
            assert routing_versions(r) == [1] * n
    finally:
        for h in hooks:
            h.remove()


@pytest.mark.parametrize("synced", ["qwen3_moe"], indirect=True)
def test_the_servers_routing_replayed_in_the_trainer_is_chosen_exactly(synced: Synced):
    """The rows the server returned, replayed in the Megatron trainer at EP=2 from the
    checkpoint the server serves: every router chooses them, token by token and layer by
    layer, and the sampled tokens' log-probs are the server's."""
    s = synced
    from rl.controller.batch import build_batch
    from tests.helpers.replay_workers import replay_checkpoint

    sampled = s.client.generate(PROMPTS[:2], SamplingParams(temperature=1.0, max_new_tokens=6,
                                                            seed=5, n=2))  # fmt: skip
    groups = [sampled[i : i + 2] for i in range(0, len(sampled), 2)]
    batch = build_batch(groups, [[0.0, 0.0]] * len(groups))
    assert batch.routing is not None
    out = spawn(replay_checkpoint, 2, s.m, str(s.hf1.parent / "step1"), s.ep, batch)
    assert all(r["exact"] for r in out) and all(sum(r["checked"].values()) for r in out)
    mask = batch.loss_mask.bool()
    for r in out:
        assert (r["logprobs"][mask] - batch.behaviour_logprobs[mask]).abs().max() < 1e-4
        assert r["routing_agreement"] > 0.9


def _tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out
