"""A vision-language policy's data path, before any rank starts: prompt files with images
become prompts whose image tokens are expanded exactly as the checkpoint's processor
expands them, bad rows are skipped and counted by reason, and the trainer's batch gets the
patches, grids and 3-D positions of its rows' images (a sampled vision token refused).
The server's side of it runs in tests/servers/test_vision_job.py."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

from rl.config.sampling import BANNED, RequestError, SamplingParams
from rl.generator.types import ModelLimits
from rl.models.vision.images import ImageError, Images, data_uri, open_image, reference
from rl.models.vision.inputs import with_images
from rl.models.vision.positions import mrope_positions
from rl.models.vision.tokens import expand_pads, special_ids
from rl.tasks import TaskError
from rl.tasks.common import TaskContext, sft_batch
from rl.tasks.kinds.dataset import DatasetTaskConfig, build
from rl.weights.hf_model import hf_model_config

PNG = b"\x89PNG\r\n\x1a\n"


def _png(path: Path, size: int, color: str = "red") -> Path:
    from PIL import Image

    Image.new("RGB", (size, size), color).save(path)
    return path


def test_an_image_cell_becomes_a_reference_or_one_line(tmp_path) -> None:
    img = _png(tmp_path / "a.png", 56)
    assert reference("a.png", tmp_path) == str(img.resolve())
    assert reference(f"file://{img}", Path("/")) == str(img.resolve())
    raw = img.read_bytes()
    uri = reference(raw, tmp_path)
    assert uri.startswith("data:image/png;base64,") and base64.b64decode(uri.split(",")[1]) == raw
    assert reference({"bytes": raw, "path": None}, tmp_path) == uri  # HF datasets' Image
    assert reference(uri, tmp_path) == uri and data_uri(str(img)) == uri
    assert open_image(uri).size == (56, 56)
    with pytest.raises(ImageError, match="does not exist"):
        reference("gone.png", tmp_path)
    with pytest.raises(ImageError, match="a path, a data URI or bytes"):
        reference(3, tmp_path)
    with pytest.raises(ImageError, match="not a readable image"):
        open_image(reference(PNG + b"garbage", tmp_path))


def test_expanded_pads_and_the_banned_tokens() -> None:
    assert expand_pads([1, 9, 2, 9, 3], [2, 3], image_token_id=9) == [1, 9, 9, 2, 9, 9, 9, 3]
    with pytest.raises(ValueError, match=r"holds 2 image tokens .* 1 images"):
        expand_pads([9, 9], [4], image_token_id=9)
    s = SamplingParams(max_new_tokens=2, banned_ids=(7, 3)).to_sglang(2, None)
    assert s["logit_bias"] == {"7": BANNED, "3": BANNED}
    assert "logit_bias" not in SamplingParams(max_new_tokens=2).to_sglang(2, None)
    limits = ModelLimits(vocab_size=8, context_len=64)
    with pytest.raises(RequestError, match=r"sampling.banned_ids has 8, out of range"):
        limits.check([1, 2], SamplingParams(max_new_tokens=2, banned_ids=(8,)))


def _ctx(model: Path, max_pixels: int | None = None) -> TaskContext:
    from rl.config.schema import EnvConfig

    vision = hf_model_config(str(model)).vision
    return TaskContext(hf_checkpoint=str(model), max_position_embeddings=512, max_new_tokens=2,
                       rl_steps=1, env=EnvConfig(), vision=vision,
                       max_pixels=max_pixels)  # fmt: skip


def _task(model: Path, files: list[str], max_pixels: int | None = None):
    cfg = DatasetTaskConfig(train_files=files, eval_size=0, prompt_key="question",
                            label_key="answer", image_key="images")  # fmt: skip
    return build(cfg, _ctx(model, max_pixels))


def test_prompts_with_images_are_expanded_as_the_processor_expands_them(
    tiny_vision, tmp_path
) -> None:
    from transformers import AutoProcessor

    model, data = tiny_vision
    rows = [json.loads(x) for x in (data / "train.jsonl").read_text().splitlines()][:6]
    big = _png(tmp_path / "big.png", 120)
    (tmp_path / "not.png").write_bytes(PNG + b"not an image")
    bad = [
        {"question": "How many?", "answer": "1", "images": ["gone.png"]},
        {"question": "How many?", "answer": "1", "images": [str(big)]},
        {"question": "How many?", "answer": "1", "images": [str(tmp_path / "not.png")]},
        {
            "question": "Count <|image_pad|> squares",
            "answer": "1",
            "images": [str(_png(tmp_path / "small.png", 56))],
        },
    ]
    for r in rows:  # the dataset's paths are relative to its own directory
        r["images"] = [str(data / p) for p in r["images"]]
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows + bad))
    task = _task(model, [str(f)], max_pixels=100 * 100)
    assert len(task.train) == len(rows)
    line = task.describe()
    for why in ("does not exist", "over model.max_pixels=10000", "not a readable image",
                "holds 2 image tokens"):  # fmt: skip
        assert why in line, line
    processor = AutoProcessor.from_pretrained(model)
    for e, r in zip(task.train, rows, strict=True):
        assert e.images == tuple(str(Path(p).resolve()) for p in r["images"])
        text = [e.prompt_text]
        want = processor(text=text, images=[open_image(x) for x in e.images])["input_ids"][0]
        assert list(e.prompt_ids) == list(want)
        assert sum(t == 261 for t in e.prompt_ids) == 4  # a 56x56 image: 4 tokens
    with pytest.raises(TaskError, match="every row was skipped for its images"):
        g = tmp_path / "bad.jsonl"
        g.write_text("".join(json.dumps(r) + "\n" for r in bad))
        _task(model, [str(g)], max_pixels=100 * 100)


def test_images_for_a_text_model_are_refused(tiny_vision, tmp_path) -> None:
    model, data = tiny_vision
    ctx = _ctx(model)
    cfg = DatasetTaskConfig(
        train_files=[str(data / "train.jsonl")], eval_size=0, prompt_key="question",
        label_key="answer", image_key="images",
    )  # fmt: skip
    text_only = TaskContext(**{**ctx.__dict__, "vision": None})
    with pytest.raises(TaskError, match="text-only model"):
        build(cfg, text_only)


def test_the_trainer_batch_gets_its_rows_images_and_positions(tiny_vision) -> None:
    model, data = tiny_vision
    task = _task(model, [str(data / "train.jsonl")])
    v = hf_model_config(str(model)).vision
    assert v is not None and special_ids(v) == (259, 260, 261, 262)
    examples = task.train[:3]
    batch = sft_batch(examples, task.codec.pad_id)
    images = Images(str(model), merge=2)
    refs = [e.images for e in examples[:2]] + [()]  # the last row without its image
    with pytest.raises(ValueError, match="has 4 image-pad tokens but the 0 image grids need 0"):
        with_images(batch, refs, images, v)
    out = with_images(batch, [e.images for e in examples], images, v)
    assert out.image_grids is not None and out.pixel_values is not None
    assert out.image_grids[:, 0].tolist() == [[1, 4, 4]] * 3
    pixels, grids = images.pixels(examples[1].images)
    assert torch.equal(out.pixel_values[1, :16], pixels) and grids.tolist() == [[1, 4, 4]]
    for r in range(3):
        want = mrope_positions(batch.tokens[r], grids, image_token_id=261, merge=2)
        assert torch.equal(out.positions[r], want.T)
    # A vision token among the scored ones is a sampled one: refused, naming the row.
    assert batch.loss_mask is not None
    p = len(examples[1].prompt_ids)
    batch.tokens[1, p] = 259
    with pytest.raises(ValueError, match="row 1 samples a vision token"):
        with_images(batch, [e.images for e in examples], images, v)
