"""Routing replay in the Megatron trainer (rl/engine/routing_replay.py) is exact at every
layout: EP=2, TP=2 (sequence parallel) and PP=2 route each token to the replayed experts,
token by token and layer by layer, and score it as EP=1 does.

The tiny Qwen3-MoE (conf/model/tiny_moe.yaml: 2 layers, 4 experts, top-2). At TP=PP=DP=1
the model's own routing, replayed, gives its own log-probs bit for bit (the token order
and the gating weights are right); a random routing changes them, and the same routing
shifted by one layer changes them again (what a layer mix-up would do).
"""

from __future__ import annotations

import pytest
import torch

from rl.runtime.launch import spawn
from tests.helpers.replay_workers import ROWS, random_routing, replay_layout
from tests.multiproc.test_parallel_parity import LOGPROB_RTOL, TOL

ROUTING = random_routing(layers=2, experts=4, topk=2)


def _layout(tp: int = 1, pp: int = 1, dp: int = 1, ep: int = 1, mbs: int = 2) -> list[str]:
    # Padded micro-batches: the routers' choices are read back in Megatron's [s, b] token
    # order (replay with packing: tests/multiproc/test_packing_parity.py).
    return ["model=tiny_moe", f"trainer.tp={tp}", f"trainer.pp={pp}", f"trainer.dp={dp}",
            f"trainer.ep={ep}", f"trainer.micro_batch_size={mbs}",
            f"trainer.global_batch_size={ROWS}", "trainer.packing=false"]  # fmt: skip


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    init = str(tmp_path_factory.mktemp("replay") / "init")
    (ref,) = spawn(replay_layout, 1, _layout(mbs=ROWS), None, ROUTING, init)
    return init, ref


def test_the_models_own_routing_replayed_gives_its_own_logprobs(reference):
    _, ref = reference
    assert ref["exact"] and ref["checked"] == {0: ROWS * 15, 1: ROWS * 15}
    mask = torch.ones_like(ref["own"], dtype=torch.bool)
    mask[:, -1] = False  # the last position is never scored
    assert not torch.allclose(ref["replayed"][mask], ref["own"][mask], atol=1e-3)
    assert 0 < ref["agreement"]["routing_agreement"] < 1
    assert torch.equal(ref["own_replayed"], ref["own"])
    assert ref["own_agreement"] == {"routing_agreement": 1.0}
    assert not torch.allclose(ref["shifted_replayed"][mask], ref["own"][mask], atol=1e-3)


@pytest.mark.parametrize(
    ("tp", "pp", "dp", "ep"),
    [(1, 1, 2, 2), (2, 1, 1, 1), (1, 2, 1, 1)],
    ids=["ep2", "tp2-sp", "pp2"],
)
def test_every_layout_replays_exactly_and_scores_as_ep1(reference, tp, pp, dp, ep):
    init, ref = reference
    out = spawn(replay_layout, tp * pp * dp, _layout(tp, pp, dp, ep), init, ROUTING)
    for r in out:
        assert r["exact"] and r["checked"], r["checked"]
        torch.testing.assert_close(r["replayed"], ref["replayed"], atol=TOL, rtol=LOGPROB_RTOL)
        torch.testing.assert_close(r["own"], ref["own"], atol=TOL, rtol=LOGPROB_RTOL)
        assert r["agreement"] == pytest.approx(ref["agreement"])
    layers = sorted(k for r in out for k in r["checked"])
    assert layers == ([0, 0, 1, 1] if pp == 1 else [0, 1])  # PP: each stage its own layer
