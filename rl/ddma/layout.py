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
  the real size are zero-filled on the destination (never sent).

Pure logic: integers only, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from rl.weights import keymap as km

SGLANG_VOCAB_PADDING = 64  # sglang/srt/layers/vocab_parallel_embedding.py DEFAULT_...
CPU_FFN_MULTIPLE = 32


class PlanError(ValueError):
    """Two layouts that cannot be planned, named by the bad field and value."""


@dataclass(frozen=True)
class SrcLayout:
    """The trainer: Megatron TP x PP x DP. Global rank = tp + tp*(dp + dp*pp), which is
    Megatron-Core's default ``tp-cp-ep-dp-pp`` order."""

    tp: int
    pp: int = 1
    dp: int = 1
    layers_per_stage: tuple[int, ...] | None = None  # None: even split

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, tp_rank: int, pp_rank: int, dp_rank: int = 0) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

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
    """SGLang parameter name -> (Megatron key, layer, split dim) for a Llama-family model."""
    out: dict[str, tuple[str, int | None, int]] = {"model.embed_tokens.weight": (km.EMBED, None, 0)}
    per_layer = {
        "input_layernorm.weight": (km.IN_NORM, 0),
        "self_attn.qkv_proj.weight": (km.QKV_W, 0),
        "self_attn.qkv_proj.bias": (km.QKV_B, 0),
        "self_attn.o_proj.weight": (km.PROJ, 1),
        "post_attention_layernorm.weight": (km.MLP_NORM, 0),
        "mlp.gate_up_proj.weight": (km.FC1, 0),
        "mlp.down_proj.weight": (km.FC2, 1),
    }
    for i in range(d.layers):
        for name, (key, dim) in per_layer.items():
            if key != km.QKV_B or d.qkv_bias:
                out[f"model.layers.{i}.{name}"] = (key, i, dim)
    out["model.norm.weight"] = (km.FINAL_NORM, None, 0)
    if not d.tied:
        out["lm_head.weight"] = (km.OUTPUT, None, 0)
    return out


def _kv_heads(d: km.Dims, tp: int) -> tuple[int, int]:
    """(KV heads per rank, ranks sharing one KV head) of an SGLang TP degree."""
    if tp >= d.groups:
        return 1, tp // d.groups
    return d.groups // tp, 1


def dst_runs(d: km.Dims, dst: DstLayout, key: str, rank: int) -> list[tuple[int | None, int]]:
    """Destination shard of ``key`` on ``rank`` as (global Megatron start or None for
    padding, length) runs along its split dimension, in destination order."""
    t, hd = dst.tp, d.head_dim
    if key in (km.QKV_W, km.QKV_B):
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
    if key in (km.FC1, km.FC2, km.EMBED, km.OUTPUT):
        # Rows (columns for fc2) of a padded size split evenly; past the real size: zeros.
        vocab = key in (km.EMBED, km.OUTPUT)
        size = d.vocab if vocab else d.ffn
        per = (dst.padded_vocab(size) if vocab else dst.padded_ffn(size)) // t
        lo = rank * per
        real = max(0, min(lo + per, size) - lo)
        runs = [(lo, real), (None, per - real)]
        if key == km.FC1:  # [gate_r ; up_r]: up rows start at ffn in Megatron's fc1
            runs += [(d.ffn + lo, real), (None, per - real)]
        return _merge(runs)
    size = km.megatron_shape(key, d)[km.TP_DIM[key] or 0]
    if km.TP_DIM[key] is None:
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
def src_locate(d: km.Dims, src: SrcLayout, key: str, start: int, n: int):
    """Split the global Megatron run [start, start+n) of ``key`` at Megatron TP shard
    boundaries: yields (tp rank, local start, length)."""
    if km.TP_DIM[key] is None:
        yield None, start, n  # replicated: any TP rank has it
        return
    size = km.megatron_shape(key, d)[km.TP_DIM[key]]
    half = size // 2 if key == km.FC1 else size  # fc1 shards are [gate_r ; up_r]
    per = half // src.tp
    while n > 0:
        part, x = divmod(start, half)  # part: 0 gate (or the whole tensor), 1 up
        r, off = divmod(x, per)
        take = min(n, per - off)
        yield r, part * per + off, take
        start, n = start + take, n - take


def src_shapes(d: km.Dims, src: SrcLayout) -> dict[tuple[str, int | None], tuple[int, ...]]:
    """Per-rank Megatron shard shape of every (key, layer) of the model."""
    out = {}
    keys = [(k, i) for i in range(d.layers) for k in km.layer_keys(d)]
    for key, layer in [*keys, *((k, None) for k in km.global_keys(d))]:
        shape = list(km.megatron_shape(key, d))
        dim = km.TP_DIM[key]
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
    if d.ffn % src.tp:
        raise PlanError(f"trainer.tp={src.tp} does not divide ffn_hidden_size={d.ffn}")
    if dst.padded_ffn(d.ffn) % dst.tp:
        raise PlanError(f"rollout.tp={dst.tp} does not divide ffn_hidden_size={d.ffn}")
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
