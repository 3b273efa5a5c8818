"""A LoRA checkpoint's adapters as a PEFT adapter directory, for the HF model they adapt.

Why: the merged export (rl/weights/convert.py) is a whole model per checkpoint; PEFT's
format is the adapters alone (``adapter_config.json`` and ``adapter_model.safetensors``,
megabytes), which ``peft.PeftModel.from_pretrained`` puts on the base model and SGLang or
vLLM serve as a LoRA beside it.

The mapping: our adapters sit on Megatron's fused linears (rl/models/lora.py), with one
``A`` per fused weight and ``B`` over its fused rows, ``W + s B A`` with ``s = alpha /
rank``. HF splits a fused weight by rows (QKV into q/k/v_proj, gate/up into gate_proj and
up_proj), so ``B`` is split exactly as its weight is (rl/weights/keymap.py ``to_hf``)
and each part keeps the whole ``A``: ``W_part + s B_part A`` is the part's rows of the
merged weight. PEFT's own scaling is ``lora_alpha / r``, so ``lora_alpha = s * r``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from rl.weights import keymap as km
from rl.weights.convert import adapter_keys, stored_model_config
from rl.weights.dist_ckpt import CheckpointError, check
from rl.weights.hf_io import atomic_dir, write_safetensors
from rl.weights.megatron_io import checkpoint_key, checkpoint_tensors, read_layer

PREFIX = "base_model.model."  # PeftModel's prefix before the HF model's own names
WEIGHTS = "adapter_model.safetensors"


def mcore_to_peft(ckpt_dir: str, out_dir: str, base_model: str | None = None) -> dict:
    """Write the adapters of the LoRA checkpoint ``ckpt_dir`` as a PEFT directory;
    ``base_model``: the HF model they adapt, recorded as ``base_model_name_or_path``."""
    from megatron.core import dist_checkpointing

    path = str(check(ckpt_dir))
    common = dist_checkpointing.load_common_state_dict(path)
    if not common.get("lora"):
        raise CheckpointError(f"checkpoint {path!r} has no LoRA adapters (trainer.lora.rank=0)")
    m = stored_model_config(common, path)
    d, scale = km.Dims.of(m), float(common["lora"]["scale"])
    stored = checkpoint_tensors(path)
    t0 = time.perf_counter()
    out: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    rank = 0
    for layer in range(d.layers):
        for k in km.layer_keys(d):
            ckpt, expert = checkpoint_key(k, layer)
            a, b = adapter_keys(ckpt)
            if expert is not None or a not in stored:
                continue
            got = read_layer(path, {a: stored[a], b: stored[b]}, layer)
            rank = got[a].shape[0]
            for name, part in zip(km.hf_names(k, d, layer), km.to_hf(k, got[b], d), strict=True):
                stem = PREFIX + name.removesuffix(".weight")
                out[f"{stem}.lora_A.weight"] = got[a].clone()  # each its own: one file
                out[f"{stem}.lora_B.weight"] = part.contiguous()
                targets.add(name.removesuffix(".weight").rsplit(".", 1)[-1])
    if not out:
        raise CheckpointError(f"checkpoint {path!r} names LoRA but holds no adapter tensors")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": scale * rank,
        "lora_dropout": 0.0,
        "target_modules": sorted(targets),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "inference_mode": True,
    }
    dst = Path(out_dir)
    with atomic_dir(dst) as tmp:
        write_safetensors(tmp, out.items(), [list(out)], single=WEIGHTS)
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {
        "rank": rank,
        "target_modules": sorted(targets),
        "tensors": len(out),
        "seconds": time.perf_counter() - t0,
    }
