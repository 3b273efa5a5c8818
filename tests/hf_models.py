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


def make_model(kind: str, path: Path, dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    """kind: llama (GQA, untied), llama_tied (tied, Llama 3 RoPE scaling), qwen2 (QKV bias),
    llama_mha (4 KV heads, so Megatron TP=4 can hold whole query groups)."""
    import transformers

    torch.manual_seed(seed)
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
