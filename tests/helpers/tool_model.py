"""Tiny chat models made here in seconds (no download): a byte-level BPE tokenizer with
ChatML's special tokens and the shipped ``chatml_tools`` template, and a 2-layer Llama
trained until greedy decoding plays given conversations exactly.

The tool model plays one conversation per question of :data:`QUESTIONS`: the assistant
calls the calculator, reads its result and answers with it, so tests against a real SGLang
server see real tool calls, observations and answers. A judge model (tests/servers/
test_judge.py) answers fixed grading prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rl.envs.chat import template_text
from rl.envs.tools import calculate, load_tool

QUESTIONS = {  # question -> the expression the model passes to the calculator
    "What is 12 * 7?": "12 * 7",
    "What is 345 + 678?": "345 + 678",
    "What is 99 - 123?": "99 - 123",
    "What is 2 ** 10?": "2 ** 10",
    "What is 81 // 4?": "81 // 4",
    "What is 7 * 8 * 9?": "7 * 8 * 9",
}
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CALC = load_tool("calculator")


def call_text(expression: str) -> str:
    args = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>{args}</tool_call>"


def conversation(question: str) -> list[dict]:
    """The episode the model is trained to play for ``question``."""
    expr = QUESTIONS[question]
    result = calculate(expr)
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": call_text(expr)},
        {"role": "tool", "name": "calculator", "content": result},
        {"role": "assistant", "content": result},
    ]


def chatml_tokenizer(corpus: list[str]):
    """A ChatML BPE tokenizer trained on ``corpus`` (milliseconds), with the tools template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = template_text("chatml_tools")
    return fast


def make_tool_model(path: Path, steps: int = 400, seed: int = 0) -> Path:
    """The tool-calling model: every question of :data:`QUESTIONS` played greedily."""
    return train_chat_model(path, [conversation(q) for q in QUESTIONS], [CALC.schema()],
                            steps, seed)  # fmt: skip


def train_chat_model(
    path: Path, conversations: list[list[dict]], tools: list[dict] | None = None,
    steps: int = 400, seed: int = 0,
) -> Path:  # fmt: skip
    """A tokenizer and a 2-layer Llama trained on ``conversations`` (rendered by the
    template, with ``tools``), saved in ``path``; raises unless greedy decoding gives
    every assistant turn from the conversation before it (checked with transformers)."""
    import transformers

    torch.manual_seed(seed)
    probe = chatml_tokenizer(["x"])  # renders the corpus the real tokenizer is trained on
    texts = [probe.apply_chat_template(c, tools=tools, tokenize=False) for c in conversations]
    tok = chatml_tokenizer(texts * 4)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    conf = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=end, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(conf)
    rows = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = True
    labels = ids.masked_fill(~mask, -100)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        loss = model(input_ids=ids, attention_mask=mask.long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    for conv in conversations:
        _check_plays(model, tok, end, conv, tools)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": end}))
    return path


def _check_plays(model, tok, end: int, conv: list[dict], tools: list[dict] | None) -> None:
    for turn, m in enumerate(conv):
        if m["role"] != "assistant":
            continue
        prompt = tok.apply_chat_template(
            conv[:turn], tools=tools, add_generation_prompt=True, tokenize=False
        )
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=48, do_sample=False, eos_token_id=end,
                                 pad_token_id=tok.pad_token_id)  # fmt: skip
        got = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=False)
        if got != m["content"] + "<|im_end|>":
            raise AssertionError(f"the model did not learn turn {turn} of {conv[0]}: {got!r}")
