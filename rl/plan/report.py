"""A :class:`ClusterPlan` as text for people and as JSON for tools.

Why both: the text answers "where does everything go and does it fit" at a glance (long
per-node lists are shortened); the JSON carries every node, rank and stage, so a launcher
or a dashboard never re-derives the placement. Sizes: GB/TB here are GiB/TiB.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from rl.models.shapes import sequence_parallel, tower_param_count
from rl.plan.cluster import ClusterPlan
from rl.plan.memory import GIB, microbatches, stage_expert_params

if TYPE_CHECKING:
    from rl.config.schema import RootConfig

SHOW = 6  # longer lists print their first and last few lines


def fmt_bytes(n: float) -> str:
    for unit, size in (("TB", GIB << 10), ("GB", GIB), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:.{2 if unit == 'TB' else 1}f} {unit}"
    return f"{int(n)} B"


def _span(a: int, b: int) -> str:
    return str(a) if a == b else f"{a}-{b}"


def _nodes(a: int, b: int) -> str:
    return f"node {a}" if a == b else f"nodes {a}-{b}"


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "none"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return _span(ranks[0], ranks[-1])
    return ",".join(map(str, ranks))


def _shorten(lines: list[str]) -> list[str]:
    if len(lines) <= SHOW + 1:
        return lines
    cut = len(lines) - SHOW
    return [*lines[: SHOW - 2], f"    ... {cut} more like these ...", *lines[-2:]]


def _tower(cfg: RootConfig, stage: int) -> str:
    """A vision-language model's tower on the first stage, and whether it trains."""
    n = tower_param_count(cfg.model) if stage == 0 else 0
    if not n:
        return ""
    how = "trained" if cfg.model.train_vision else "frozen: weights only"
    return f" (vision tower {_params(n)} of them, {how})"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def render(plan: ClusterPlan, cfg: RootConfig) -> str:
    p, t, r = plan.placement, cfg.trainer, cfg.rollout
    gpus = p.gpus_per_node
    hw = f"{gpus} GPUs ({cfg.cluster.gpu_memory_gb:g} GB)" if gpus else "CPU only"
    out = [
        f"plan {plan.run}: model {plan.model} ({_params(plan.params)} params), "
        f"cluster {p.cluster}: {p.nodes} node(s) x {hw}, {plan.sequence} tokens per sample",
        f"placement ({p.world_size} ranks: "
        + " + ".join(f"{role} {len(ranks)}" for role, ranks in p.ranks.items() if ranks)
        + ")",
    ]
    tn = p.train_nodes
    where = _nodes(*tn)
    n_gpus = f" ({t.tp * t.cp * t.pp * t.dp} GPUs)" if gpus else ""
    ep = f" (EP{t.ep} inside DP)" if t.ep > 1 else ""
    cp = f" x CP{t.cp}" if t.cp > 1 else ""
    out.append(
        f"  trainer    {where}{n_gpus}: Megatron TP{t.tp}{cp} x PP{t.pp} x DP{t.dp}{ep}, "
        f"{t.params_dtype}, global ranks {_ranks(p.ranks['trainer'])}"
    )
    out += _shorten(
        [
            f"    stage {s.index}: layers {_span(*s.layers)}, ranks {_span(*s.ranks)}, "
            f"{_nodes(*s.nodes)}"
            for s in p.stages
        ]
    )
    if p.servers:
        gn = p.generation_nodes or (0, 0)
        block = r.weight_sync.fp8_block
        weights = f"FP8 weights (block {block})" if block else f"{r.dtype} weights"
        out.append(
            f"  generator  {_nodes(*gn)}"
            + (f" ({len(p.servers) * r.tp} GPUs)" if gpus else "")
            + f": {len(p.servers)} SGLang server(s) x TP{r.tp} ({r.device}), {weights}"
        )
        lines = []
        for owner in p.ranks["generator"]:
            mine = [s for s in p.servers if s.owner == owner]
            text = (
                f"    rank {owner} on node {p.node_of[owner]}: server(s) "
                f"{_ranks([s.index for s in mine])}"
            )
            if gpus:
                first, last = mine[0].gpus or (0, 0), mine[-1].gpus or (0, 0)
                text += f" on GPUs {_span(first[0], last[1])}"
            lines.append(text)
        out += _shorten(lines)
    out.append(f"  controller rank 0 on node {p.node_of[0]} (CPU)")
    if p.ranks["reward"]:
        nodes = sorted({p.node_of[x] for x in p.ranks["reward"]})
        out.append(
            f"  reward     ranks {_ranks(p.ranks['reward'])} on node(s) {_ranks(nodes)} "
            f"(CPU, {cfg.reward.workers} scorer process(es) each)"
        )
    out += _model_lines(plan, cfg)
    if plan.transfer is not None:
        x = plan.transfer
        fp8 = f", linear weights FP8 block {x.fp8_block}" if x.fp8_block else ""
        fed = "the trainer feeds every server"
        if x.relay != "none":
            fed = f"{x.relay} relay: the trainer feeds {x.roots}, relay depth {x.depth}"
        out.append(
            f"DDMA per step ({x.wire_dtype}{fp8}): {fmt_bytes(x.total)} = {x.servers} "
            f"server(s) x {fmt_bytes(x.per_server)}; {fed}"
        )
        rank, most = x.busiest_trainer_rank
        mean = sum(x.per_trainer_rank.values()) / len(x.per_trainer_rank)
        gpu, recv = x.busiest_server_gpu
        forwards = max(x.per_server_gpu_out.values(), default=0)
        line = (
            f"  per trainer rank: busiest (trainer rank {rank}, global {p.ranks['trainer'][rank]})"
            f" sends {fmt_bytes(most)} (mean {fmt_bytes(mean)}, {x.balance:.2f}x); per server "
            f"GPU: busiest TP rank {gpu} receives {fmt_bytes(recv)}"
        )
        if forwards:
            line += f", forwards up to {fmt_bytes(forwards)}"
        if x.seconds is not None:
            line += f"; >= {x.seconds:.2f} s at {cfg.cluster.interconnect_gbps:g} Gb/s per GPU"
        out.append(line)
    budget = f" GPU (of {fmt_bytes(plan.gpu_bytes)})" if plan.gpu_bytes else " rank (host memory)"
    g = plan.busiest_trainer
    dist = f"/DP{t.dp}" if t.use_distributed_optimizer else ""
    experts, e = "", cfg.model.num_experts
    if e:  # a GPU holds e / ep experts per layer; each has dp / ep replicas to shard Adam
        n = stage_expert_params(cfg.model, t.tp, t.pp, t.ep)
        experts = f" ({_params(n)} in {e // t.ep} of the {e} routed experts per layer)"
        if t.use_distributed_optimizer and t.ep > 1:
            dist += f" (experts /{t.dp // t.ep})"
    in_flight = min(t.pp - g.stage, microbatches(cfg))
    out += [
        f"memory per trainer{budget}, busiest: stage {g.stage}, {_params(g.params)} params"
        + experts
        + _tower(cfg, g.stage),
        f"  weights {fmt_bytes(g.weights)} + grads {fmt_bytes(g.grads)} + Adam "
        f"{fmt_bytes(g.optimizer)}{dist} + activations {fmt_bytes(g.activations)} "
        f"({t.micro_batch_size}x{plan.sequence}{f'/CP{t.cp}' if t.cp > 1 else ''} tokens x "
        f"{cfg.model.num_layers // t.pp} layers x "
        f"{in_flight} in flight{_activation_options(cfg)}) + logits {fmt_bytes(g.logits)} "
        "+ reference "
        f"{fmt_bytes(g.reference)} + DDMA buckets {fmt_bytes(g.buffers)} + overhead "
        f"{fmt_bytes(g.overhead)} = {fmt_bytes(g.total)}",
    ]
    for role, gs in plan.models.items():
        m = max(gs, key=lambda g: (g.total, -g.stage))
        parts = [f"weights {fmt_bytes(m.weights)}"]
        if m.grads:
            parts += [f"grads {fmt_bytes(m.grads)}", f"Adam {fmt_bytes(m.optimizer)}"]
        parts += [f"activations {fmt_bytes(m.activations)}", f"logits {fmt_bytes(m.logits)}",
                  f"overhead {fmt_bytes(m.overhead)}"]  # fmt: skip
        out += [
            f"memory per {role}{budget}, busiest: stage {m.stage}, {_params(m.params)} params",
            f"  {' + '.join(parts)} = {fmt_bytes(m.total)}",
        ]
    if plan.generator is not None:
        k = plan.generator
        seqs = k.kv_tokens // plan.sequence
        staged = {
            "device": f"staging copy {fmt_bytes(k.staged)}",
            "host": "staging in host memory",
            "none": "no staging (written in place)",
        }.get(k.staging, k.staging)
        tower = f" + vision tower {fmt_bytes(k.tower)}" if k.tower else ""
        out += [
            f"memory per generator{budget}",
            f"  weights {fmt_bytes(k.weights)}{tower} + {staged} + SGLang reserve "
            f"{fmt_bytes(k.reserved)} + KV cache {fmt_bytes(k.kv_tokens * k.kv_bytes_per_token)}"
            f" = {fmt_bytes(k.total)}: {k.kv_tokens:,} tokens per server ({seqs:,} sequences "
            f"of {plan.sequence})",
        ]
        if plan.host_staging:
            host = fmt_bytes(plan.host_staging)
            out.append(f"  host memory per generation node: staging copies {host}")
    if plan.gpu_bytes is None:
        out.append("fits: not checked (CPU only: ranks share the host's memory)")
    else:
        out.append("fits: yes" if plan.fits else f"fits: NO: {plan.problems[0]}")
    return "\n".join(out)


def _model_lines(plan: ClusterPlan, cfg: RootConfig) -> list[str]:
    """Each model executor's ranks, GPUs and layout."""
    from rl.companion import TRAINED, model_of

    p, out = plan.placement, []
    for role in plan.models:
        t, ranks = getattr(cfg, role).trainer, p.ranks[role]
        nodes = sorted({p.node_of[x] for x in ranks})
        where = f"node(s) {_ranks(nodes)}"
        if p.gpus_per_node:
            where += f" ({len(ranks)} GPUs)"
        mode = "trained" if role in TRAINED else "frozen"
        out.append(
            f"  {role:<10} {where}: {model_of(cfg, role).architecture}, Megatron TP{t.tp} x "
            f"PP{t.pp} x DP{t.dp}, {t.params_dtype}, {mode}, global ranks {_ranks(ranks)}"
        )
    return out


def to_json(plan: ClusterPlan) -> dict[str, Any]:
    p = plan.placement
    nodes = []
    for n in range(p.nodes):
        kind = "shared"
        if p.split:
            kind = "train" if p.train_nodes[0] <= n <= p.train_nodes[1] else "generation"
            gen = p.generation_nodes
            if n > p.train_nodes[1] and (gen is None or n > gen[1]):
                kind = "model"
        nodes.append(
            {
                "node": n,
                "kind": kind,
                "ranks": {role: p.ranks_on(n, role) for role in p.ranks if p.ranks_on(n, role)},
                "servers": [s.index for s in p.servers if s.node == n],
                "busy_cpus": plan.busy_cpus.get(n, 0),
            }
        )
    x = plan.transfer
    ddma = None
    if x is not None:
        ddma = {
            **{
                k: v
                for k, v in asdict(x).items()
                if k not in ("per_trainer_rank", "per_server_gpu", "per_server_gpu_out")
            },
            "total": x.total,
            "balance": x.balance,
            "per_trainer_rank": {str(k): v for k, v in x.per_trainer_rank.items()},
            "per_server_gpu": {str(k): v for k, v in x.per_server_gpu.items()},
            "per_server_gpu_out": {str(k): v for k, v in x.per_server_gpu_out.items()},
        }
    return {
        "run": plan.run,
        "model": {"name": plan.model, "params": plan.params},
        "sequence_tokens": plan.sequence,
        "placement": {
            "cluster": p.cluster,
            "nodes": p.nodes,
            "gpus_per_node": p.gpus_per_node,
            "world_size": p.world_size,
            "ranks": p.ranks,
            "node_of": {str(k): v for k, v in sorted(p.node_of.items())},
            "stages": [asdict(s) for s in p.stages],
            "servers": [asdict(s) for s in p.servers],
            "gpu_of": {str(k): v for k, v in sorted(p.gpu_of.items())},
            "nodes_detail": nodes,
        },
        "ddma": ddma,
        "memory": {
            "gpu_bytes": plan.gpu_bytes,
            "trainer": [{**asdict(g), "total": g.total} for g in plan.trainer],
            "generator": (
                {**asdict(plan.generator), "total": plan.generator.total}
                if plan.generator
                else None
            ),
            "models": {
                role: [{**asdict(g), "total": g.total} for g in gs]
                for role, gs in plan.models.items()
            },
        },
        "host_staging_per_node": plan.host_staging,
        "fits": plan.fits,
        "problems": plan.problems,
    }


def _activation_options(cfg: RootConfig) -> str:
    """What shrinks the activations: recomputation, sequence parallelism."""
    t = cfg.trainer
    out = ", layer inputs kept, recomputed" if t.recompute == "full" else ""
    if sequence_parallel(cfg.model, t.tp, t.sequence_parallel):
        out += ", sequence parallel"
    return out
