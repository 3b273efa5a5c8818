"""Checkpoint conversion between Hugging Face directories and Megatron ``torch_dist``.

HF -> Megatron runs on ``tp*pp`` ranks (spawned here, or started by torchrun/SLURM): each
rank builds only its Megatron stage, fills its own shards from the HF safetensors (one
layer's tensors at a time; vocab matrices by row range) and writes its part of the
checkpoint. Megatron -> HF runs in one process and streams layer by layer, holding at most
one layer plus the output shard being written. Both write to a temporary directory that is
renamed only when complete, and validate their input before any rank starts.
"""

from __future__ import annotations

import json
import math
import resource
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from rl.config import lora_base
from rl.config.dtypes import PARAM_DTYPES, dtype_name, torch_dtype
from rl.config.errors import ConfigError
from rl.config.schema import ModelConfig, TrainerConfig
from rl.models.checks import validate_model, validate_trainer
from rl.weights import keymap as km
from rl.weights.dist_ckpt import CheckpointError, check, model_state, write
from rl.weights.hf_config import hf_config_from_model, model_config_from_hf
from rl.weights.hf_io import (
    TOKENIZER_FILES,
    HFCheckpoint,
    atomic_dir,
    plan_shards,
    write_safetensors,
)
from rl.weights.megatron_io import Provider, checkpoint_key, stored_keys


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- HF -> mcore
def prepare_hf_to_mcore(
    hf_dir: str, tp: int, pp: int, vocab_multiple: int, dtype: str | None, ep: int = 1
) -> tuple[ModelConfig, str]:
    """Validate the HF input and the target layout; return the model config and dtype."""
    hf = HFCheckpoint(hf_dir)
    m = model_config_from_hf(hf.config, name=Path(hf_dir).name, make_vocab_size_divisible_by=1)
    if vocab_multiple:
        # Pad to the requested multiple, made a multiple of TP as well.
        m = replace(m, make_vocab_size_divisible_by=math.lcm(vocab_multiple, tp))
    if dtype is None:
        if dtype_name(hf.dtype) not in PARAM_DTYPES:
            raise ConfigError(f"checkpoint dtype {hf.dtype} is not supported: pass --dtype")
        dtype = dtype_name(hf.dtype)
    t = TrainerConfig(
        tp=tp, pp=pp, dp=ep, ep=ep, params_dtype=dtype, micro_batch_size=1, global_batch_size=ep
    )
    validate_model(m)
    validate_trainer(t, m)
    d = km.Dims.of(m)
    hf.check(km.hf_shapes(d), carried=km.carried_prefix(d))
    return m, dtype


def hf_provider(hf: HFCheckpoint, m: ModelConfig, dtype: torch.dtype) -> Provider:
    """Global Megatron tensors computed from the HF checkpoint on demand."""
    d = km.Dims.of(m)

    def provide(key: str, layer: int | None, rows: tuple[int, int] | None) -> torch.Tensor:
        if key == km.OUTPUT and d.tied:
            key = km.EMBED
        names = km.hf_names(key, d, layer)
        if rows is not None:  # vocab rows [r0, r1); rows past the real vocab are padding
            r0, r1 = rows
            real = hf.get_rows(names[0], min(r0, d.vocab), min(r1, d.vocab)).to(dtype)
            pad = real.new_zeros(r1 - r0 - real.shape[0], d.hidden)
            return torch.cat([real, pad], dim=0)
        return km.to_megatron(key, [hf.get(n) for n in names], d).to(dtype)

    return provide


def hf_to_mcore_rank(
    hf_dir: str, out_dir: str, m: ModelConfig, tp: int, pp: int, dtype: str, ep: int = 1
):
    """One rank's part of the conversion (torch.distributed already initialised)."""
    import torch.distributed as dist

    from rl.models.megatron_gpt import build_gpt
    from rl.models.parallel import init_model_parallel
    from rl.weights.megatron_io import fill_model

    lay = init_model_parallel(tp, pp, seed=0, ep=ep)
    t = TrainerConfig(tp=tp, pp=pp, ep=ep, params_dtype=dtype)
    model = build_gpt(m, t, lay.first_stage, lay.last_stage, lay.pg_collection, initialize=False)
    hf = HFCheckpoint(hf_dir)
    t0 = time.perf_counter()

    def progress(layer: int) -> None:
        if lay.tp_rank == 0:
            _log(f"[convert] stage {lay.pp_rank}: layer {layer + 1}/{m.num_layers} written")

    n = fill_model(model, hf_provider(hf, m, torch_dtype(dtype)), progress)
    common = {"hf_config": hf.config, "hf_generation_config": hf.generation_config}
    write(model_state(model, m, **common), out_dir)
    stats = torch.tensor([peak_rss_mb(), n], dtype=torch.float64)
    everyone = [torch.zeros_like(stats) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, stats)
    return {
        "peak_rss_mb": [float(s[0]) for s in everyone],
        "tensors": int(sum(s[1] for s in everyone)),
        "seconds": time.perf_counter() - t0,
    }


def hf_to_mcore(
    hf_dir: str,
    out_dir: str,
    tp: int = 1,
    pp: int = 1,
    vocab_multiple: int = 128,
    dtype: str | None = None,
    ep: int = 1,
) -> dict:
    """Convert here, spawning ``tp*pp*ep`` local ranks; returns the summary."""
    from rl.runtime.launch import spawn

    m, dtype = prepare_hf_to_mcore(hf_dir, tp, pp, vocab_multiple, dtype, ep)
    out = Path(out_dir)
    try:
        res = spawn(hf_to_mcore_rank, tp * pp * ep, hf_dir, str(out), m, tp, pp, dtype, ep)[0]
    finally:
        shutil.rmtree(out.with_name(out.name + ".tmp"), ignore_errors=True)
    return res


def hf_cache_key(hf_dir: str, m: ModelConfig, tp: int, pp: int, dtype: str, ep: int = 1) -> str:
    """A digest of the checkpoint's content (config.json and every weight byte) and of the
    target layout: a changed file or layout converts again, a rerun does not."""
    import xxhash

    h = xxhash.xxh3_128()
    root = Path(hf_dir)
    for f in [root / "config.json", *sorted(root.glob("*.safetensors"))]:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    h.update(json.dumps([tp, pp, ep, dtype, m.make_vocab_size_divisible_by]).encode())
    return h.hexdigest()[:20]


def cached_hf_to_mcore(
    hf_dir: str, cache_root: str | Path, m: ModelConfig, tp: int, pp: int, dtype: str, ep: int = 1
) -> str:
    """``hf_dir`` as a Megatron checkpoint at ``tp``/``pp``, converted on the calling ranks
    (torch.distributed over exactly the trainer's ranks) unless the cache holds it."""
    out = Path(cache_root) / hf_cache_key(hf_dir, m, tp, pp, dtype, ep)
    if (out / "metadata.json").exists():  # written last: the rename makes it complete
        _log(f"[convert] reusing {out} for {hf_dir}")
        return str(out)
    res = hf_to_mcore_rank(hf_dir, str(out), m, tp, pp, dtype, ep)
    _log(f"[convert] {hf_dir} -> {out} (tp={tp}, pp={pp}, ep={ep}) in {res['seconds']:.1f}s")
    return str(out)


# --------------------------------------------------------------------------- mcore -> HF
def stored_model_config(common: dict, path: str) -> ModelConfig:
    from omegaconf import OmegaConf

    stored = common.get("model_config")
    if stored is None:
        raise CheckpointError(f"checkpoint {path!r} carries no model_config")
    merged = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), stored))
    assert isinstance(merged, ModelConfig)
    return merged


def adapter_keys(ckpt: str) -> tuple[str, str]:
    """The checkpoint keys of the LoRA ``A`` and ``B`` on the weight ``ckpt``
    (rl/models/lora.py)."""
    stem = ckpt.removesuffix("weight")
    return f"{stem}adapter.lora_A", f"{stem}adapter.lora_B"


def mcore_to_hf(
    ckpt_dir: str,
    out_dir: str,
    architecture: str | None = None,
    dtype: str | None = None,
    max_shard_bytes: int = 5 * 2**30,
    tokenizer_dir: str | None = None,
) -> dict:
    """Convert a Megatron checkpoint (any TP/PP) into a Hugging Face directory."""
    from megatron.core import dist_checkpointing

    from rl.weights.megatron_io import checkpoint_tensors, read_layer

    path = str(check(ckpt_dir))
    common = dist_checkpointing.load_common_state_dict(path)
    m = stored_model_config(common, path)
    d = km.Dims.of(m)
    # A LoRA checkpoint holds the adapters; its base is the checkpoint it names, or itself.
    base = path
    if ref := (common.get("lora") or {}).get("base"):
        try:
            base = str(check(lora_base.resolve(ref, path)))
        except lora_base.BaseError as e:
            raise CheckpointError(str(e)) from None
    tensors = checkpoint_tensors(base)
    adapter_tensors = checkpoint_tensors(path) if base != path else tensors
    stored = stored_keys(d)
    for full, want in stored.items():
        if full not in tensors or tensors[full][0] != want:
            got = tensors[full][0] if full in tensors else "missing"
            raise CheckpointError(f"checkpoint {path!r}: {full} is {got}, expected {want}")
    src_dtype = tensors[km.EMBED][1]
    out_dtype = torch_dtype(dtype) if dtype else src_dtype
    hf_cfg = common.get("hf_config")
    arch = architecture or m.architecture
    config = hf_config_from_model(m, arch, dtype_name(out_dtype), extra=_carried_fields(hf_cfg))

    elem = torch.empty(0, dtype=out_dtype).element_size()
    kept = sorted(k for k in tensors if km.carried(k, d))  # a vision tower
    shapes = km.hf_shapes(d) | {km.hf_names(k, d)[0]: tensors[k][0] for k in kept}
    sizes = {n: elem * int(torch.Size(s).numel()) for n, s in shapes.items()}
    shards = plan_shards(sizes, max_shard_bytes)
    t0 = time.perf_counter()

    # A LoRA checkpoint (rl/models/lora.py) is exported merged: W + scale * B @ A, on the
    # global tensors of each layer, whose rows B shares in the checkpoint's layout.
    scale = float(common["lora"]["scale"]) if common.get("lora") else 0.0

    def produce():
        def convert(layer: int | None, keys: list[str]):
            want = {ckpt: tensors[ckpt] for ckpt in {checkpoint_key(k, layer)[0] for k in keys}}
            got = read_layer(base, want, layer)
            if scale and layer is not None:
                pairs = {a: adapter_tensors[a] for c in want for a in adapter_keys(c)
                         if a in adapter_tensors}  # fmt: skip
                got |= read_layer(path, pairs, layer) if pairs else {}
            for k in keys:
                ckpt, expert = checkpoint_key(k, layer)
                t = got[ckpt] if expert is None else got[ckpt][expert]
                a, b = adapter_keys(ckpt)
                if a in got:
                    t = t + (scale * (got[b].double() @ got[a].double())).to(t.dtype)
                for name, part in zip(km.hf_names(k, d, layer), km.to_hf(k, t, d), strict=True):
                    yield name, part.to(out_dtype)

        first, *rest = km.global_keys(d)
        yield from convert(None, [first])
        for i in range(d.layers):
            yield from convert(i, km.layer_keys(d))
            _log(f"[convert] layer {i + 1}/{d.layers} written")
        yield from convert(None, rest + kept)

    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        write_safetensors(tmp, produce(), shards)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        gen = common.get("hf_generation_config") or _generation_config(config)
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        copied = _copy_tokenizer(tokenizer_dir, tmp) if tokenizer_dir else []
    return {
        "architecture": arch,
        "tensors": len(shapes),
        "shards": len(shards),
        "tokenizer_files": copied,
        "peak_rss_mb": [peak_rss_mb()],
        "seconds": time.perf_counter() - t0,
    }


_CARRIED = ("bos_token_id", "eos_token_id", "pad_token_id", "transformers_version")


def _carried_fields(hf_cfg: dict | None) -> dict:
    """Fields of the original config.json that are not shape facts (token ids...)."""
    return {k: hf_cfg[k] for k in _CARRIED if hf_cfg and k in hf_cfg}


def _generation_config(config: dict) -> dict:
    return {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}


def _copy_tokenizer(src: str, dst: Path) -> list[str]:
    srcp = Path(src)
    if not srcp.is_dir():
        raise FileNotFoundError(f"--tokenizer-dir {src!r} is not a directory")
    copied = [f for f in TOKENIZER_FILES if (srcp / f).exists()]
    if not copied:
        raise FileNotFoundError(f"--tokenizer-dir {src!r} holds none of {TOKENIZER_FILES}")
    for f in copied:
        shutil.copy2(srcp / f, dst / f)
    return copied


# --------------------------------------------------------------------------- fresh HF dir
def init_hf_dir(m: ModelConfig, out_dir: str, token_ids: dict, dtype: str = "float32") -> Path:
    """A Hugging Face directory of ``m`` with small random weights, for generator servers to
    start from when there is no HF checkpoint (the embedded default): the RL loop pushes
    the trainer's weights into every server before the first rollout, so only the shapes
    and the token ids (``bos_token_id``/``eos_token_id``/``pad_token_id``) matter here.
    Written to a temporary directory and renamed, so a reader never sees half of it."""
    config = hf_config_from_model(m, dtype=dtype, extra=token_ids)
    shapes = km.hf_shapes(km.Dims.of(m))
    g = torch.Generator().manual_seed(0)
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = [
        (n, (0.02 * torch.randn(s, generator=g)).to(torch_dtype(dtype))) for n, s in shapes.items()
    ]
    write_safetensors(tmp, iter(tensors), [list(shapes)])
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "generation_config.json").write_text(json.dumps(_generation_config(config)) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
