"""Names and layouts of Llama-architecture weights in Megatron-Core and Hugging Face.

The single source of truth for how one model's tensors correspond across the two worlds;
the checkpoint converters and the trainer -> generator weight sync both use it.

Megatron side: the *global* tensors of a ``torch_dist`` checkpoint, whose keys do not
depend on the layer spec (local or Transformer Engine) or on TP/PP; per-layer keys are
stacked along a leading layer axis in the checkpoint, and this module handles one layer at
a time. Two fused layouts matter:

* ``linear_qkv`` rows are grouped per query group: ``[q heads of group g | k_g | v_g]`` for
  g = 0..groups-1. TP splits whole groups, so TP shards are contiguous row blocks.
* ``linear_fc1`` is ``[gate ; up]`` globally, but each TP shard is ``[gate_r ; up_r]``:
  concatenating TP shards is *not* the global tensor (see :func:`tp_shard`).

Vocab rows are padded to ``make_vocab_size_divisible_by`` on the Megatron side and the
padding is stripped on the Hugging Face side. Pure logic (torch tensors only). torch is
imported inside the tensor functions, so the shape half (names, shapes, TP split dims) that
the DDMA planner and ``python -m rl.plan`` use loads in milliseconds without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rl.models.shapes import kv_channels, padded_vocab_size

if TYPE_CHECKING:
    import torch

EMBED = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
LAYERS = "decoder.layers."
IN_NORM = "self_attention.linear_qkv.layer_norm_weight"
QKV_W = "self_attention.linear_qkv.weight"
QKV_B = "self_attention.linear_qkv.bias"
PROJ = "self_attention.linear_proj.weight"
MLP_NORM = "mlp.linear_fc1.layer_norm_weight"
FC1 = "mlp.linear_fc1.weight"
FC2 = "mlp.linear_fc2.weight"

# Megatron per-layer key -> Hugging Face names under "model.layers.{i}." (fused order).
LAYER_MAP: dict[str, tuple[str, ...]] = {
    IN_NORM: ("input_layernorm.weight",),
    QKV_W: ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    QKV_B: ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    PROJ: ("self_attn.o_proj.weight",),
    MLP_NORM: ("post_attention_layernorm.weight",),
    FC1: ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    FC2: ("mlp.down_proj.weight",),
}
GLOBAL_MAP: dict[str, str] = {
    EMBED: "model.embed_tokens.weight",
    FINAL_NORM: "model.norm.weight",
    OUTPUT: "lm_head.weight",
}
# Megatron tensor-parallel split dimension (None: replicated on every TP rank).
TP_DIM: dict[str, int | None] = {
    EMBED: 0,
    OUTPUT: 0,
    FINAL_NORM: None,
    IN_NORM: None,
    MLP_NORM: None,
    QKV_W: 0,
    QKV_B: 0,
    FC1: 0,
    PROJ: 1,
    FC2: 1,
}


@dataclass(frozen=True)
class Dims:
    """The shape facts the layouts depend on, taken from a ModelConfig."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    padded_vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def of(cls, m: Any) -> Dims:
        return cls(
            layers=m.num_layers,
            hidden=m.hidden_size,
            ffn=m.ffn_hidden_size,
            heads=m.num_attention_heads,
            groups=m.num_query_groups,
            head_dim=kv_channels(m),
            vocab=m.vocab_size,
            padded_vocab=padded_vocab_size(m),
            tied=m.tie_embeddings,
            qkv_bias=m.qkv_bias,
        )

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.groups) * self.head_dim


def layer_keys(d: Dims) -> list[str]:
    """Per-layer Megatron keys (without the ``decoder.layers.`` prefix)."""
    return [k for k in LAYER_MAP if k != QKV_B or d.qkv_bias]


def global_keys(d: Dims) -> list[str]:
    return [k for k in (EMBED, FINAL_NORM, OUTPUT) if k != OUTPUT or not d.tied]


def hf_names(key: str, layer: int | None = None) -> tuple[str, ...]:
    """Hugging Face names that make up Megatron ``key`` (of ``layer`` for per-layer keys)."""
    if key in GLOBAL_MAP:
        return (GLOBAL_MAP[key],)
    if layer is None:
        raise ValueError(f"{key!r} is a per-layer key: give the layer")
    return tuple(f"model.layers.{layer}.{n}" for n in LAYER_MAP[key])


def megatron_shape(key: str, d: Dims) -> tuple[int, ...]:
    """Global Megatron shape of ``key`` (one layer, no stacking axis)."""
    return {
        EMBED: (d.padded_vocab, d.hidden),
        OUTPUT: (d.padded_vocab, d.hidden),
        FINAL_NORM: (d.hidden,),
        IN_NORM: (d.hidden,),
        MLP_NORM: (d.hidden,),
        QKV_W: (d.qkv_rows, d.hidden),
        QKV_B: (d.qkv_rows,),
        PROJ: (d.hidden, d.heads * d.head_dim),
        FC1: (2 * d.ffn, d.hidden),
        FC2: (d.hidden, d.ffn),
    }[key]


def hf_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name of the model with its shape, in file order."""
    q, kv = d.heads * d.head_dim, d.groups * d.head_dim
    per_layer = {
        "input_layernorm.weight": (d.hidden,),
        "self_attn.q_proj.weight": (q, d.hidden),
        "self_attn.k_proj.weight": (kv, d.hidden),
        "self_attn.v_proj.weight": (kv, d.hidden),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (d.hidden, q),
        "post_attention_layernorm.weight": (d.hidden,),
        "mlp.gate_proj.weight": (d.ffn, d.hidden),
        "mlp.up_proj.weight": (d.ffn, d.hidden),
        "mlp.down_proj.weight": (d.hidden, d.ffn),
    }
    out = {"model.embed_tokens.weight": (d.vocab, d.hidden)}
    for i in range(d.layers):
        for name, shape in per_layer.items():
            if name.endswith(".bias") and not d.qkv_bias:
                continue
            out[f"model.layers.{i}.{name}"] = shape
    out["model.norm.weight"] = (d.hidden,)
    if not d.tied:
        out["lm_head.weight"] = (d.vocab, d.hidden)
    return out


# ---------------------------------------------------------------------- fused layouts
def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, d: Dims) -> torch.Tensor:
    """HF q/k/v (weights or biases) -> Megatron's per-query-group ``[q_g | k_g | v_g]``."""
    import torch

    per = d.heads // d.groups
    rest = q.shape[1:]
    qg = q.reshape(d.groups, per * d.head_dim, *rest)
    kg = k.reshape(d.groups, d.head_dim, *rest)
    vg = v.reshape(d.groups, d.head_dim, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(d.qkv_rows, *rest)


def split_qkv(qkv: torch.Tensor, d: Dims) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch

    per = d.heads // d.groups
    rest = qkv.shape[1:]
    g = qkv.reshape(d.groups, (per + 2) * d.head_dim, *rest)
    q, k, v = torch.split(g, [per * d.head_dim, d.head_dim, d.head_dim], dim=1)
    return (
        q.reshape(d.heads * d.head_dim, *rest),
        k.reshape(d.groups * d.head_dim, *rest),
        v.reshape(d.groups * d.head_dim, *rest),
    )


def to_megatron(key: str, hf: list[torch.Tensor], d: Dims) -> torch.Tensor:
    """Build the global Megatron tensor ``key`` from its HF parts (see :func:`hf_names`)."""
    import torch

    if key in (QKV_W, QKV_B):
        return fuse_qkv(*hf, d)
    if key == FC1:
        return torch.cat(hf, dim=0)
    (t,) = hf
    if key in (EMBED, OUTPUT) and d.padded_vocab > d.vocab:
        pad = t.new_zeros(d.padded_vocab - d.vocab, *t.shape[1:])
        return torch.cat([t, pad], dim=0)
    return t


def to_hf(key: str, t: torch.Tensor, d: Dims) -> list[torch.Tensor]:
    """Split the global Megatron tensor ``key`` into its HF parts (padding stripped)."""
    import torch

    if key in (QKV_W, QKV_B):
        return [x.contiguous() for x in split_qkv(t, d)]
    if key == FC1:
        return [x.contiguous() for x in torch.chunk(t, 2, dim=0)]
    if key in (EMBED, OUTPUT):
        return [t[: d.vocab].contiguous()]
    return [t]


# ---------------------------------------------------------------------- tensor parallel
def tp_shard(key: str, t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's Megatron shard of the global tensor ``key``."""
    import torch

    dim = TP_DIM[key]
    if dim is None or tp == 1:
        return t
    if key == FC1:
        gate, up = torch.chunk(t, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp)[rank], torch.chunk(up, tp)[rank]], dim=0)
    return torch.chunk(t, tp, dim=dim)[rank]


def tp_unshard(key: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`tp_shard` over all ranks' shards (in rank order)."""
    import torch

    dim = TP_DIM[key]
    if dim is None or len(shards) == 1:
        return shards[0]
    if key == FC1:
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)
