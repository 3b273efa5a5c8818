"""Balanced DDMA senders (rl/ddma/balance.py) and relay fan-out plans (rl/ddma/relay.py), on a
tiny model's shapes: milliseconds per case. tests/multiproc/test_ddma_engine.py runs relay
plans over gloo; tests/presets/test_plan_presets.py checks the paper presets' figures."""

from __future__ import annotations

import pytest

from rl.ddma import balance, relay
from rl.ddma.plan import DstLayout, PlanError, SrcLayout, coverage_errors, make_plan
from rl.weights import keymap as km

D = km.Dims(
    layers=4, hidden=64, ffn=256, heads=4, groups=2, head_dim=16, vocab=512,
    padded_vocab=512, tied=False, qkv_bias=False,
)  # fmt: skip


def _plan(src=None, tp=2, bucket=8192, fp8=None):
    return make_plan(D, src or SrcLayout(2, 1, dp=2), DstLayout(tp), 4, bucket, fp8)


def _sent(plan):
    sent, _, _ = relay.traffic(plan)
    return [sent.get(r, 0) for r in range(plan.src.world)]


# ------------------------------------------------------------------ balanced senders
def test_assign_covers_each_run_once_on_its_holders():
    runs = [
        balance.Run((0, 1, 2), 100, 1, 8),  # large: one chunk per holder
        balance.Run((1, 3), 50, 16, 64),  # cut on multiples of 16 only
        balance.Run((2,), 7, 1, 8),
        balance.Run((0, 1, 2, 3), 1, 1, 4),  # small: whole, to the least loaded
    ]
    out = balance.assign(runs, world=4)
    for r, chunks in zip(runs, out, strict=True):
        at = 0
        for off, n, rank in chunks:
            assert off == at and rank in r.holders and off % r.unit == 0
            at += n
        assert at == r.length
    assert sorted(rank for _, _, rank in out[0]) == [0, 1, 2]
    assert [n for _, n, _ in out[0]] == [34, 33, 33]
    assert [n for _, n, _ in out[1]] == [32, 18]  # 4 blocks of 16: 2 and 2 (the last short)
    assert out[3][0][2] == 3  # rank 3 carries the least load at that point
    assert balance.assign(runs, 4) == out  # deterministic


def test_assign_refuses_a_run_nobody_holds():
    with pytest.raises(ValueError, match="run 0 has no trainer rank"):
        balance.assign([balance.Run((), 4, 1, 4)], 2)


@pytest.mark.parametrize(
    "src", [SrcLayout(2, 1, dp=4), SrcLayout(1, 2, dp=3), SrcLayout(2, 2, dp=2)]
)
def test_every_trainer_rank_sends_about_the_mean(src):
    """Data-parallel replicas and TP ranks share each stage's bytes; the stages differ only
    by what they hold (the first has the embedding, the last the output layer)."""
    plan = _plan(src, tp=2, bucket=1 << 20)
    assert coverage_errors(plan) == []
    sent = _sent(plan)
    for pp in range(src.pp):
        stage = [sent[src.rank(t, pp, d)] for t in range(src.tp) for d in range(src.dp)]
        assert max(stage) <= 1.1 * min(stage), stage


def test_fp8_chunks_stay_on_block_boundaries():
    """Four replicas split each quantized weight between them, on 16-row blocks."""
    plan = _plan(SrcLayout(1, 1, dp=4), tp=1, bucket=1 << 20, fp8=16)
    assert coverage_errors(plan) == []
    pieces = [p for b in plan.buckets for p in b.pieces if plan.quantized(p.dst_name)]
    name = "model.layers.0.mlp.down_proj.weight"
    assert len({p.src for p in pieces if p.dst_name == name}) == 4
    assert all(p.dst_start % 16 == 0 for p in pieces)


# ------------------------------------------------------------------ relay topology
def test_topologies():
    assert relay.topology(7, "chain", 2, 2) == (-1, -1, 0, 1, 2, 3, 4)
    assert relay.topology(7, "tree", 1, 2) == (-1, 0, 0, 1, 1, 2, 2)
    assert relay.topology(6, "tree", 2, 3) == (-1, -1, 0, 0, 0, 1)
    assert relay.topology(3, "none", 1, 2) == (-1, -1, -1)
    assert relay.topology(2, "chain", 5, 2) == (-1, -1)


@pytest.mark.parametrize(
    "args,match",
    [
        ((3, "ring", 1, 2), r"relay='ring' must be one of"),
        ((3, "tree", 1, 0), "relay_fanout=0 must be >= 1"),
    ],
)
def test_bad_relay_settings_are_named(args, match):
    with pytest.raises(PlanError, match=match):
        relay.topology(*args)
    with pytest.raises(PlanError, match="relay_roots=-1"):
        relay.attach(_plan(), 2, "chain", roots=-1)


def test_one_replica_plan_is_unchanged():
    plan = _plan()
    digest, buckets = plan.digest, list(plan.buckets)
    relay.attach(plan, 1, "chain", roots=1)
    assert plan.hops == [] and plan.digest == digest and plan.buckets == buckets


@pytest.mark.parametrize(
    "replicas,kind,roots,fanout",
    [
        (2, "chain", 1, 2),
        (5, "chain", 2, 2),
        (6, "tree", 1, 2),
        (7, "tree", 2, 3),
        (3, "none", 0, 2),
    ],
)
def test_relay_plan_writes_every_replica_once(replicas, kind, roots, fanout):
    template = _plan()
    per_replica = template.sent_bytes()
    one = _sent(template)
    plan = relay.attach(_plan(), replicas, kind, roots=roots, fanout=fanout)
    assert coverage_errors(plan) == [] and relay.schedule_errors(plan) == []
    n_roots = plan.parents.count(relay.TRAINER)
    assert n_roots == (replicas if kind == "none" else roots)
    sent, got, fwd = relay.traffic(plan)
    # The trainer sends each byte once per root; every replica receives all of it.
    assert [sent.get(r, 0) for r in range(plan.src.world)] == [n_roots * x for x in one]
    assert sum(got.values()) == replicas * per_replica
    children = [plan.parents.count(r) for r in range(replicas)]
    for r in range(replicas):
        mine = sum(fwd.get(relay.flat(plan, r, j), 0) for j in range(plan.dst.tp))
        assert mine == children[r] * per_replica
    # The engine's walks are the hops, seen from each rank.
    assert sum(len(to) for s in range(plan.src.world) for _, to in relay.trainer_walk(plan, s)) == (
        n_roots * len(plan.buckets)
    )
    for r in range(replicas):
        for j in range(plan.dst.tp):
            walk = relay.replica_walk(plan, r, j)
            assert len(walk) == len(template.receives(j))
            assert all(len(f) == children[r] for _, _, f in walk)
    # The planner's byte counts (no hops built) are the hops' own.
    counts = relay.attach(_plan(), replicas, kind, roots=roots, fanout=fanout, schedule=False)
    assert counts.hops == [] and relay.traffic(counts) == (sent, got, fwd)
    assert coverage_errors(counts) == [f"relay plan of {replicas} replicas without its hops "
                                       "(attach schedule=False)"]  # fmt: skip
    # Both sides compute the same plan; the topology is part of the digest.
    again = relay.attach(_plan(), replicas, kind, roots=roots, fanout=fanout)
    assert again.hops == plan.hops and again.digest == plan.digest != template.digest


def test_checks_catch_a_lost_a_doubled_and_an_early_forward():
    plan = relay.attach(_plan(), 3, "chain", roots=1)
    hops = list(plan.hops)
    last = [i for i, h in enumerate(hops) if h.dst == 2][-1]
    plan.hops = hops[:last] + hops[last + 1 :]
    assert any(e.startswith("replica 2 rank") for e in coverage_errors(plan))
    plan.hops = [*hops, hops[last]]
    assert any("replica 2" in e and "overlap" in e for e in coverage_errors(plan))
    plan.hops = [h._replace(seq=i) for i, h in enumerate(reversed(hops))]
    errors = relay.schedule_errors(plan)
    assert any("forwards bucket" in e and "before it has it" in e for e in errors), errors


def test_auto_roots_keep_the_trainer_no_busier_than_a_server_gpu():
    template = _plan(SrcLayout(2, 1, dp=4), tp=1)
    _, got, _ = relay.traffic(template)
    busiest, gpu = max(_sent(template)), max(got.values())
    roots = relay.auto_roots(template, 100)
    assert roots * busiest <= gpu < (roots + 1) * busiest
    assert relay.auto_roots(template, 2) == 2
    plan = relay.attach(template, 20, "chain")
    depth = -(-20 // roots)  # the chains auto_roots allows; as few roots as keep them
    assert relay.depth(plan) == depth and plan.parents.count(relay.TRAINER) == -(-20 // depth)


# ------------------------------------------------------------------ live syncs
def test_with_parents_is_attach_without_touching_the_one_replica_plan():
    base = _plan()
    digest = base.digest
    attached = relay.attach(_plan(), 4, "tree", roots=1, fanout=2)
    got = relay.with_parents(base, "tree", attached.parents)
    assert base.digest == digest and base.replicas == 1 and not base.hops
    assert (got.digest, got.hops, got.parents) == (attached.digest, attached.hops, attached.parents)
    assert relay.with_parents(base, "chain", (relay.TRAINER,)) is base
    # a child first, a forward reference, a root after a child
    for bad in ((0, -1), (-1, 1, 0), (-1, 0, -1)):
        with pytest.raises(PlanError, match="the roots come first"):
            relay.with_parents(base, "chain", bad)


def test_routes_form_each_groups_topology_over_the_servers_pushed():
    """The controller and every trainer rank derive the same routes: per group, its
    servers by position, the chain re-formed over those the push reaches."""
    plan = _plan()
    where = [("g7", 0), ("g7", 1), ("g8", 0), ("g7", 2)]  # server 2 restarted into g8
    routes = relay.routes(plan, where, [3, 2, 0], relay.Relaying("chain", 1))
    assert [(name, members) for name, _, members in routes] == [("g7", [0, 3]), ("g8", [2])]
    chain, alone = routes[0][1], routes[1][1]
    assert (chain.parents, chain.positions) == ((relay.TRAINER, 0), (0, 2))
    assert chain.dst_ranks(plan) == [4, 5, 8, 9]  # 4 trainer ranks, then 2 ranks per server
    assert chain.plan(plan).replicas == 2 and not relay.schedule_errors(chain.plan(plan))
    assert alone.parents == (relay.TRAINER,) and alone.plan(plan) is plan
