"""Shape arithmetic, checked against counts worked out by hand for a small model."""

from __future__ import annotations

import dataclasses

import pytest

from rl.config.schema import ModelConfig
from rl.models.shapes import kv_channels, layer_param_count, padded_vocab_size, param_count


def _small(**changes: object) -> ModelConfig:
    """h=8, 4 heads of dim 2, 2 KV groups (GQA), ffn 12, 2 layers, vocab 10."""
    base = ModelConfig(
        name="small",
        num_layers=2,
        hidden_size=8,
        ffn_hidden_size=12,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=10,
        max_position_embeddings=16,
    )
    return dataclasses.replace(base, **changes)


# Per layer, worked out by hand (head dim 2: q width 4*2=8, k and v width 2*2=4 each):
#   qkv weight   8 * (8 + 4 + 4) = 128
#   out proj     8 * 8           =  64
#   SwiGLU mlp   3 * 8 * 12      = 288   (gate, up, down)
#   2 RMSNorms   2 * 8           =  16
LAYER = 128 + 64 + 288 + 16  # 496
EMBED = 10 * 8  # 80, and the same again for an untied output layer
FINAL_NORM = 8


def test_kv_channels() -> None:
    """The head dim sets the Q/K/V widths that every other count is built on."""
    assert kv_channels(_small()) == 2


def test_layer_count_by_hand() -> None:
    """GQA: K and V are sized by query groups, not heads; MLP has three matrices."""
    assert layer_param_count(_small()) == LAYER == 496


def test_untied_total_by_hand() -> None:
    """Embedding + output layer + layers + final norm: the HF count at tp=1."""
    assert param_count(_small()) == EMBED + EMBED + 2 * LAYER + FINAL_NORM == 1160


def test_tied_embeddings_drop_output_layer() -> None:
    """Tied embeddings share one matrix, so the output layer adds nothing."""
    assert param_count(_small(tie_embeddings=True)) == EMBED + 2 * LAYER + FINAL_NORM == 1080


def test_qkv_bias_adds_q_plus_two_kv_per_layer() -> None:
    """Qwen-style QKV bias: one bias per output of the fused QKV projection."""
    bias = 8 + 2 * 4  # 16 per layer
    assert layer_param_count(_small(qkv_bias=True)) == LAYER + bias
    assert param_count(_small(qkv_bias=True)) == 1160 + 2 * bias


def test_mha_when_groups_equal_heads() -> None:
    """Without GQA (groups == heads) the QKV projection is the full 3*h*h."""
    m = _small(num_query_groups=4)
    assert layer_param_count(m) == 3 * 8 * 8 + 64 + 288 + 16


@pytest.mark.parametrize(
    ("vocab", "mult", "expected"),
    [
        (10, 1, 10),
        (10, 4, 12),
        (10, 3, 12),
        (12, 4, 12),  # already a multiple: no padding
        (128256, 128, 128256),
        (151936, 128, 151936),
        (32001, 128, 32128),
    ],
)
def test_padded_vocab_size(vocab: int, mult: int, expected: int) -> None:
    """Vocab rows are padded up to the configured multiple, independent of TP."""
    m = _small(vocab_size=vocab, make_vocab_size_divisible_by=mult)
    assert padded_vocab_size(m) == expected


def test_param_count_includes_vocab_padding() -> None:
    """Padding rows are real parameters in both the embedding and the output layer."""
    m = _small(make_vocab_size_divisible_by=4)
    assert param_count(m, padded=True) == 12 * 8 + 12 * 8 + 2 * LAYER + FINAL_NORM
    assert param_count(m, padded=True) - param_count(m) == 2 * 2 * 8
    tied = _small(make_vocab_size_divisible_by=4, tie_embeddings=True)
    assert param_count(tied, padded=True) - param_count(tied) == 2 * 8
