"""Where every rank and GPU of a job goes: trainer stages, SGLang servers, CPU-only ranks.

Why: a 1024-GPU launch that splits a TP group across two nodes, or asks for more servers
than the generation nodes have GPUs, fails minutes in (or runs at a fraction of its
speed). The placement here is the deterministic layout that the role map
(rl/config/roles.py: controller, trainer, generator owners, reward, in that order)
implies on the cluster's nodes, and every arithmetic mismatch between the cluster and the
layouts is refused up front, naming the field and its value.

Split mode (``cluster.train_nodes + cluster.generation_nodes == cluster.nodes``):

* trainer rank r (0-based within the trainer) -> node r // gpus_per_node, GPU
  r % gpus_per_node. Megatron orders ranks TP fastest, then DP, then PP, so with
  gpus_per_node % tp == 0 every TP group sits inside one node (its all-reduces stay on
  NVLink) and each pipeline stage is a block of whole nodes;
* server s -> GPUs [s*tp, (s+1)*tp) of the generation nodes, inside one node; generator
  rank g owns servers [g*k, (g+1)*k) (k = rollout.servers / cluster.roles.generator) and
  must share their node, since it starts them as subprocesses;
* the controller runs on node 0 next to trainer ranks, reward ranks round-robin on the
  generation nodes (they score what those nodes generate); both are CPU-only;
* the model executors (a critic, a reward model, a teacher: rl/config/roles.py:COMPANIONS),
  in role order, each rank on one GPU of the model nodes (``cluster.model_nodes``, after
  the generation nodes), TP fastest as the trainer's, each TP group inside one node.

Shared mode (``train_nodes == generation_nodes == model_nodes == 0``): one machine, every
rank on node 0 (the local CPU job), the model executors' GPUs after the servers'. With
``gpus_per_node == 0`` ranks are CPU processes and GPU arithmetic is skipped. Pure logic:
no torch.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

from rl.config.errors import ConfigError
from rl.config.roles import COMPANIONS, RoleError, RoleMap
from rl.config.validate import validate_cluster

if TYPE_CHECKING:
    from rl.config.schema import RootConfig, TrainerConfig


class PlanRefused(ConfigError):
    """A cluster plan that cannot run (or does not fit); the message says what to change."""


def refuse(ok: bool, msg: str) -> None:
    if not ok:
        raise PlanRefused(msg)


@dataclass(frozen=True)
class Stage:
    """One trainer pipeline stage: its layers, global ranks and nodes (inclusive spans)."""

    index: int
    layers: tuple[int, int]
    ranks: tuple[int, int]
    nodes: tuple[int, int]


@dataclass(frozen=True)
class Server:
    """One SGLang server: its node, local GPUs (None on CPU) and owning generator rank."""

    index: int
    node: int
    gpus: tuple[int, int] | None
    owner: int


@dataclass
class Placement:
    cluster: str
    nodes: int
    gpus_per_node: int
    split: bool  # disjoint training and generation nodes
    _: KW_ONLY
    train_nodes: tuple[int, int]
    generation_nodes: tuple[int, int] | None  # None: no generation (rl.steps == 0)
    ranks: dict[str, list[int]]  # role -> global ranks
    node_of: dict[int, int]  # global rank -> node
    stages: list[Stage] = field(default_factory=list)
    servers: list[Server] = field(default_factory=list)
    gpu_of: dict[int, int] = field(default_factory=dict)  # a model executor's rank -> GPU

    @property
    def world_size(self) -> int:
        return len(self.node_of)

    def ranks_on(self, node: int, role: str) -> list[int]:
        return [r for r in self.ranks[role] if self.node_of[r] == node]

    def node_ranks(self) -> list[list[int]]:
        """The role-map ranks each node runs, in rank order: how many processes a launcher
        starts on each node (``python -m rl.plan --ranks-per-node``), and which role the
        i-th of them plays (``--node-ranks``, read by rl/runtime/job.py)."""
        out: list[list[int]] = [[] for _ in range(self.nodes)]
        for rank, node in sorted(self.node_of.items()):
            out[node].append(rank)
        return out


def _check_devices(cfg: RootConfig, gpus: int) -> None:
    want = "cuda" if gpus else "cpu"
    checks = [("trainer.device", cfg.trainer.device)]
    if cfg.rl.steps > 0:
        checks.append(("rollout.device", cfg.rollout.device))
        for role in COMPANIONS:
            if getattr(cfg, role).enabled:
                checks.append((f"{role}.trainer.device", getattr(cfg, role).trainer.device))
    for name, device in checks:
        refuse(
            device == want,
            f"{name}={device!r} but cluster.gpus_per_node={gpus}: "
            f"{'GPU nodes run' if gpus else 'a CPU-only cluster runs'} {want} ranks",
        )


def _check_tp_fits_node(where: str, tp: int, gpus: int) -> None:
    refuse(
        tp <= gpus and gpus % tp == 0,
        f"{where}={tp} does not fit a node of cluster.gpus_per_node={gpus} "
        f"(a TP group must sit inside one node, on its NVLink)",
    )


def _span(values: list[int]) -> tuple[int, int]:
    return (min(values), max(values))


def place(cfg: RootConfig) -> Placement:
    """Place every rank of ``cfg``'s role map and every SGLang server on the cluster."""
    c, t, r = cfg.cluster, cfg.trainer, cfg.rollout
    validate_cluster(c)
    try:
        roles = RoleMap.from_config(cfg)
    except RoleError as e:
        raise PlanRefused(str(e)) from None
    gpus, split = c.gpus_per_node, c.train_nodes + c.generation_nodes + c.model_nodes > 0
    generating = cfg.rl.steps > 0
    _check_devices(cfg, gpus)
    trainer_gpus, servers = t.tp * t.cp * t.pp * t.dp, r.servers if generating else 0
    if gpus:
        _check_tp_fits_node("trainer.tp", t.tp, gpus)
        if generating:
            _check_tp_fits_node("rollout.tp", r.tp, gpus)
    if split:
        train_nodes = c.train_nodes
        gen_nodes = c.generation_nodes
        refuse(
            not generating or gen_nodes >= 1,
            f"cluster.generation_nodes=0 but rl.steps={cfg.rl.steps} needs SGLang servers",
        )
        if gpus:
            have = train_nodes * gpus
            refuse(
                trainer_gpus == have,
                f"trainer.{_dims(t)} = {_sizes(t)} = {trainer_gpus} GPUs != "
                f"cluster.train_nodes*gpus_per_node = {train_nodes}*{gpus} = {have}",
            )
            if generating:
                have = gen_nodes * gpus
                refuse(
                    servers * r.tp == have,
                    f"rollout.servers*tp = {servers}*{r.tp} = {servers * r.tp} GPUs != "
                    f"cluster.generation_nodes*gpus_per_node = {gen_nodes}*{gpus} = {have}",
                )
    else:
        train_nodes, gen_nodes = 1, 1 if generating else 0
        if gpus:
            need = trainer_gpus + servers * r.tp
            refuse(
                need <= gpus,
                f"trainer.{_dims(t)} + rollout.servers*tp = {trainer_gpus} + {servers}*{r.tp} = "
                f"{need} GPUs > cluster.gpus_per_node={gpus} on the one shared node",
            )

    node_of: dict[int, int] = {roles.ranks("controller")[0]: 0}
    trainer_ranks = roles.ranks("trainer")

    def trainer_node(i: int) -> int:
        if not split:
            return 0
        if gpus:
            return i // gpus
        return i * train_nodes // trainer_gpus

    for i, rank in enumerate(trainer_ranks):
        node_of[rank] = trainer_node(i)
    per_stage = t.tp * t.dp
    layers = cfg.model.num_layers // t.pp
    stages = []
    for p in range(t.pp):
        idx = list(range(p * per_stage, (p + 1) * per_stage))
        stages.append(
            Stage(
                p,
                (p * layers, (p + 1) * layers - 1),
                (trainer_ranks[idx[0]], trainer_ranks[idx[-1]]),
                _span([trainer_node(i) for i in idx]),
            )
        )

    first_gen = train_nodes if split else 0
    owners = roles.ranks("generator")
    placed: list[Server] = []
    for s in range(servers):
        if gpus:  # split: the generation nodes' GPUs; shared: after the trainer's
            at = s * r.tp if split else trainer_gpus + s * r.tp
            node, local = first_gen + at // gpus, at % gpus
            slot: tuple[int, int] | None = (local, local + r.tp - 1)
        else:
            node, slot = (first_gen + s * gen_nodes // servers if split else 0), None
        placed.append(Server(s, node, slot, owners[s * len(owners) // servers]))
    for g in owners:  # without RL steps they own no servers and idle on node 0
        nodes = sorted({s.node for s in placed if s.owner == g}) or [0]
        refuse(
            len(nodes) == 1,
            f"cluster.roles.generator={len(owners)} gives generator rank {g} the servers of "
            f"nodes {nodes[0]}-{nodes[-1]}; a rank starts its servers on its own node: set "
            f"cluster.roles.generator to a multiple of cluster.generation_nodes={gen_nodes}",
        )
        node_of[g] = nodes[0]
    for i, rank in enumerate(roles.ranks("reward")):
        node_of[rank] = first_gen + i % gen_nodes if split and gen_nodes else 0
    gpu_of = _place_models(cfg, roles, node_of, trainer_gpus + servers * r.tp)
    return Placement(
        cluster=c.name,
        nodes=c.nodes,
        gpus_per_node=gpus,
        split=split,
        train_nodes=(0, train_nodes - 1),
        generation_nodes=(first_gen, first_gen + gen_nodes - 1) if gen_nodes else None,
        ranks={role: roles.ranks(role) for role, _ in roles.counts},
        node_of=node_of,
        stages=stages,
        servers=placed,
        gpu_of=gpu_of,
    )


def _place_models(
    cfg: RootConfig, roles: RoleMap, node_of: dict[int, int], shared_offset: int
) -> dict[int, int]:
    """Each model executor's ranks on the model nodes (split) or after the first
    ``shared_offset`` GPUs of the one node: ``node_of`` filled in, the GPU of each rank
    returned (none on a CPU cluster)."""
    c = cfg.cluster
    gpus, split = c.gpus_per_node, c.train_nodes + c.generation_nodes + c.model_nodes > 0
    first = c.train_nodes + c.generation_nodes if split else 0
    at = 0 if split else shared_offset
    gpu_of: dict[int, int] = {}
    placed = []
    for role in COMPANIONS:
        ranks, t = roles.ranks(role), getattr(cfg, role).trainer
        if not ranks:
            continue
        placed.append(f"{role}.trainer.{_dims(t)} = {len(ranks)}")
        refuse(
            not (split and gpus and not c.model_nodes),
            f"{role}.enabled=true needs GPUs of its own on a cluster of separate nodes: set "
            f"cluster.model_nodes (and cluster.nodes) for its {len(ranks)} GPU(s)",
        )
        if not gpus:
            for rank in ranks:
                node_of[rank] = first if c.model_nodes else 0
            continue
        _check_tp_fits_node(f"{role}.trainer.tp", t.tp, gpus)
        at = -(-at // t.tp) * t.tp  # a TP group starts on a multiple of tp: one node
        for rank in ranks:
            node_of[rank], gpu_of[rank] = first + at // gpus, at % gpus
            at += 1
    have = (c.model_nodes if split else 1) * gpus
    refuse(
        not gpu_of or at <= have,
        f"{' + '.join(placed)} GPUs"
        + (f" after the trainer's and the servers' {shared_offset}" if not split else "")
        + f" > {'cluster.model_nodes*gpus_per_node' if split else 'cluster.gpus_per_node'}"
        f" = {have}",
    )
    return gpu_of


def check_cpus(cfg: RootConfig, placement: Placement) -> dict[int, int]:
    """Busy CPU cores per node (trainer threads, one per SGLang TP worker and per rank,
    reward worker processes); refused past ``cluster.cpus_per_node`` when that is set."""
    busy: dict[int, int] = dict.fromkeys(range(placement.nodes), 0)
    for role, ranks in placement.ranks.items():
        for rank in ranks:
            node = placement.node_of[rank]
            if role == "trainer":
                busy[node] += cfg.trainer.threads_per_rank
            elif role in COMPANIONS:
                busy[node] += getattr(cfg, role).trainer.threads_per_rank
            elif role == "reward":
                busy[node] += 1 + cfg.reward.workers
            else:
                busy[node] += 1
    for s in placement.servers:
        busy[s.node] += cfg.rollout.tp
    cpus = cfg.cluster.cpus_per_node
    if cpus is not None:
        node, most = max(busy.items(), key=lambda kv: (kv[1], -kv[0]))
        refuse(
            most <= cpus,
            f"node {node} runs {most} busy processes/threads > cluster.cpus_per_node={cpus} "
            "(lower cluster.roles.reward, reward.workers or trainer.threads_per_rank)",
        )
    return busy


def _dims(t: TrainerConfig) -> str:
    """``tp*pp*dp``, with ``cp`` when context parallelism is on."""
    return "tp*cp*pp*dp" if t.cp > 1 else "tp*pp*dp"


def _sizes(t: TrainerConfig) -> str:
    sizes = (t.tp, t.cp, t.pp, t.dp) if t.cp > 1 else (t.tp, t.pp, t.dp)
    return "*".join(map(str, sizes))
