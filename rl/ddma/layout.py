"""The two sides of a DDMA transfer: Megatron's shards and SGLang's, in one coordinate system.

Every tensor is cut along one dimension only (rows for column-parallel weights, columns
for row-parallel ones, whole tensors for replicated norms). A destination shard is first
described as runs ``[start, start+length)`` of the *global* Megatron tensor (TP=1, fused
per query group, ``[gate ; up]``, vocab padded), then each run is located on the Megatron
TP rank that holds it:

* SGLang ``qkv_proj`` on rank r is ``[q_r ; k_r ; v_r]``: q heads of rank r, then its KV
  heads (KV heads are replicated when SGLang TP > KV heads), each a run of Megatron's
  ``[q_g | k_g | v_g]`` rows;
* ``gate_up_proj`` is ``[gate_r ; up_r]`` and Megatron's fc1 shard is also
  ``[gate_r ; up_r]`` but for Megatron's own TP degree;
* vocab shards follow SGLang's padding rule (and MLP widths its CPU padding); rows past
  the real size are zero-filled on the destination (never sent);
* routed experts: SGLang's fused ``w13_weight`` / ``w2_weight`` hold every expert on every
  rank (SGLang EP 1), expert e's slab ``[e]`` split like a dense MLP; the source is the
  Megatron EP rank that owns expert e (expert-parallel ranks are the data-parallel ranks
  with ``dp_rank % ep`` equal to the owner).

Pure logic: integers only, no torch.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import NamedTuple

from rl.config.errors import ConfigError
from rl.models import arch as a
from rl.weights import keymap as km

SGLANG_VOCAB_PADDING = 64  # sglang/srt/layers/vocab_parallel_embedding.py DEFAULT_...
CPU_FFN_MULTIPLE = 32


class PlanError(ConfigError):
    """Two layouts that cannot be planned, named by the bad field and value (a config
    error: the layouts come from the config)."""


class RankCoords(NamedTuple):
    """A trainer rank's place in Megatron's grid: TP, PP and DP rank, and its EP rank (which
    experts it holds)."""

    tp: int
    pp: int
    dp: int
    ep: int


@dataclass(frozen=True)
class SrcLayout:
    """The trainer: Megatron TP x PP x DP. Global rank = tp + tp*(dp + dp*pp), which is
    Megatron-Core's default ``tp-cp-ep-dp-pp`` order; EP (which divides DP) is the inner
    part of the DP rank, so expert e lives on the DP ranks with ``dp % ep == owner(e)``.
    :meth:`rank` and :meth:`coords` are the one statement of that order."""

    tp: int
    pp: int = 1
    dp: int = 1
    layers_per_stage: tuple[int, ...] | None = None  # None: even split
    _: KW_ONLY
    ep: int = 1

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, tp_rank: int, pp_rank: int, dp_rank: int = 0) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def coords(self, rank: int) -> RankCoords:
        """Where trainer rank ``rank`` (0-based in the trainer) sits: the inverse of
        :meth:`rank`, with the EP rank Megatron gives it (its expert groups run TP fastest,
        then EP, then expert DP, then PP)."""
        if not 0 <= rank < self.world:
            raise PlanError(f"trainer rank {rank} is outside tp*pp*dp={self.world}")
        tp_rank, rest = rank % self.tp, rank // self.tp
        dp_rank, pp_rank = rest % self.dp, rest // self.dp
        return RankCoords(tp_rank, pp_rank, dp_rank, dp_rank % self.ep)

    def stages(self, layers: int) -> tuple[int, ...]:
        if self.layers_per_stage is not None:
            return self.layers_per_stage
        return (layers // self.pp,) * self.pp

    def stage_of(self, layer: int, layers: int) -> tuple[int, int]:
        """(pp rank, first global layer of that stage) of a global layer index."""
        start = 0
        for pp_rank, n in enumerate(self.stages(layers)):
            if layer < start + n:
                return pp_rank, start
            start += n
        raise PlanError(f"layer {layer} is past the {layers} layers")


@dataclass(frozen=True)
class DstLayout:
    """The generator: one SGLang engine's TP ranks, numbered 0..tp-1."""

    tp: int
    vocab_padding: int = SGLANG_VOCAB_PADDING
    # SGLang on CPU pads the MLP width to a multiple of tp*32 (configs/update_config.py
    # adjust_config_with_unaligned_cpu_tp); the extra rows/columns hold zeros.
    ffn_multiple: int = 1

    @classmethod
    def sglang(cls, tp: int, device: str) -> DstLayout:
        """The layout a live SGLang server on ``device`` holds."""
        return cls(tp, ffn_multiple=CPU_FFN_MULTIPLE if device == "cpu" else 1)

    def padded_ffn(self, ffn: int) -> int:
        return round_up(ffn, self.tp * self.ffn_multiple) if self.ffn_multiple > 1 else ffn

    def padded_vocab(self, vocab: int) -> int:
        """SGLang's rule: pad to the padding size, times TP when that does not divide."""
        pad = self.vocab_padding
        if round_up(vocab, pad) % self.tp:
            pad *= self.tp
        return round_up(vocab, pad)


# ------------------------------------------------------------------------ destination
def sglang_names(d: km.Dims) -> dict[str, tuple[str, int | None, int]]:
    """SGLang parameter name -> (Megatron key, layer, split dim). A routed expert's name is
    ``<fused parameter>[e]``, its slab of SGLang's fused expert tensor."""
    out: dict[str, tuple[str, int | None, int]] = {}
    specs = [s for s in km.specs(d) if s.sglang is not None]
    layer_specs = [s for s in specs if s.per_layer]
    first, *rest = [s for s in specs if not s.per_layer]
    out[first.sglang] = (first.key, None, first.tp_dim or 0)  # type: ignore[index]
    for i in range(d.layers):
        for s in layer_specs:
            for e in range(d.experts) if s.expert else (None,):
                key = s.key if e is None else a.for_expert(s.key, e)
                name = s.sglang if e is None else a.for_expert(s.sglang, e)  # type: ignore[arg-type]
                out[f"model.layers.{i}.{name}"] = (key, i, s.tp_dim or 0)
    for s in rest:
        out[s.sglang] = (s.key, None, s.tp_dim or 0)  # type: ignore[index]
    return out


def _kv_heads(d: km.Dims, tp: int) -> tuple[int, int]:
    """(KV heads per rank, ranks sharing one KV head) of an SGLang TP degree."""
    if tp >= d.groups:
        return 1, tp // d.groups
    return d.groups // tp, 1


def dst_runs(
    d: km.Dims, dst: DstLayout, spec: a.TensorSpec, rank: int
) -> list[tuple[int | None, int]]:
    """Destination shard of the tensor ``spec`` on ``rank`` as (global Megatron start or
    None for padding, length) runs along its split dimension, in destination order."""
    t, hd = dst.tp, d.head_dim
    if spec.layout == a.QKV:
        per_group = d.heads // d.groups  # q heads per query group
        group_rows = (per_group + 2) * hd
        runs: list[tuple[int | None, int]] = []
        qh = d.heads // t
        for h in range(rank * qh, (rank + 1) * qh):  # q heads, merged into runs below
            g, j = divmod(h, per_group)
            runs.append((g * group_rows + j * hd, hd))
        nkv, share = _kv_heads(d, t)
        kv = [rank // share * nkv + i for i in range(nkv)]
        runs += [(g * group_rows + per_group * hd, hd) for g in kv]
        runs += [(g * group_rows + (per_group + 1) * hd, hd) for g in kv]
        return _merge(runs)
    if spec.layout == a.VOCAB or spec.width is not None:
        # Vocab rows, MLP rows (columns for fc2) of a padded size split evenly; past the
        # real size: zeros.
        vocab = spec.layout == a.VOCAB
        size = d.vocab if vocab else d.width(spec.width)  # type: ignore[arg-type]
        per = (dst.padded_vocab(size) if vocab else dst.padded_ffn(size)) // t
        lo = rank * per
        real = max(0, min(lo + per, size) - lo)
        runs = [(lo, real), (None, per - real)]
        if spec.layout == a.GATE_UP:  # [gate_r ; up_r]: up rows start at the width
            runs += [(size + lo, real), (None, per - real)]
        return _merge(runs)
    size = spec.shape(d)[spec.tp_dim or 0]
    if spec.tp_dim is None:
        return [(0, size)]
    per = size // t
    return [(rank * per, per)]


def _merge(runs: list[tuple[int | None, int]]) -> list[tuple[int | None, int]]:
    out: list[tuple[int | None, int]] = []
    for start, n in runs:
        if n == 0:
            continue
        if out and start is not None and out[-1][0] is not None:
            s0, n0 = out[-1]
            if s0 + n0 == start:  # type: ignore[operator]
                out[-1] = (s0, n0 + n)
                continue
        if out and start is None and out[-1][0] is None:
            out[-1] = (None, out[-1][1] + n)
            continue
        out.append((start, n))
    return out


# ------------------------------------------------------------------------ source
def src_locate(d: km.Dims, src: SrcLayout, spec: a.TensorSpec, start: int, n: int):
    """Split the global Megatron run [start, start+n) of the tensor ``spec`` at Megatron TP
    shard boundaries: yields (tp rank, local start, length)."""
    if spec.tp_dim is None:
        yield None, start, n  # replicated: any TP rank has it
        return
    size = spec.shape(d)[spec.tp_dim]
    half = size // 2 if spec.layout == a.GATE_UP else size  # shards are [gate_r ; up_r]
    per = half // src.tp
    while n > 0:
        part, x = divmod(start, half)  # part: 0 gate (or the whole tensor), 1 up
        r, off = divmod(x, per)
        take = min(n, per - off)
        yield r, part * per + off, take
        start, n = start + take, n - take


def expert_owner(d: km.Dims, src: SrcLayout, key: str) -> int | None:
    """The EP rank holding ``key``'s expert (None: not a routed expert)."""
    e = a.expert_of(key)
    return None if e is None else e // (d.experts // src.ep)


def src_shapes(d: km.Dims, src: SrcLayout) -> dict[tuple[str, int | None], tuple[int, ...]]:
    """Per-rank Megatron shard shape of every (key, layer) of the model."""
    out = {}
    keys = [(k, i) for i in range(d.layers) for k in km.layer_keys(d)]
    for key, layer in [*keys, *((k, None) for k in km.global_keys(d))]:
        shape = list(km.megatron_shape(key, d))
        dim = km.tp_dim(key)
        if dim is not None:
            shape[dim] //= src.tp
        out[(key, layer)] = tuple(shape)
    return out


# ------------------------------------------------------------------------ planning
def check_layouts(d: km.Dims, src: SrcLayout, dst: DstLayout) -> None:
    """Reject layouts that either side could not hold, naming the field and value."""
    for side, t in (("trainer.tp", src.tp), ("rollout.tp", dst.tp)):
        if t < 1:
            raise PlanError(f"{side}={t} must be >= 1")
        if d.heads % t:
            raise PlanError(f"{side}={t} does not divide num_attention_heads={d.heads}")
    widths = {"ffn_hidden_size": d.ffn} if not d.experts else {"moe_ffn_hidden_size": d.moe_ffn}
    if d.shared_ffn:
        widths["shared_expert_ffn_hidden_size"] = d.shared_ffn
    for name, w in widths.items():
        if w % src.tp:
            raise PlanError(f"trainer.tp={src.tp} does not divide {name}={w}")
        if dst.padded_ffn(w) % dst.tp:
            raise PlanError(f"rollout.tp={dst.tp} does not divide {name}={w}")
    if src.ep < 1 or src.dp % src.ep or (d.experts or 1) % src.ep or (src.ep > 1 and not d.experts):
        raise PlanError(
            f"trainer.ep={src.ep} must divide trainer.dp={src.dp} and num_experts={d.experts}"
        )
    if d.groups % src.tp:
        raise PlanError(f"trainer.tp={src.tp} does not divide num_query_groups={d.groups}")
    if d.padded_vocab % src.tp:
        raise PlanError(f"trainer.tp={src.tp} does not divide padded vocab {d.padded_vocab}")
    if d.groups % dst.tp and dst.tp % d.groups:
        raise PlanError(
            f"rollout.tp={dst.tp} and num_query_groups={d.groups}: one must divide the other"
        )
    stages = src.stages(d.layers)
    if len(stages) != src.pp or sum(stages) != d.layers or min(stages) < 1:
        raise PlanError(
            f"trainer layers per stage {list(stages)} do not split {d.layers} layers "
            f"over pp={src.pp}"
        )


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m
