"""Tiny random Hugging Face models and a tokenizer, made locally for conversion tests."""

from __future__ import annotations

from pathlib import Path

import torch

from rl.models import registry
from rl.models.arch import TINY_MOE, Arch

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
LLAMA3_ROPE = registry.get("LlamaForCausalLM").tiny["llama_tied"]["rope_parameters"]


MOE_SHAPES = TINY_MOE  # shared by the MoE kinds


def tiny_models(vision: bool = False) -> dict[str, Arch]:
    """Every tiny test model, by kind, with its family: each family module declares its
    own (``Arch.tiny``), so a new family brings its test models with it. ``vision``: the
    vision-language families' instead (tests/helpers/vision_models.py makes them)."""
    archs = registry.architectures().values()
    return {kind: a for a in archs if (a.vision is not None) == vision for kind in a.tiny}


KINDS = tuple(tiny_models())


def make_model(
    kind: str,
    path: Path,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    score: bool = False,
    extra: dict[str, object] | None = None,
    bias_std: float = 1.0,
) -> Path:
    """The tiny random model ``kind`` (a family's ``Arch.tiny``: the shared tiny shape, the
    MoE shape for an MoE family, then the kind's own fields), saved in ``path``; with
    ``score``, the family's ``*ForSequenceClassification`` of one label (a reward model);
    ``extra``: HF config fields over all of those; ``bias_std``: the biases' spread.

    Expert weights are random (transformers 5 initialises its stacked expert parameters with
    normal(0, initializer_range)); norms and biases get the random perturbation below."""
    import transformers

    arch = tiny_models()[kind]
    torch.manual_seed(seed)
    fields = {**SHAPES, **(MOE_SHAPES if arch.moe else {}), **arch.tiny[kind]}
    if score:
        fields.update(num_labels=1, pad_token_id=0)
    fields.update(extra or {})
    conf = transformers.AutoConfig.for_model(arch.model_type, **fields)
    model = getattr(transformers, arch.score_class if score else arch.hf_class)(conf)
    with torch.no_grad():  # random, non-trivial norms and biases (defaults are 1 and 0)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name
                        else bias_std * torch.randn_like(p))  # fmt: skip
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


def hf_logits(path: Path, tokens: torch.Tensor, adapter: Path | None = None) -> torch.Tensor:
    """transformers' logits of the model at ``path``; with ``adapter``, of that PEFT
    adapter directory on it (peft's own LoRA layers, not merged)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        return model(tokens).logits
