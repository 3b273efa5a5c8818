"""Parameter counts of a model config: sums over its tensors (rl/models/arch.py).

The one formula the planner, validation and the conversion tools share. No torch, no
Megatron: tested in milliseconds.
"""

from __future__ import annotations

from rl.models.arch import Dims, ModelShape, kv_channels, padded_vocab_size
from rl.models.registry import count, get

__all__ = [
    "kv_channels",
    "layer_param_count",
    "lora_layer_params",
    "padded_vocab_size",
    "param_count",
    "sequence_parallel",
    "tower_param_count",
]

# trainer.lora target -> (input width, output width, column-parallel): rl/models/lora.py
LORA_SHAPES = {
    "qkv": lambda h, q, kv, f: (h, q + 2 * kv, True),
    "proj": lambda h, q, kv, f: (q, h, False),
    "fc1": lambda h, q, kv, f: (h, 2 * f, True),
    "fc2": lambda h, q, kv, f: (f, h, False),
}


def layer_param_count(m: ModelShape, tp: int = 1, ep: int = 1) -> int:
    """Parameters of one decoder layer (on one rank of TP ``tp`` and EP ``ep``)."""
    return count(Dims.of(m), tp, ep)


def param_count(m: ModelShape, padded: bool = False) -> int:
    """Total parameters: the HF count, or with ``padded`` the Megatron count (padding rows);
    a vision-language model's tower included."""
    d = Dims.of(m)
    if not padded:
        d = Dims(**{**d.__dict__, "padded_vocab": d.vocab})
    return count(d, per_layer=False) + d.layers * count(d) + tower_param_count(m)


def tower_param_count(m: ModelShape) -> int:
    """A vision-language model's tower and merger (0 for a text model), by its family's
    formula over the HF ``vision_config`` it holds."""
    vision = getattr(m, "vision", None)
    family = get(m.architecture).vision
    if vision is None or family is None:
        return 0
    return family.params(dict(vision.tower))


def lora_layer_params(m: ModelShape, rank: int, targets: list[str], tp: int = 1) -> int:
    """LoRA adapter parameters of one decoder layer on one TP rank: ``A`` is ``[rank, in]``
    and ``B`` ``[out, rank]``, with a column-parallel linear's ``out`` and a row-parallel
    one's ``in`` split over TP (rl/models/lora.py)."""
    kv_ch = kv_channels(m)
    q, kv = m.num_attention_heads * kv_ch, m.num_query_groups * kv_ch
    total = 0
    for target in targets:
        n_in, n_out, column = LORA_SHAPES[target](m.hidden_size, q, kv, m.ffn_hidden_size)
        total += rank * ((n_in + n_out // tp) if column else (n_in // tp + n_out))
    return total


def sequence_parallel(m: ModelShape, tp: int, asked: bool) -> bool:
    """Whether the trainer runs Megatron's sequence parallelism: with ``tp`` > 1 when
    ``trainer.sequence_parallel`` asks for it, and always for a Mixture-of-Experts model
    (Megatron-Core refuses to train one with TP but without it)."""
    return tp > 1 and (asked or bool(m.num_experts))
