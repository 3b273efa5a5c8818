"""Shared helpers for the DDMA tests: Megatron shards of a Hugging Face checkpoint, and
running a plan in one process (pack -> verify -> unpack, no process group)."""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file

from rl.ddma import wire
from rl.ddma.plan import Plan
from rl.weights import keymap as km
from rl.weights.hf_config import model_config_from_hf


def model_dims(model_dir: Path, src_tp: int = 4) -> km.Dims:
    """Dims of a checkpoint as the trainer would hold it (vocab padded for ``src_tp``)."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    m = model_config_from_hf(cfg, name="t", make_vocab_size_divisible_by=1)
    m = replace(m, make_vocab_size_divisible_by=math.lcm(8, src_tp))
    return km.Dims.of(m)


def hf_state(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def megatron_globals(hf: dict[str, torch.Tensor], d: km.Dims) -> dict:
    """(Megatron key, layer) -> global (TP=1) tensor, vocab rows padded with random values
    (Megatron initialises its padding rows; they must never reach the generator)."""
    out = {}
    for layer in range(d.layers):
        for key in km.layer_keys(d):
            out[(key, layer)] = km.to_megatron(key, [hf[n] for n in km.hf_names(key, d, layer)], d)
    for key in km.global_keys(d):
        t = km.to_megatron(key, [hf[n] for n in km.hf_names(key, d)], d)
        if key in (km.EMBED, km.OUTPUT):
            t[d.vocab :] = torch.randn_like(t[d.vocab :])
        out[(key, None)] = t
    return out


def megatron_shards(glob: dict, plan: Plan, rank: int) -> dict:
    """The local shards the trainer's global ``rank`` holds (only its stage's layers)."""
    from rl.ddma.layout import expert_owner

    src = plan.src
    at = src.coords(rank)
    out = {}
    for (key, layer), t in glob.items():
        owner = expert_owner(plan.dims, src, key)
        if owner is not None and owner != at.ep:
            continue  # another EP rank's expert
        if layer is None:
            stage = 0 if key == km.EMBED else src.pp - 1
        else:
            stage = src.stage_of(layer, plan.dims.layers)[0]
        if stage == at.pp:
            out[(key, layer)] = km.tp_shard(key, t, src.tp, at.tp).clone()
    return out


def expert_slabs(params: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
    """SGLang's fused expert parameters (``...w13_weight``, experts first) as the plan names
    them, one ``name[e]`` per expert; other parameters unchanged."""
    fused = {n.rsplit("[", 1)[0] for n in names if n.endswith("]")}
    out = {}
    for name, t in params.items():
        if name in fused:
            out.update({f"{name}[{e}]": t[e] for e in range(t.shape[0])})
        else:
            out[name] = t
    return out


def run_in_process(plan: Plan, glob: dict, dtype: torch.dtype, version: int = 1) -> list[dict]:
    """Execute ``plan`` bucket by bucket in one process; return each generator rank's
    tensors (initialised to NaN so an unwritten element shows)."""
    shards = {r: megatron_shards(glob, plan, r) for r in range(plan.src.world)}
    dst = [
        {
            n: torch.full(s, float("nan"), dtype=wire.dst_dtype(plan, n, dtype))
            for n, s in plan.dst_shapes.items()
        }
        for _ in range(plan.dst.tp)
    ]
    buf = torch.empty(plan.bucket_bytes, dtype=torch.uint8)
    for b in plan.buckets:
        msg = wire.pack(buf, plan, b, lambda k, i, s=shards[b.src]: s[(k, i)], dtype, version)
        wire.verify(msg, plan, b, version)
        wire.unpack(msg, plan, b, dst[b.dst].__getitem__, dtype)
    for r in range(plan.dst.tp):
        wire.zero_fill(plan, r, dst[r].__getitem__)
    return dst


KV_HEADS = {"llama": 2, "llama_tied": 2, "qwen2": 2, "llama_mha": 4}
# Every other family: Qwen3 (explicit head_dim, QK norm; one with a single KV head, tied),
# Mistral, and the two MoE families, whose experts also move from their EP owner.
FAMILIES = {"qwen3": 2, "qwen3_kv1": 1, "mistral": 2, "qwen3_moe": 2, "qwen2_moe": 2}
MOE = ("qwen3_moe", "qwen2_moe")
# (model, src tp, src pp, dst tp): Megatron TP must divide the KV heads (whole query groups
# per rank); SGLang TP may exceed them (replicated KV heads, checked with the 2-KV models).
COMBOS = [
    (kind, *c)
    for kind in KV_HEADS
    for c in itertools.product((1, 2, 4), (1, 2), (1, 2, 4))
    if KV_HEADS[kind] % c[0] == 0
]
# (model, src tp, src pp, src ep, dst tp) for the other families: TP x PP (x EP) in {1,2}.
FAMILY_COMBOS = [
    (kind, *c)
    for kind in FAMILIES
    for c in itertools.product((1, 2), (1, 2), (1, 2), (1, 2, 4))
    if FAMILIES[kind] % c[0] == 0 and (c[2] == 1 or kind in MOE)
]


def make_models(root: Path) -> dict[str, Path]:
    """A tiny random HF checkpoint of every kind the DDMA tests plan for, under ``root``."""
    from tests.helpers.hf_models import make_model

    return {kind: make_model(kind, root / kind) for kind in (*KV_HEADS, *FAMILIES)}


def gloo_world(model_dir: Path, src: tuple[int, int], dst_tp: int, bucket_bytes: int,
               fp8_block: int | None = None):  # fmt: skip
    """A DDMA test world on the current gloo group: ranks [0, tp*pp) the trainer, the next
    ``dst_tp`` the generator. Returns (rank, plan, src_ranks, dst_ranks, Megatron globals)."""
    import torch.distributed as dist

    from rl.ddma.plan import DstLayout, SrcLayout, make_plan

    d = model_dims(model_dir, src_tp=src[0])
    plan = make_plan(d, SrcLayout(*src), DstLayout(dst_tp), 4, bucket_bytes, fp8_block)
    n_src = plan.src.world
    torch.manual_seed(0)
    glob = megatron_globals(hf_state(model_dir), d)
    return dist.get_rank(), plan, list(range(n_src)), [n_src + j for j in range(dst_tp)], glob


def report_to(report_dir: str | None, rank: int):
    """What a rank writes as its outcome (read back with :func:`rank_outcomes`)."""

    def report(text: str) -> None:
        if report_dir:
            Path(report_dir, f"rank{rank}").write_text(text)

    return report


def rank_outcomes(report_dir: Path, n: int) -> list[str]:
    return [
        (report_dir / f"rank{r}").read_text() if (report_dir / f"rank{r}").exists() else ""
        for r in range(n)
    ]


def corrupt_second_bucket(rank: int) -> None:
    """Trainer rank 0 flips one byte of its second bucket after the checksum was taken
    (bit rot between packing and the receiver)."""
    import rl.ddma.wire as wire

    original = wire.write_header
    calls = {"n": 0}

    def write_then_flip(buf, plan, bucket, version, **kw):
        original(buf, plan, bucket, version, **kw)
        calls["n"] += 1
        if rank == 0 and calls["n"] == 2:
            buf[bucket.nbytes - 1] ^= 0x01

    wire.write_header = write_then_flip


def exit_after_first_bucket(report) -> None:
    """This generator rank vanishes (no goodbye) right after scattering its first bucket."""
    import rl.ddma.wire as wire

    original = wire.unpack

    def unpack_then_die(*args, **kw):
        original(*args, **kw)
        report("disconnected")
        os._exit(4)

    wire.unpack = unpack_then_die
