"""Tiny random Hugging Face models and a tokenizer, made locally for conversion tests."""

from __future__ import annotations

from pathlib import Path

import torch

SHAPES = {
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 99,
    "max_position_embeddings": 128,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


# head_dim of the kinds that set it explicitly, != hidden_size / num_attention_heads (= 16).
WIDE_HEAD_DIM = 32
# Shared by the MoE kinds (qwen3_moe, qwen2_moe); fewer layers keep them fast, PP=2 still fits.
MOE_SHAPES = {
    "num_hidden_layers": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}
KINDS = (
    "llama",
    "llama_tied",
    "llama_mha",
    "qwen2",
    "qwen3",
    "qwen3_kv1",
    "mistral",
    "qwen3_moe",
    "qwen2_moe",
)


def make_model(kind: str, path: Path, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """kind: llama (GQA, untied), llama_tied (tied, Llama 3 RoPE scaling), qwen2 (QKV bias),
    llama_mha (4 KV heads, so Megatron TP=4 can hold whole query groups),
    qwen3 (QK-norm, head_dim 32 != hidden/heads, 2 KV heads, untied),
    qwen3_kv1 (as qwen3 with 1 KV head and tied embeddings),
    mistral (explicit head_dim 32, 2 KV heads, no sliding window, untied),
    qwen3_moe (2 layers, 4 experts top-2, moe_intermediate 32, normalised top-k, untied),
    qwen2_moe (2 layers, 4 experts top-2, moe_intermediate 32, shared expert 48 with its
    sigmoid gate, QKV bias, top-k not normalised, untied).

    Expert weights are random (transformers 5 initialises its stacked expert parameters with
    normal(0, initializer_range)); norms and biases get the random perturbation below."""
    import transformers

    torch.manual_seed(seed)
    wide = {"head_dim": WIDE_HEAD_DIM}
    if kind == "llama":
        conf = transformers.LlamaConfig(**SHAPES, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(conf)
    elif kind == "llama_tied":
        conf = transformers.LlamaConfig(
            **SHAPES, tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE)
        )
        model = transformers.LlamaForCausalLM(conf)
    elif kind == "llama_mha":
        conf = transformers.LlamaConfig(**{**SHAPES, "num_key_value_heads": 4})
        model = transformers.LlamaForCausalLM(conf)
    elif kind == "qwen2":
        conf = transformers.Qwen2Config(**SHAPES, tie_word_embeddings=False)
        model = transformers.Qwen2ForCausalLM(conf)
    elif kind == "qwen3":
        conf = transformers.Qwen3Config(**SHAPES, **wide, tie_word_embeddings=False)
        model = transformers.Qwen3ForCausalLM(conf)
    elif kind == "qwen3_kv1":
        shapes = {**SHAPES, "num_key_value_heads": 1}
        conf = transformers.Qwen3Config(**shapes, **wide, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(conf)
    elif kind == "mistral":
        conf = transformers.MistralConfig(
            **SHAPES, **wide, sliding_window=None, tie_word_embeddings=False
        )
        model = transformers.MistralForCausalLM(conf)
    elif kind == "qwen3_moe":
        conf = transformers.Qwen3MoeConfig(
            **{**SHAPES, **MOE_SHAPES}, norm_topk_prob=True, tie_word_embeddings=False
        )
        model = transformers.Qwen3MoeForCausalLM(conf)
    elif kind == "qwen2_moe":
        conf = transformers.Qwen2MoeConfig(
            **{**SHAPES, **MOE_SHAPES},
            shared_expert_intermediate_size=48,
            norm_topk_prob=False,
            tie_word_embeddings=False,
        )
        model = transformers.Qwen2MoeForCausalLM(conf)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # random, non-trivial norms and biases (defaults are 1 and 0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p))
    model = model.to(dtype).eval()
    model.save_pretrained(path)
    return path


def make_tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(SHAPES["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", eos_token="w2")
    fast.save_pretrained(path)
    return path


def hf_logits(path: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits
