"""The model scaffolding the benchmarks share: random Llama checkpoints made locally, their
DDMA dims, and a trainer rank's Megatron shards of one.

A benchmark states only its shape (:func:`llama_shape`); the weights come from one seeded
initialisation, so two runs of a benchmark, on any machine, serve the same model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rl.weights import keymap as km
from rl.weights.hf_config import model_config_from_hf


def llama_shape(
    *, hidden: int, ffn: int, layers: int, heads: int, kv_heads: int, vocab: int,
    max_positions: int = 512,
) -> dict:  # fmt: skip
    """The fields of a ``LlamaConfig`` that fix a random Llama's shape (untied embeddings)."""
    return {
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": max_positions,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }


# The test suite's tiny Llama (tests/helpers/hf_models.py), for benchmarks of a server's
# own costs, where the model's size does not matter.
TINY = llama_shape(hidden=64, ffn=176, layers=4, heads=4, kv_heads=2, vocab=99, max_positions=128)


def make_llama(path: Path, shape: dict, seed: int = 0) -> Path:
    """A random Llama of ``shape`` saved in ``path`` (fp32, Hugging Face format)."""
    import transformers

    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).save_pretrained(path)
    return path


def dims(model_dir: Path) -> km.Dims:
    cfg = json.loads((model_dir / "config.json").read_text())
    return km.Dims.of(model_config_from_hf(cfg, name="bench", make_vocab_size_divisible_by=128))


def trainer_shards(model_dir: Path, d: km.Dims, tp: int, rank: int) -> dict:
    """This TP rank's Megatron shards (cloned, so the full tensors can be freed)."""
    from safetensors.torch import load_file

    hf = load_file(str(model_dir / "model.safetensors"))
    keys = [(k, i) for i in range(d.layers) for k in km.layer_keys(d)]
    keys += [(k, None) for k in km.global_keys(d)]
    out = {}
    for key, layer in keys:
        full = km.to_megatron(key, [hf[n] for n in km.hf_names(key, d, layer)], d)
        out[(key, layer)] = km.tp_shard(key, full, tp, rank).clone()
    return out
