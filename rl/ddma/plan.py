"""The DDMA transfer plan: which bytes of which trainer shard go to which generator shard.

Why an explicit plan: after each step every trainer rank must send *only its own* Megatron
shards straight into the SGLang ranks that need them, already in SGLang's layout. Both
sides compute the same plan independently from the two layouts (rl/ddma/layout.py) and
the model's shape, so nothing but bucket bytes crosses the wire, and a 64-bit digest of
the plan travels in every bucket header: two sides that disagree on architecture, layout
or bucket size fail on the first bucket instead of writing garbage.

A piece moves ``length`` slices along one dimension from one source shard to one
destination shard; a bucket is one (trainer rank, generator rank) message of pieces, at
most ``bucket_bytes``; rounds order the buckets so no rank sends or receives twice at
once. Every destination byte is written exactly once (:func:`coverage_errors`). Which
trainer rank sends a piece is balanced by bytes over every rank holding it
(rl/ddma/balance.py). The buckets are one replica's (one server's) messages; a relay plan
(rl/ddma/relay.py) sends them to several replicas, servers forwarding them unchanged.

Pure logic: integers only, no torch.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import defaultdict
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from omegaconf import OmegaConf

from rl.config import dtypes
from rl.ddma import balance
from rl.ddma.layout import (
    DstLayout,
    PlanError,
    SrcLayout,
    check_layouts,
    dst_runs,
    expert_owner,
    round_up,
    sglang_names,
    src_locate,
    src_shapes,
)
from rl.weights import keymap as km

if TYPE_CHECKING:
    from rl.config.schema import RolloutConfig, RootConfig, TrainerConfig
    from rl.models.arch import ModelShape

__all__ = ["DstLayout", "PlanError", "SrcLayout", "make_plan", "plan_for", "round_up"]

# Linear weights an FP8 engine holds quantized (embeddings, norms, lm_head, the MoE router
# stay in dtype): dense and shared-expert projections, and each routed expert's slab of
# FusedMoE's ``w13_weight`` / ``w2_weight`` (``...experts.w13_weight[e]``).
FP8_WEIGHTS = (
    "qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight",
    "experts.w13_weight", "experts.w2_weight",
)  # fmt: skip
SCALE_SUFFIX = "_scale_inv"


def _slab(name: str) -> tuple[str, str]:
    """``a.w13_weight[3]`` -> (``a.w13_weight``, ``[3]``); other names -> (name, "")."""
    if name.endswith("]"):
        base, _, index = name.rpartition("[")
        return base, "[" + index
    return name, ""


def scale_name(name: str) -> str:
    """Where an FP8 weight's block scales go: ``<name>_scale_inv``, and for an expert slab
    the same slab of the fused scale (``a.w13_weight_scale_inv[3]``), as SGLang names them."""
    base, index = _slab(name)
    return base + SCALE_SUFFIX + index


def is_scale(name: str) -> bool:
    return _slab(name)[0].endswith(SCALE_SUFFIX)


HEADER_BYTES = 64  # room for the bucket header in front of every bucket's payload
ALIGN = 64  # every piece starts on a 64-byte boundary of its bucket


class Piece(NamedTuple):
    """``length`` slices along ``dim``: source tensor ``(key, layer)`` on global source rank
    ``src`` at ``src_start`` -> destination tensor ``dst_name`` on rank ``dst`` at
    ``dst_start``. ``src`` is None for zero-filled padding (written locally, not sent)."""

    src: int | None
    key: str | None
    layer: int | None
    src_start: int
    dst: int
    dst_name: str
    dim: int
    dst_start: int
    length: int


@dataclass
class Bucket:
    """Pieces from one source rank to one destination rank, sent as one message."""

    index: int  # position in the plan's global order
    round: int  # buckets of one round run concurrently (no rank in two of them)
    src: int
    dst: int
    _: KW_ONLY
    pieces: list[Piece]
    offsets: list[int]  # byte offset of each piece's data in the message
    nbytes: int  # message size, header included


class Hop(NamedTuple):
    """One message of a relay plan: bucket ``bucket`` (its index) into replica ``dst`` at
    the bucket's generator rank, sent by the bucket's trainer rank (``src`` is -1) or
    forwarded unchanged by the same generator rank of replica ``src``."""

    seq: int  # position in the relay plan's global order
    round: int  # a (replica, generator rank) receives at most once per round
    bucket: int
    src: int
    dst: int


@dataclass
class Plan:
    dims: km.Dims
    src: SrcLayout
    dst: DstLayout
    itemsize: int
    _: KW_ONLY
    bucket_bytes: int
    dst_shapes: dict[str, tuple[int, ...]]  # per-rank SGLang shapes (equal on every rank)
    src_shapes: dict[tuple[str, int | None], tuple[int, ...]]  # per-rank Megatron shapes
    buckets: list[Bucket] = field(default_factory=list)
    fills: list[Piece] = field(default_factory=list)  # padding, zero-filled by the receiver
    fp8_block: int | None = None  # blockwise FP8 for the linear weights (see rl/ddma/fp8.py)
    digest: int = 0
    # Relay plans (rl/ddma/relay.py): replicas of this destination layout, each fed by the
    # trainer (parent -1) or by its parent replica; hops are every message, in order.
    replicas: int = 1
    relay: str = "none"
    parents: tuple[int, ...] = (-1,)
    hops: list[Hop] = field(default_factory=list)

    def quantized(self, name: str) -> bool:
        """Is ``name`` sent as FP8 (plus ``<name>_scale_inv``, float32 per block)?"""
        return (
            self.fp8_block is not None
            and name in self.dst_shapes
            and _slab(name)[0].endswith(FP8_WEIGHTS)
        )

    def elem_bytes(self, name: str) -> int:
        if is_scale(name):
            return 4
        return 1 if self.quantized(name) else self.itemsize

    def sends(self, src_rank: int) -> list[Bucket]:
        return [b for b in self.buckets if b.src == src_rank]

    def receives(self, dst_rank: int) -> list[Bucket]:
        return [b for b in self.buckets if b.dst == dst_rank]

    def dst_bytes(self, real_only: bool = True) -> int:
        """Bytes of every destination shard (without the zero-filled padding)."""
        per_rank = sum(_numel(s) * self.elem_bytes(n) for n, s in self.dst_shapes.items())
        total = per_rank * self.dst.tp
        if real_only:
            total -= sum(self.piece_bytes(p) for p in self.fills)
        return total

    def sent_bytes(self) -> int:
        """Payload bytes on the wire (headers and alignment excluded)."""
        return sum(self.piece_bytes(p) for b in self.buckets for p in b.pieces)

    def piece_layout(self, p: Piece) -> tuple[int, int]:
        """(data bytes, scale bytes) of a piece: FP8 pieces carry their blocks' scales,
        stored after the data at the next ``ALIGN`` boundary."""
        shape = self.dst_shapes[p.dst_name]
        data = p.length * _slice_numel(shape, p.dim) * self.elem_bytes(p.dst_name)
        if not self.quantized(p.dst_name):
            return data, 0
        b = self.fp8_block
        other = shape[1 - p.dim]
        return data, -(-p.length // b) * -(-other // b) * 4  # type: ignore[operator]

    def piece_bytes(self, p: Piece) -> int:
        return sum(self.piece_layout(p))

    def payload(self, b: Bucket) -> int:
        """Bytes the destination keeps of bucket ``b`` (its pieces, without the header)."""
        return sum(self.piece_bytes(p) for p in b.pieces)

    def footprint(self, p: Piece) -> int:
        data, scale = self.piece_layout(p)
        return round_up(data, ALIGN) + scale if scale else data

    def rounds(self) -> int:
        return 1 + max((b.round for b in self.buckets), default=-1)


def _holders(d, src, key, layer, tp_rank) -> tuple[int, ...]:
    """The trainer ranks holding (key, layer) at Megatron TP rank ``tp_rank`` (None: a
    replicated tensor, on every TP rank): its stage's ranks of every data-parallel replica,
    or, for a routed expert, of the replicas of its EP rank (dp % ep == owner)."""
    if key == km.EMBED:
        pp_rank = 0
    elif layer is None:  # final norm and output layer live on the last stage
        pp_rank = src.pp - 1
    else:
        pp_rank = src.stage_of(layer, d.layers)[0]
    tps = range(src.tp) if tp_rank is None else (tp_rank,)
    owner = expert_owner(d, src, key)
    dps = range(src.dp) if owner is None else range(owner, src.dp, src.ep)
    return tuple(sorted(src.rank(t, pp_rank, dp) for t in tps for dp in dps))


def make_plan(
    d: km.Dims,
    src: SrcLayout,
    dst: DstLayout,
    itemsize: int,
    bucket_bytes: int,
    fp8_block: int | None = None,
) -> Plan:
    """The full transfer plan; every destination byte is written by exactly one piece.

    With ``fp8_block`` the linear weights travel as blockwise FP8 plus per-block scales
    (``<name>_scale_inv``), quantized by the sender piece by piece; that is exact only
    when every piece starts and ends on a block boundary, which is checked here."""
    check_layouts(d, src, dst)
    if bucket_bytes < HEADER_BYTES + ALIGN:
        raise PlanError(f"bucket_bytes={bucket_bytes} is below the minimum {HEADER_BYTES + ALIGN}")
    if fp8_block is not None and (fp8_block < 1 or dst.ffn_multiple > 1):
        raise PlanError(f"fp8_block={fp8_block}: needs a block >= 1 and a GPU layout")
    names = sglang_names(d)
    specs = {name: km.spec(key, d) for name, (key, _, _) in names.items()}
    dst_shapes = {}
    for name, (key, _, dim) in names.items():
        shape = list(km.megatron_shape(key, d))
        shape[dim] = sum(n for _, n in dst_runs(d, dst, specs[name], 0))
        dst_shapes[name] = tuple(shape)
        if fp8_block is not None and _slab(name)[0].endswith(FP8_WEIGHTS):
            dst_shapes[scale_name(name)] = tuple(-(-n // fp8_block) for n in shape)
    plan = Plan(
        d,
        src,
        dst,
        itemsize,
        bucket_bytes=bucket_bytes,
        dst_shapes=dst_shapes,
        src_shapes=src_shapes(d, src),
    )
    plan.fp8_block = fp8_block
    runs: list[balance.Run] = []
    # Each run's piece but its sender: (key, layer, src start, dst rank, name, dim, dst start).
    protos: list[tuple[str, int | None, int, int, str, int, int]] = []
    holders: dict[tuple[str, int | None, int | None], tuple[int, ...]] = {}
    for rank in range(dst.tp):
        for name, (key, layer, dim) in names.items():
            at = 0
            unit = fp8_block if plan.quantized(name) else 1
            one = plan.piece_bytes(Piece(None, key, layer, 0, rank, name, dim, 0, unit))  # type: ignore[arg-type]
            for start, n in dst_runs(d, dst, specs[name], rank):
                if start is None:
                    plan.fills.append(Piece(None, None, None, 0, rank, name, dim, at, n))
                    at += n
                    continue
                for tp_rank, local, take in src_locate(d, src, specs[name], start, n):
                    who = holders.get((key, layer, tp_rank))
                    if who is None:
                        who = holders[(key, layer, tp_rank)] = _holders(d, src, key, layer, tp_rank)
                    runs.append(balance.Run(who, take, unit, one))  # type: ignore[arg-type]
                    protos.append((key, layer, local, rank, name, dim, at))
                    at += take
    per_pair: dict[tuple[int, int], list[Piece]] = defaultdict(list)
    for (key, layer, local, rank, name, dim, at), chunks in zip(
        protos, balance.assign(runs, src.world), strict=True
    ):
        for off, n, s in chunks:
            per_pair[(s, rank)].append(
                Piece(s, key, layer, local + off, rank, name, dim, at + off, n)
            )
    for pair in sorted(per_pair):
        if fp8_block is not None:
            _check_blocks(plan, per_pair[pair])
        _bucketize(plan, per_pair[pair])
    _schedule(plan)
    plan.digest = plan_digest(plan)
    return plan


def plan_for(
    model: ModelShape,
    trainer: TrainerConfig,
    rollout: RolloutConfig,
    dp: int = 1,
    bucket_bytes: int | None = None,
) -> Plan:
    """The plan for composed ``model`` / ``trainer`` / ``rollout`` configs (one server);
    ``dp`` data-parallel replicas, each of ``trainer.cp`` context-parallel ranks that hold
    the same weights (the plan's source DP is their product)."""
    sync = rollout.weight_sync
    return make_plan(
        km.Dims.of(model),
        SrcLayout(trainer.tp, trainer.pp, dp * trainer.cp, ep=trainer.ep),
        DstLayout.sglang(rollout.tp, rollout.device),
        dtypes.itemsize(trainer.params_dtype),
        bucket_bytes or sync.bucket_mb << 20,
        sync.fp8_block,
    )


def _check_blocks(plan: Plan, pieces: list[Piece]) -> None:
    b = plan.fp8_block
    for p in pieces:
        size = plan.dst_shapes[p.dst_name][p.dim]
        end = p.dst_start + p.length
        if plan.quantized(p.dst_name) and (p.dst_start % b or (end % b and end != size)):  # type: ignore[operator]
            raise PlanError(
                f"fp8_block={b}: {p.dst_name} on generator rank {p.dst} takes [{p.dst_start}, "
                f"{end}) along dim {p.dim} from trainer rank {p.src}, not on block boundaries"
            )


def _bucketize(plan: Plan, pieces: list[Piece]) -> None:
    """Cut one pair's pieces into buckets of at most ``bucket_bytes`` (pieces larger than
    a bucket are split along their dimension: by slices, or by whole blocks for FP8; one
    slice or block is never split)."""
    budget = plan.bucket_bytes
    cur: list[Piece] = []
    offs: list[int] = []
    size = HEADER_BYTES

    def close() -> None:
        nonlocal cur, offs, size
        if cur:
            b = Bucket(-1, -1, cur[0].src, cur[0].dst, pieces=cur, offsets=offs, nbytes=size)  # type: ignore[arg-type]
            plan.buckets.append(b)
        cur, offs, size = [], [], HEADER_BYTES

    for p in pieces:
        quantized = plan.quantized(p.dst_name)
        unit = plan.fp8_block if quantized else 1
        at, foot = round_up(size, ALIGN), plan.footprint(p)
        if at + foot <= budget:  # a whole piece that fits is taken as it is
            cur.append(p)
            offs.append(at)
            size = at + foot
            continue
        done = 0
        while done < p.length:
            at = round_up(size, ALIGN)

            def part(n: int, p: Piece = p, done: int = done) -> Piece:
                return Piece(
                    p.src, p.key, p.layer, p.src_start + done, p.dst, p.dst_name, p.dim,
                    p.dst_start + done, n,
                )  # fmt: skip

            per_unit = plan.footprint(part(unit))  # type: ignore[arg-type]
            units = max((budget - at) // per_unit, 0)
            if units < 1 and cur:
                close()
                continue
            piece = part(min(p.length - done, max(units, 1) * unit))  # type: ignore[operator]
            cur.append(piece)
            offs.append(at)
            size = at + plan.footprint(piece)
            done += piece.length
    close()


def _schedule(plan: Plan) -> None:
    """Order buckets into rounds where no rank sends or receives twice (greedy edge
    colouring), keeping each pair's buckets in order. Senders and receivers then walk
    the same global order, which is what makes bounded double buffering deadlock-free."""
    queues: dict[tuple[int, int], list[Bucket]] = defaultdict(list)
    for b in plan.buckets:
        queues[(b.src, b.dst)].append(b)
    for q in queues.values():
        q.reverse()  # pop from the end
    order = sorted((-len(q), p) for p, q in queues.items())  # longest queue first
    ordered: list[Bucket] = []
    rnd = 0
    while order:
        busy_src, busy_dst = set(), set()
        picked = []
        for k, (_, pair) in enumerate(order):
            if pair[0] not in busy_src and pair[1] not in busy_dst:
                b = queues[pair].pop()
                b.round = rnd
                busy_src.add(pair[0])
                busy_dst.add(pair[1])
                ordered.append(b)
                picked.append(k)
                if len(busy_dst) == plan.dst.tp:
                    break
        for k in reversed(picked):  # one bucket shorter: back in its sorted place
            left, pair = order.pop(k)
            if left < -1:
                bisect.insort(order, (left + 1, pair))
        rnd += 1
    for i, b in enumerate(ordered):
        b.index = i
    plan.buckets = ordered


def plan_digest(plan: Plan) -> int:
    """64 bits of everything both sides must agree on; a relay plan's topology too (its
    hops follow from the buckets and the topology)."""
    h = hashlib.sha256()
    spec = (plan.dims, plan.src, plan.dst, plan.itemsize, plan.bucket_bytes, plan.fp8_block)
    h.update(repr(spec).encode())
    if plan.replicas > 1:
        h.update(repr((plan.replicas, plan.relay, plan.parents)).encode())
    for b in plan.buckets:
        h.update(repr((b.round, b.src, b.dst, b.offsets, b.pieces)).encode())
    return int.from_bytes(h.digest()[:8], "little") >> 1  # fits a signed int64


# ------------------------------------------------------------------------ checks
def coverage_errors(plan: Plan) -> list[str]:
    """Destination elements written zero or several times (empty: every byte exactly once),
    on every replica of a relay plan (a bucket a replica gets twice writes its bytes twice)."""
    if plan.replicas > 1 and not plan.hops:
        return [f"relay plan of {plan.replicas} replicas without its hops (attach schedule=False)"]
    if not plan.hops:
        return _coverage(plan, plan.buckets)
    got: dict[int, list[int]] = defaultdict(list)
    for h in plan.hops:
        got[h.dst].append(h.bucket)
    errors: list[str] = []
    seen: dict[tuple[int, ...], list[str]] = {}  # replicas receiving the same buckets agree
    for r in range(plan.replicas):
        key = tuple(sorted(got.get(r, [])))
        if key not in seen:
            seen[key] = _coverage(plan, [plan.buckets[i] for i in key])
        errors += [f"replica {r} {e}" for e in seen[key]]
    return errors


def _coverage(plan: Plan, buckets: list[Bucket]) -> list[str]:
    runs: dict[tuple[int, str], list[tuple[int, int]]] = defaultdict(list)
    for p in [*plan.fills, *(p for b in buckets for p in b.pieces)]:
        runs[(p.dst, p.dst_name)].append((p.dst_start, p.length))
    errors = []
    for rank in range(plan.dst.tp):
        for name, shape in plan.dst_shapes.items():
            if is_scale(name):
                continue  # written with their FP8 weight's pieces (block-aligned, checked)
            dim = sglang_names(plan.dims)[name][2]
            at = 0
            for start, n in sorted(runs.get((rank, name), [])):
                if start != at:
                    errors.append(
                        f"rank {rank} {name}: {'gap' if start > at else 'overlap'} at {at}"
                    )
                at = max(at, start + n)
            if at != shape[dim]:
                errors.append(f"rank {rank} {name}: covered {at} of {shape[dim]}")
    return errors


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _slice_numel(shape: tuple[int, ...], dim: int) -> int:
    return _numel(shape) // shape[dim]


def check_config(cfg: RootConfig) -> None:
    """Can the trainer's shards be planned into the generator's layout? Raises
    :class:`ConfigError` in one line (a :class:`PlanError` is one)."""
    t, m = cfg.trainer, cfg.model
    # Every check of the plan (each tensor's split on both sides, vocab padding, FP8 block
    # alignment) is per tensor shape and layout; further layers and experts only repeat the
    # same tensors. So one layer per pipeline stage and one expert per EP rank check them
    # all, in milliseconds even for a 235B MoE (the full plan takes seconds: rl.plan does
    # it for the volumes). validate_trainer has checked that pp and ep divide the counts.
    few = {"num_layers": t.pp, "num_experts": t.ep if m.num_experts else 0}
    # One bucket per pair; the real DP, which trainer.ep must divide.
    plan_for(OmegaConf.merge(m, few), t, cfg.rollout, dp=t.dp, bucket_bytes=1 << 50)
