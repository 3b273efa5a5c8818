"""The pure HF <-> Megatron layout map, checked against hand-built tensors and transformers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl.config.schema import ModelConfig
from rl.weights import keymap as km


def _dims(**kw: object) -> km.Dims:
    base = {
        "layers": 2,
        "hidden": 1,
        "ffn": 4,
        "heads": 4,
        "groups": 2,
        "head_dim": 1,
        "vocab": 5,
        "padded_vocab": 8,
        "tied": False,
        "qkv_bias": False,
    }
    return km.Dims(**{**base, **kw})


def test_fuse_qkv_groups_queries_with_their_kv_head():
    """[q heads of group g | k_g | v_g] for each group: the layout Megatron TP splits."""
    d = _dims()
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    fused = km.fuse_qkv(q, k, v, d)
    assert fused.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    back = km.split_qkv(fused, d)
    for got, want in zip(back, (q, k, v), strict=True):
        assert torch.equal(got, want)
    # Biases (1-D) follow the same grouping.
    fused_b = km.fuse_qkv(q.flatten(), k.flatten(), v.flatten(), d)
    assert fused_b.tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


def test_fc1_tp_shards_are_gate_up_pairs_not_plain_chunks():
    gate, up = torch.arange(4.0).view(4, 1), torch.arange(10.0, 14.0).view(4, 1)
    fc1 = km.to_megatron(km.FC1, [gate, up], _dims())
    shards = [km.tp_shard(km.FC1, fc1, 2, r) for r in range(2)]
    assert shards[0].flatten().tolist() == [0, 1, 10, 11]
    assert shards[1].flatten().tolist() == [2, 3, 12, 13]
    assert not torch.equal(torch.cat(shards), fc1)  # naive concatenation is wrong...
    assert torch.equal(km.tp_unshard(km.FC1, shards), fc1)  # ...unshard is right


@pytest.mark.parametrize("key", [km.QKV_W, km.PROJ, km.FC2, km.EMBED, km.IN_NORM])
def test_tp_shard_unshard_round_trip(key: str):
    t = torch.randn(8, 6)
    shards = [km.tp_shard(key, t, 2, r) for r in range(2)]
    assert torch.equal(km.tp_unshard(key, shards), t)
    dim = km.tp_dim(key)
    if dim is None:
        assert all(torch.equal(s, t) for s in shards)
    else:
        assert shards[0].shape[dim] == t.shape[dim] // 2


def test_qkv_tp_shard_holds_whole_query_groups():
    d = _dims(heads=4, groups=2, head_dim=2, hidden=3)
    q, k, v = torch.randn(8, 3), torch.randn(4, 3), torch.randn(4, 3)
    fused = km.fuse_qkv(q, k, v, d)
    rank1 = km.tp_shard(km.QKV_W, fused, 2, 1)
    # group 1: q heads 2,3 (rows 4..7), k head 1 (rows 2..3), v head 1 (rows 2..3)
    assert torch.equal(rank1, torch.cat([q[4:8], k[2:4], v[2:4]]))


def test_vocab_padding_added_and_stripped():
    d = _dims(vocab=5, padded_vocab=8, hidden=2)
    emb = torch.randn(5, 2)
    padded = km.to_megatron(km.EMBED, [emb], d)
    assert padded.shape == (8, 2)
    assert torch.equal(padded[:5], emb) and not padded[5:].any()
    assert torch.equal(km.to_hf(km.EMBED, padded, d)[0], emb)


def test_keys_follow_bias_and_tying():
    assert km.QKV_B not in km.layer_keys(_dims())
    assert km.QKV_B in km.layer_keys(_dims(qkv_bias=True))
    assert km.OUTPUT in km.global_keys(_dims())
    assert km.OUTPUT not in km.global_keys(_dims(tied=True))
    assert km.hf_names(km.FC1, _dims(), 3) == (
        "model.layers.3.mlp.gate_proj.weight",
        "model.layers.3.mlp.up_proj.weight",
    )
    with pytest.raises(ValueError, match="per-layer"):
        km.hf_names(km.FC1, _dims())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [False, True])
def test_hf_shapes_match_transformers_state_dict(arch: str, tied: bool):
    """Names and shapes equal those of a real transformers model of the same config."""
    import transformers

    kw = {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 37,
        "tie_word_embeddings": tied,
    }
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM
    conf = transformers.LlamaConfig(**kw) if arch == "llama" else transformers.Qwen2Config(**kw)
    model = cls(conf)
    m = ModelConfig(
        name="t",
        num_layers=2,
        hidden_size=32,
        ffn_hidden_size=48,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=37,
        max_position_embeddings=64,
        qkv_bias=arch == "qwen2",
        tie_embeddings=tied,
    )
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if tied:
        want.pop("lm_head.weight")  # the tied alias is not stored in safetensors
    assert km.hf_shapes(km.Dims.of(m)) == want
    d = km.Dims.of(dataclasses.replace(m, make_vocab_size_divisible_by=16))
    assert km.megatron_shape(km.EMBED, d) == (48, 32)
    assert km.megatron_shape(km.QKV_W, d) == ((4 + 2 * 2) * 8, 32)
