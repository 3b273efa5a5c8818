"""tools/make_tiny_vision.py: a tiny Qwen2.5-VL that transformers loads and runs on a
56x56 image (4 image tokens), a byte-level tokenizer that round-trips text with its special
tokens at fixed ids, and a seeded, balanced counting dataset whose answers its pictures
hold, eval's pictures apart from train's."""

from __future__ import annotations

import ast
import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "make_tiny_vision.py"
IDS = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258, "<|vision_start|>": 259,
       "<|vision_end|>": 260, "<|image_pad|>": 261, "<|video_pad|>": 262}  # fmt: skip
PARTS = [{"type": "image"}, {"type": "text", "text": "How many red squares?"}]
QUESTION = [{"role": "user", "content": PARTS}]  # rl/tasks/vision.py's layout: images first
RENDERED = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many red "
            "squares?<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip


def _load():
    spec = importlib.util.spec_from_file_location("make_tiny_vision", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def maker():
    return _load()


# Per family: the HF class, and a patch's values (3 channels x 2 frames x patch^2).
FAMILIES = {"qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", 1176),
            "qwen3_vl": ("Qwen3VLForConditionalGeneration", 1536)}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model_dir(maker, family, tmp_path_factory) -> Path:
    return maker.make_model(tmp_path_factory.mktemp("tiny_vl") / "model", 0, family)


def test_the_module_imports_nothing_heavy():
    # The CLI's --help and the dataset alone must not wait for torch.
    heavy = {"torch", "transformers", "tokenizers", "PIL", "numpy"}
    tree = ast.parse(TOOL.read_text())
    top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    names = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names}
    names |= {n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom) and n.module}
    assert not names & heavy


def test_the_tokenizer_round_trips_text_and_keeps_its_special_ids(model_dir):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == 263 and {t: tok.convert_tokens_to_ids(t) for t in IDS} == IDS
    assert (tok.eos_token_id, tok.pad_token_id) == (258, 256)
    assert tok.encode("A\n", add_special_tokens=False) == [65, 10]  # a byte is its own id
    assert tok.encode("a<|image_pad|>b<|im_end|>", add_special_tokens=False) == [97, 261, 98, 258]
    for text in ("hello world", "  two  spaces , and a comma .\n\ttab", "héllo ✓ 日本 🙂",
                 "can't <|im_start|>user\nx<|im_end|>", "", "\x00\x7f"):  # fmt: skip
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.decode([97, 258], skip_special_tokens=True) == "a"
    assert tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False) == RENDERED
    chat = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert tok.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
    )


def test_the_processor_and_model_take_a_56x56_image(model_dir, family):
    import torch
    import transformers
    from PIL import Image

    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    text = processor.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    assert text == RENDERED
    image = Image.new("RGB", (56, 56), (255, 255, 255))
    batch = processor(text=[text], images=[image], return_tensors="pt")
    ids = batch["input_ids"][0].tolist()
    assert ids.count(261) == 4 and ids.count(259) == ids.count(260) == 1
    assert len(ids) == len(processor.tokenizer.encode(text)) + 3  # one pad became four
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4]]
    hf_class, patch_values = FAMILIES[family]
    assert list(batch["pixel_values"].shape) == [16, patch_values]
    # rl/models/vision/images.py reads the image processor alone.
    alone = transformers.AutoImageProcessor.from_pretrained(model_dir)
    assert alone(images=[image], return_tensors="pt")["image_grid_thw"].tolist() == [[1, 4, 4]]

    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir).eval()
    assert type(model).__name__ == hf_class
    assert model.dtype == torch.float32
    conf = model.config
    assert conf.text_config.vocab_size == 272 and not conf.tie_word_embeddings
    assert (conf.image_token_id, conf.video_token_id) == (261, 262)
    assert (conf.vision_start_token_id, conf.vision_end_token_id) == (259, 260)
    assert conf.text_config.max_position_embeddings == 512
    assert model.generation_config.eos_token_id == 258
    with torch.no_grad():
        logits = model(**batch).logits  # mm_token_type_ids included: 3-D positions
    assert list(logits.shape) == [1, len(ids), 272] and torch.isfinite(logits).all()
    saved = json.loads((model_dir / "generation_config.json").read_text())
    assert saved["eos_token_id"] == 258


def test_the_model_is_seeded(maker, model_dir, family, tmp_path):
    weights = (model_dir / "model.safetensors").read_bytes()
    again = maker.make_model(tmp_path / "again", 0, family)
    assert (again / "model.safetensors").read_bytes() == weights
    other = maker.make_model(tmp_path / "other", 1, family)
    assert (other / "model.safetensors").read_bytes() != weights


def _files(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_the_dataset_is_seeded_balanced_and_true_to_its_pictures(maker, tmp_path):
    import numpy as np
    from PIL import Image

    out = maker.make_dataset(tmp_path / "a", train=50, eval=25, seed=3)
    assert _files(out) == _files(maker.make_dataset(tmp_path / "b", train=50, eval=25, seed=3))
    assert _files(out) != _files(maker.make_dataset(tmp_path / "c", train=50, eval=25, seed=4))
    splits = {s: [json.loads(x) for x in (out / f"{s}.jsonl").open()] for s in ("train", "eval")}
    assert [len(splits["train"]), len(splits["eval"])] == [50, 25]
    pixels: dict[str, set[bytes]] = {}
    for split, rows in splits.items():
        assert Counter(r["answer"] for r in rows) == {str(c): len(rows) // 5 for c in range(5)}
        assert {r["color"] for r in rows} == {"red", "blue"}
        for i, r in enumerate(rows):
            assert r["images"] == [f"images/{split}_{i:06d}.png"]  # relative to the JSONL
            assert r["question"] == f"How many {r['color']} squares?"
            image = Image.open(out / r["images"][0])
            assert (image.mode, image.size) == ("RGB", (56, 56))
            a = np.asarray(image)
            pixels.setdefault(split, set()).add(a.tobytes())
            color = {"red": (255, 0, 0), "blue": (0, 0, 255)}[r["color"]]
            cells = [a[y : y + 28, x : x + 28] for y in (0, 28) for x in (0, 28)]
            assert sum(bool((c == color).all(-1).any()) for c in cells) == int(r["answer"])
            inset = maker.INSET
            for c in cells:  # a square never touches its cell's edge
                assert (c[:inset] == 255).all() and (c[-inset:] == 255).all()
                assert (c[:, :inset] == 255).all() and (c[:, -inset:] == 255).all()
    assert not pixels["train"] & pixels["eval"]


def test_the_cli_writes_what_it_is_given(maker, tmp_path, capsys):
    assert maker.main(["--data-out", str(tmp_path / "d"), "--train", "5", "--eval", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and all(line.startswith("wrote ") for line in lines)
    assert (tmp_path / "d" / "eval.jsonl").is_file() and not (tmp_path / "m").exists()
    with pytest.raises(SystemExit):
        maker.main([])
