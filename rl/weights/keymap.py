"""Names and layouts of a model's weights in Megatron-Core and Hugging Face.

How one model's tensors correspond across the two worlds, read from the architecture
registry (rl/models/arch.py declares each tensor: its Megatron key, HF names, SGLang name
and layout); the checkpoint converters and the trainer -> generator weight sync use it.

Megatron side: the *global* tensors of a ``torch_dist`` checkpoint, whose keys do not
depend on the layer spec (local or Transformer Engine) or on TP/PP; per-layer keys are
stacked along a leading layer axis in the checkpoint (and per-expert keys along an expert
axis after it), and this module handles one layer (and one expert) at a time. Two fused
layouts matter:

* ``linear_qkv`` rows are grouped per query group: ``[q heads of group g | k_g | v_g]`` for
  g = 0..groups-1. TP splits whole groups, so TP shards are contiguous row blocks.
* ``linear_fc1`` (dense, shared expert, each routed expert) is ``[gate ; up]`` globally, but
  each TP shard is ``[gate_r ; up_r]``: concatenating TP shards is *not* the global tensor
  (see :func:`tp_shard`).

A vision-language family's tower is carried as it is: the same tensors in both worlds
under the family's HF prefix and ``visual.``, replicated on every TP rank (:func:`carried`).

Vocab rows are padded to ``make_vocab_size_divisible_by`` on the Megatron side and the
padding is stripped on the Hugging Face side. Pure logic (torch tensors only). torch is
imported inside the tensor functions, so the shape half (names, shapes, TP split dims) that
the DDMA planner and ``python -m rl.plan`` use loads in milliseconds without it.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from typing import TYPE_CHECKING

from rl.models import arch as a
from rl.models import registry
from rl.models.arch import EMBED, FINAL_NORM, LAYERS, OUTPUT, Dims, TensorSpec

if TYPE_CHECKING:
    import torch

__all__ = ["EMBED", "FINAL_NORM", "LAYERS", "OUTPUT", "Dims"]

IN_NORM = "self_attention.linear_qkv.layer_norm_weight"
QKV_W = "self_attention.linear_qkv.weight"
QKV_B = "self_attention.linear_qkv.bias"
PROJ = "self_attention.linear_proj.weight"
MLP_NORM = "mlp.linear_fc1.layer_norm_weight"
FC1 = "mlp.linear_fc1.weight"
FC2 = "mlp.linear_fc2.weight"


@cache
def _tables(d: Dims) -> dict[str, TensorSpec]:
    return {s.key: s for s in registry.tensors(d)}


@cache
def _layouts() -> dict[str, TensorSpec]:
    """Every Megatron key any model can have -> its spec. Megatron's keys and layouts are
    Megatron's, the same for every family, so TP splitting needs no model."""
    dense = Dims(layers=1, hidden=1, ffn=1, heads=1, groups=1, head_dim=1, vocab=1,
                 padded_vocab=1, tied=False, qkv_bias=True, qk_norm=True)  # fmt: skip
    moe = replace(dense, experts=1, moe_ffn=1, shared_ffn=1, shared_gate=True)
    return {s.key: s for s in a.decoder_tensors(dense) + a.decoder_tensors(moe)}


# The prefix of a vision tower's keys in a Megatron checkpoint (the model's ``visual``).
TOWER = "visual."


def carried_prefix(d: Dims) -> str | None:
    """The HF prefix of the tensors the model carries unchanged (a vision tower's), or None."""
    vision = registry.get(d.arch, "architecture").vision
    return vision.prefix if vision is not None else None


def carried(key: str, d: Dims) -> bool:
    """``key`` is a carried tensor (a vision tower's): the same tensor in both formats,
    named ``visual.<name>`` in Megatron's and ``<the family's prefix><name>`` in HF's."""
    return key.startswith(TOWER) and carried_prefix(d) is not None


def specs(d: Dims) -> list[TensorSpec]:
    """The model's tensors, as its family declares them (globals last)."""
    return list(_tables(d).values())


def spec(key: str, d: Dims | None = None) -> TensorSpec:
    """The spec of Megatron ``key`` (per-expert keys by their ``{e}`` template)."""
    table = _tables(d) if d is not None else _layouts()
    t = a.template(key)
    if t not in table:
        raise KeyError(f"{key!r} is not a tensor of {d.arch if d else 'any model'}")
    return table[t]


def tp_dim(key: str) -> int | None:
    """Megatron's tensor-parallel split dimension of ``key`` (None: replicated)."""
    return spec(key).tp_dim


def _expand(specs: list[TensorSpec], d: Dims) -> list[str]:
    out = []
    for s in specs:
        if s.expert:
            out += [a.for_expert(s.key, e) for e in range(d.experts)]
        else:
            out.append(s.key)
    return out


def layer_keys(d: Dims) -> list[str]:
    """Per-layer Megatron keys (without the ``decoder.layers.`` prefix), experts expanded."""
    return _expand([s for s in _tables(d).values() if s.per_layer], d)


def global_keys(d: Dims) -> list[str]:
    return _expand([s for s in _tables(d).values() if not s.per_layer], d)


def hf_names(key: str, d: Dims, layer: int | None = None) -> tuple[str, ...]:
    """Hugging Face names that make up Megatron ``key`` (of ``layer`` for per-layer keys)."""
    if carried(key, d):
        return (f"{carried_prefix(d)}{key.removeprefix(TOWER)}",)
    s = spec(key, d)
    e = a.expert_of(key)
    names = tuple(a.for_expert(n, e) for n in s.hf) if e is not None else s.hf
    decoder = registry.get(d.arch, "architecture").hf_decoder
    if not s.per_layer:
        return tuple(decoder + n.removeprefix("model.") if n.startswith("model.") else n
                     for n in names)  # fmt: skip
    if layer is None:
        raise ValueError(f"{key!r} is a per-layer key: give the layer")
    return tuple(f"{decoder}layers.{layer}.{n}" for n in names)


def megatron_shape(key: str, d: Dims) -> tuple[int, ...]:
    """Global Megatron shape of ``key`` (one layer, one expert, no stacking axis)."""
    return spec(key, d).shape(d)


def hf_shapes(d: Dims) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name of the model with its shape, in file order."""
    first, *rest = global_keys(d)
    out = dict(_hf_parts(first, d, None))
    for i in range(d.layers):
        for key in layer_keys(d):
            out.update(_hf_parts(key, d, i))
    for key in rest:
        out.update(_hf_parts(key, d, None))
    return out


def _hf_parts(key: str, d: Dims, layer: int | None) -> list[tuple[str, tuple[int, ...]]]:
    s, names = spec(key, d), hf_names(key, d, layer)
    shape = s.shape(d)
    if s.layout == a.QKV:
        q, kv = d.heads * d.head_dim, d.groups * d.head_dim
        return [(n, (r, *shape[1:])) for n, r in zip(names, (q, kv, kv), strict=True)]
    if s.layout == a.GATE_UP:
        return [(n, (shape[0] // 2, *shape[1:])) for n in names]
    if s.layout == a.VOCAB:
        return [(names[0], (d.vocab, *shape[1:]))]
    return [(names[0], shape)]


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

    if carried(key, d):
        return hf[0]
    layout = spec(key, d).layout
    if layout == a.QKV:
        q, k, v = hf
        return fuse_qkv(q, k, v, d)
    if layout == a.GATE_UP:
        return torch.cat(hf, dim=0)
    (t,) = hf
    if layout == a.VOCAB and d.padded_vocab > d.vocab:
        pad = t.new_zeros(d.padded_vocab - d.vocab, *t.shape[1:])
        return torch.cat([t, pad], dim=0)
    return t


def to_hf(key: str, t: torch.Tensor, d: Dims) -> list[torch.Tensor]:
    """Split the global Megatron tensor ``key`` into its HF parts (padding stripped)."""
    import torch

    if carried(key, d):
        return [t]
    layout = spec(key, d).layout
    if layout == a.QKV:
        return [x.contiguous() for x in split_qkv(t, d)]
    if layout == a.GATE_UP:
        return [x.contiguous() for x in torch.chunk(t, 2, dim=0)]
    if layout == a.VOCAB:
        return [t[: d.vocab].contiguous()]
    return [t]


# ---------------------------------------------------------------------- tensor parallel
def tp_shard(key: str, t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    """This TP rank's Megatron shard of the global tensor ``key``."""
    import torch

    dim = tp_dim(key)
    if dim is None or tp == 1:
        return t
    if spec(key).layout == a.GATE_UP:
        gate, up = torch.chunk(t, 2, dim=0)
        return torch.cat([torch.chunk(gate, tp)[rank], torch.chunk(up, tp)[rank]], dim=0)
    return torch.chunk(t, tp, dim=dim)[rank]


def tp_unshard(key: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of :func:`tp_shard` over all ranks' shards (in rank order)."""
    import torch

    dim = tp_dim(key)
    if dim is None or len(shards) == 1:
        return shards[0]
    if spec(key).layout == a.GATE_UP:
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)
