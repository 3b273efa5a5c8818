#!/usr/bin/env python
"""Write the tool-use example's data and tokenizer (no downloads): questions a tiny model
can only answer by calling the calculator.

    python tools/make_tool_task.py --out DIR [--train N] [--eval N] [--seed S]

Writes, byte-identical for the same flags:

- ``DIR/tokenizer/``: a byte-level BPE tokenizer with ChatML's special tokens, every digit
  its own token and the repeated text merged (a prompt is ~36 tokens, an episode ~33
  more), and the shipped ``chatml_tools`` template (the tools are written into the
  system turn, a call is ``<tool_call>{json}</tool_call>``, a result comes back as
  ``<tool_response>``); at most :data:`VOCAB` ids, so ``model.vocab_size`` can be fixed;
- ``DIR/train.jsonl``: one row per question, with its demonstration for the warm-up::

      {"prompt": "What is 347 * 29 + 518?", "label": "10581",
       "demo": [{"role": "assistant", "content": "<tool_call>{...347 * 29 + 518...}</tool_call>"},
                {"role": "tool", "name": "calculator", "content": "10581"},
                {"role": "assistant", "content": "10581"}]}

- ``DIR/eval.jsonl``: held-out questions (no expression of train), without demonstrations.

Three operands, a product among them, are beyond a ~2M-parameter model's arithmetic, so
its accuracy is its tool use: copy the expression into the call, then the calculator's
result into the answer.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl.envs.chat import template_text  # noqa: E402
from rl.envs.tools import calculate, load_tool  # noqa: E402

VOCAB = 640  # the tokenizer's most ids (conf/experiment/tiny_tools.yaml: model.vocab_size)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def problems(seed: int, train: int, evals: int) -> tuple[list[str], list[str]]:
    """Disjoint expressions ``a * b + c`` or ``a * b - c``: ``a`` and ``c`` of 3 digits,
    ``b`` of 2 (the result is always positive)."""
    rng = random.Random(seed)
    exprs: set[str] = set()
    while len(exprs) < train + evals:
        a, b, c = rng.randint(100, 999), rng.randint(10, 99), rng.randint(100, 999)
        exprs.add(f"{a} * {b} {rng.choice('+-')} {c}")
    ordered = sorted(exprs)
    rng.shuffle(ordered)
    return ordered[:train], ordered[train:]


def call(expression: str) -> str:
    args = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>{json.dumps(args)}</tool_call>"


def row(expr: str, demo: bool) -> dict:
    answer = calculate(expr)
    out: dict = {"prompt": f"What is {expr}?", "label": answer}
    if demo:
        out["demo"] = [
            {"role": "assistant", "content": call(expr)},
            {"role": "tool", "name": "calculator", "content": answer},
            {"role": "assistant", "content": answer},
        ]
    return out


def score(prompt: str, response: str, label: object, metadata: dict) -> dict[str, float]:
    """The example's reward (``reward.fn=tools/make_tool_task.py:score``): 1 for the right
    final answer; ``right_call`` (logged, not rewarded): the calculator was called with the
    question's own expression, read from the conversation."""
    asked = prompt.rpartition("What is ")[2].partition("?")[0]
    calls = [m["content"] for m in metadata.get("messages", []) if m["role"] == "assistant"]
    wanted = json.dumps({"expression": asked})
    right = bool(calls) and wanted in calls[0]
    return {"score": float(response.strip() == str(label)), "right_call": float(right)}


def tokenizer(corpus: list[str]):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits alone, and no split at spaces: the text every episode repeats (the tools in
    # the system turn, a call's JSON around its expression) merges into a few tokens.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = template_text("chatml_tools")
    return fast


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--train", type=int, default=20000)
    ap.add_argument("--eval", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    train, evals = problems(args.seed, args.train, args.eval)
    rows = [row(e, demo=True) for e in train]
    schema = [load_tool("calculator").schema()]
    probe = tokenizer(["x"])  # renders the texts the real tokenizer is trained on
    corpus = [
        probe.apply_chat_template([{"role": "user", "content": r["prompt"]}, *r["demo"]],
                                  tools=schema, tokenize=False)
        for r in rows[:500]
    ]  # fmt: skip
    tok = tokenizer(corpus)
    if len(tok) > VOCAB:
        raise SystemExit(f"the tokenizer has {len(tok)} ids, more than {VOCAB}")
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(args.out / "tokenizer")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    (args.out / "tokenizer" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": end}) + "\n"
    )
    for name, data in (("train", rows), ("eval", [row(e, demo=False) for e in evals])):
        with open(args.out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in data)
    print(f"{len(rows)} training and {len(evals)} held-out questions, a tokenizer of "
          f"{len(tok)} ids, in {args.out}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
