"""Pure shape arithmetic for Llama-architecture models: parameter counts, padded vocab.

No torch, no Megatron: used by config validation, the planner and the conversion tools,
and tested in milliseconds.
"""

from __future__ import annotations

from typing import Any


def kv_channels(m: Any) -> int:
    return m.hidden_size // m.num_attention_heads


def padded_vocab_size(m: Any) -> int:
    """Rows of the embedding and output layer: vocab_size rounded up to the padding multiple."""
    mult = m.make_vocab_size_divisible_by
    return -(-m.vocab_size // mult) * mult


def layer_param_count(m: Any) -> int:
    d = kv_channels(m)
    q, kv = m.num_attention_heads * d, m.num_query_groups * d
    attn = m.hidden_size * (q + 2 * kv) + q * m.hidden_size
    if m.qkv_bias:
        attn += q + 2 * kv
    mlp = 3 * m.hidden_size * m.ffn_hidden_size
    norms = 2 * m.hidden_size
    return attn + mlp + norms


def param_count(m: Any, padded: bool = False) -> int:
    """Total parameters: the HF count, or with ``padded`` the Megatron count (padding rows)."""
    vocab = padded_vocab_size(m) if padded else m.vocab_size
    embed = vocab * m.hidden_size
    output = 0 if m.tie_embeddings else vocab * m.hidden_size
    return embed + output + m.num_layers * layer_param_count(m) + m.hidden_size
