#!/usr/bin/env python
"""Write a tiny random Qwen2.5-VL (or Qwen3-VL) and a synthetic visual counting task (no
downloads).

    python tools/make_tiny_vision.py [--model-out DIR] [--data-out DIR] [--train N]
        [--eval N] [--seed S] [--family qwen2_5_vl|qwen3_vl]

Either part may be left out. The same flags give byte-identical files.

``--model-out DIR``: a ``Qwen2_5_VLForConditionalGeneration`` (``--family qwen3_vl``: a
``Qwen3VLForConditionalGeneration``) in fp32, the family's tiny shape
(rl/models/families/<family>.py) over a vocabulary of :data:`VOCAB` ids, with its
processor, so ``AutoProcessor``/``AutoModelForImageTextToText`` load it and SGLang serves it:

- a byte-level BPE tokenizer without merges: byte ``b`` is id ``b`` (so any UTF-8 text
  round-trips), then ChatML's and the vision special tokens at the fixed ids of
  :data:`SPECIAL` (256..262), never split;
- a short ChatML chat template (:data:`CHAT_TEMPLATE`) whose image parts render as
  ``<|vision_start|><|image_pad|><|vision_end|>``, on the tokenizer and the processor;
- an image processor that keeps a 56x56 image at 56x56 (Qwen3-VL's resizes it to 64x64):
  16 patches, 4 image tokens;
- ``generation_config.json`` ending generation at ``<|im_end|>``.

``--data-out DIR``: ``DIR/train.jsonl`` and ``DIR/eval.jsonl``, rows such as::

    {"question": "How many red squares?", "answer": "2",
     "images": ["images/train_000017.png"], "color": "red"}

Each image (``DIR/images/<split>_<index>.png``, paths relative to the JSONL's directory) is
56x56: a 2x2 grid of 28x28 cells, one cell per merged image token, each empty or holding a
red or a blue square of varied size and place. Each answer 0..4 is as common as the others
in both splits, and no image of eval is also one of train.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: the repo, for the family's tiny shape

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
           "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")  # fmt: skip
IDS = {token: 256 + i for i, token in enumerate(SPECIAL)}
# The 263 tokens with a few spare rows, as real checkpoints have: a multiple of 16.
VOCAB = 272
# No default system prompt: on CPU every prompt token costs time. The ``image`` and ``video``
# parts are the ones SGLang's chat API turns its ``image_url``/``video_url`` parts into.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# Per family: its processor and video processor classes (the tiny shape is the family's
# own, rl/models/families/<family>.py). Qwen3-VL's 16-pixel patches resize a 56x56 picture
# to 64x64: still 2x2 merged tokens, one per cell.
PROCESSORS = {
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", "Qwen2VLVideoProcessor"),
    "qwen3_vl": ("Qwen3VLProcessor", "Qwen3VLVideoProcessor"),
}
MERGE = 2
# An image of 4 to 16 merged tokens passes unresized, 56x56 (28-pixel tokens) the smallest.
# The lower bound is Qwen's (and SGLang's) own minimum; the upper keeps an odd large image
# cheap on CPU.
MIN_PIXELS, MAX_PIXELS = 4 * (14 * MERGE) ** 2, 16 * (16 * MERGE) ** 2

SIZE, CELL = 56, 28  # the image, and its 2x2 cells: one per merged image token
INSET, MIN_SIDE, MAX_SIDE = 2, 18, 24  # a square stays INSET pixels inside its cell
COLORS = {"red": (255, 0, 0), "blue": (0, 0, 255)}
# Per cell: None (empty) or (colour, x, y, side) within the cell; it fixes the image.
Layout = tuple[tuple[str, int, int, int] | None, ...]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level symbols: printable bytes stand for themselves, the rest are moved
    past 255, so every byte has a visible, non-whitespace character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    moved = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


def make_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer: ids 0..255 are bytes, :data:`IDS` the special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = bytes_to_unicode()
    assert set(symbols.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbols[b]: b for b in range(256)} | IDS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # Without merges, splitting words first (the regex) would change nothing.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # Already in the vocabulary, so they keep their ids; added as special so text around
    # them is never merged into them and ``skip_special_tokens`` drops them.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=512,
        # transformers' clean-up would eat the space in " ," and break the round trip.
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_model(out: Path, seed: int = 0, family: str = "qwen2_5_vl") -> Path:
    """The family's tiny random model (Qwen2.5-VL or Qwen3-VL), its processor and
    generation config, saved in ``out``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it
    import importlib

    import torch
    import transformers

    arch = importlib.import_module(f"rl.models.families.{family}").ARCH

    tok = make_tokenizer()
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL}
    if ids != IDS or len(tok) != len(SPECIAL) + 256:
        raise RuntimeError(f"the tokenizer moved its special tokens: {ids}")
    eos, pad = tok.eos_token_id, tok.pad_token_id
    bos = pad  # Qwen's tokenizers have no BOS; its configs name <|endoftext|>
    tiny = json.loads(json.dumps(arch.tiny[arch.model_type]))  # a deep copy to edit
    ends = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}
    tiny["text_config"] |= {"vocab_size": VOCAB, "max_position_embeddings": 512,
                            "tie_word_embeddings": False, **ends}  # fmt: skip
    tiny |= {"tie_word_embeddings": False,
             "image_token_id": IDS["<|image_pad|>"], "video_token_id": IDS["<|video_pad|>"],
             "vision_start_token_id": IDS["<|vision_start|>"],
             "vision_end_token_id": IDS["<|vision_end|>"]}  # fmt: skip
    vision = tiny["vision_config"]
    patch = vision["patch_size"]
    assert vision["spatial_merge_size"] == MERGE
    torch.manual_seed(seed)
    conf = transformers.AutoConfig.for_model(arch.model_type, **tiny)
    model = getattr(transformers, arch.hf_class)(conf).to(torch.float32).eval()
    # One end: a chat turn's. Without this the file would come from the model config.
    model.generation_config = transformers.GenerationConfig(**ends)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    image = transformers.Qwen2VLImageProcessor(
        patch_size=patch, merge_size=MERGE, temporal_patch_size=vision["temporal_patch_size"],
        # transformers 5 keeps the pixel bounds in ``size`` (min_pixels/max_pixels map to it).
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )  # fmt: skip
    processor_class, video_class = PROCESSORS[family]
    processor = getattr(transformers, processor_class)(
        image_processor=image,
        video_processor=getattr(transformers, video_class)(patch_size=patch, merge_size=MERGE),
        tokenizer=tok,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(out)  # the tokenizer's files and chat_template.jinja too
    return out


def _draw_layout(rng: random.Random, count: int) -> tuple[str, Layout]:
    """(the colour asked for, an image with ``count`` squares of it): the other cells are
    empty or hold a square of the other colour."""
    color = rng.choice(sorted(COLORS))
    other = next(c for c in sorted(COLORS) if c != color)
    asked = set(rng.sample(range(4), count))
    cells: list[tuple[str, int, int, int] | None] = []
    for i in range(4):
        fill = color if i in asked else rng.choice((None, other))
        if fill is None:
            cells.append(None)
            continue
        side = rng.randint(MIN_SIDE, MAX_SIDE)
        x, y = (rng.randint(INSET, CELL - INSET - side) for _ in range(2))
        cells.append((fill, x, y, side))
    return color, tuple(cells)


def _save_png(layout: Layout, path: Path) -> None:
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for i, cell in enumerate(layout):
        if cell is not None:
            color, x, y, side = cell
            left, top = (i % 2) * CELL + x, (i // 2) * CELL + y
            draw.rectangle((left, top, left + side - 1, top + side - 1), fill=COLORS[color])
    image.save(path, format="PNG")  # no metadata: the bytes depend on the pixels only


def make_dataset(out: Path, train: int, eval: int, seed: int) -> Path:
    """``out/train.jsonl``, ``out/eval.jsonl`` and their PNGs under ``out/images``."""
    if train < 0 or eval < 0:
        raise ValueError("train and eval must be >= 0")
    (out / "images").mkdir(parents=True, exist_ok=True)
    seen: set[Layout] = set()
    for split, n in (("train", train), ("eval", eval)):
        # A stream per split: eval's rows do not shift when train's count changes.
        rng = random.Random(f"tiny-vision:{seed}:{split}")
        # Every answer 0..4 equally often (to one row), in a random order: a policy that
        # always guesses one number scores 20%.
        counts = [i % 5 for i in range(n)]
        rng.shuffle(counts)
        rows = []
        for i, count in enumerate(counts):
            color, layout = _draw_layout(rng, count)
            # An eval image must not be one of train's (the blank one is the likely clash).
            while split == "eval" and layout in seen:
                color, layout = _draw_layout(rng, count)
            if split == "train":
                seen.add(layout)
            name = f"images/{split}_{i:06d}.png"
            _save_png(layout, out / name)
            rows.append({"question": f"How many {color} squares?", "answer": str(count),
                         "images": [name], "color": color})  # fmt: skip
        # Written after its images, through a rename: a JSONL file means a complete split.
        tmp = out / f"{split}.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        os.replace(tmp, out / f"{split}.jsonl")
    return out


def _size(path: Path) -> str:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    n = sum(p.stat().st_size for p in files)
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-out", type=Path, help="the model's directory (created)")
    ap.add_argument("--data-out", type=Path, help="the dataset's directory (created)")
    ap.add_argument("--train", type=int, default=4096, help="train rows (default 4096)")
    ap.add_argument("--eval", type=int, default=256, help="eval rows (default 256)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--family", choices=sorted(PROCESSORS), default="qwen2_5_vl",
                    help="the model's family (default qwen2_5_vl)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.model_out is None and args.data_out is None:
        ap.error("nothing to write: give --model-out, --data-out or both")
    if args.model_out is not None:
        out = make_model(args.model_out, args.seed, args.family)
        print(f"wrote {out}: tiny {args.family}, vocabulary {VOCAB} ({_size(out)})")
    if args.data_out is not None:
        out = make_dataset(args.data_out, args.train, args.eval, args.seed)
        for split, n in (("train", args.train), ("eval", args.eval)):
            print(f"wrote {out / split}.jsonl: {n} rows ({_size(out / f'{split}.jsonl')})")
        print(f"wrote {out / 'images'}: {args.train + args.eval} PNGs ({_size(out / 'images')})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
