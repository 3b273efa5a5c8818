"""A tiny random vision-language model (a family's ``Arch.tiny``), batches of image rows
for the trainer, and transformers' logits of them: the reference the trainer must match."""

from __future__ import annotations

from pathlib import Path

import torch

from rl.batch import TrainBatch
from rl.models.vision.positions import mrope_positions
from tests.helpers.hf_models import tiny_models

KIND = "qwen2_5_vl"
PROCESSORS = {"qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}


def tiny(kind: str = KIND) -> dict:
    return tiny_models(vision=True)[kind].tiny[kind]


def make_vision_model(path: Path, kind: str = KIND, seed: int = 0) -> Path:
    """The tiny model ``kind`` with random, non-trivial norms and biases, saved in ``path``."""
    import transformers

    arch = tiny_models(vision=True)[kind]
    torch.manual_seed(seed)
    conf = transformers.AutoConfig.for_model(arch.model_type, **tiny(kind))
    model = getattr(transformers, arch.hf_class)(conf)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p))
    model.eval().save_pretrained(path)
    make_processor(path, kind)
    return path


def make_processor(path: Path, kind: str = KIND) -> Path:
    """The family's processor in ``path``: transformers' image and video processors at the
    tiny model's patch size, and a byte-level tokenizer with the vision special tokens."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={chr(i): i - 32 for i in range(32, 127)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="~")
    fast.add_special_tokens({"additional_special_tokens": [
        "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]})  # fmt: skip
    patch = tiny(kind)["vision_config"]["patch_size"]
    video = "Qwen3VLVideoProcessor" if kind == "qwen3_vl" else "Qwen2VLVideoProcessor"
    processor = getattr(transformers, PROCESSORS[kind])(
        image_processor=transformers.Qwen2VLImageProcessor(patch_size=patch),
        video_processor=getattr(transformers, video)(patch_size=patch),
        tokenizer=fast,
    )
    processor.save_pretrained(path)
    return path


def image_batch(
    rows: list[tuple[list[int], list[tuple[int, int, int]]]],
    seq: int,
    *,
    kind: str = KIND,
    seed: int = 1,
    positions: bool = True,
) -> TrainBatch:
    """Rows of random text with images: each row is (where each image's pads start, the
    images' (t, h, w) grids). Random patches; 3-D positions unless ``positions`` is
    false (1-D ones then, which a vision-language model must not match)."""
    conf = tiny(kind)
    pad, vocab = conf["image_token_id"], conf["text_config"]["vocab_size"]
    merge = conf["vision_config"]["spatial_merge_size"]
    v = conf["vision_config"]
    dim = 3 * v["temporal_patch_size"] * v["patch_size"] ** 2
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(3, min(pad, vocab) - 12, (len(rows), seq), generator=g)
    k = max(len(grids) for _, grids in rows)
    grids = torch.zeros(len(rows), k, 3, dtype=torch.long)
    patches = [sum(t * h * w for t, h, w in gs) for _, gs in rows]
    pixels = torch.zeros(len(rows), max(patches), dim)
    for r, (starts, gs) in enumerate(rows):
        for i, (start, (t, h, w)) in enumerate(zip(starts, gs, strict=True)):
            tokens[r, start : start + t * h * w // merge**2] = pad
            grids[r, i] = torch.tensor([t, h, w])
        pixels[r, : patches[r]] = torch.randn(patches[r], dim, generator=g)
    pos = torch.stack([
        mrope_positions(tokens[r], grids[r][grids[r].prod(-1) > 0], image_token_id=pad,
                        merge=merge) for r in range(len(rows))
    ]).permute(0, 2, 1)  # fmt: skip
    return TrainBatch(tokens, positions=pos if positions else None, image_grids=grids,
                      pixel_values=pixels)  # fmt: skip


def hf_vision_logits(path: Path, batch: TrainBatch, kind: str = KIND) -> torch.Tensor:
    """transformers' logits of every row with its images (3-D positions: the image tokens
    are marked in ``mm_token_type_ids``, without which transformers uses 1-D ones)."""
    import transformers

    arch = tiny_models(vision=True)[kind]
    model = getattr(transformers, arch.hf_class).from_pretrained(path, dtype=torch.float32).eval()
    pad = tiny(kind)["image_token_id"]
    assert batch.image_grids is not None and batch.pixel_values is not None
    out = []
    for r in range(batch.rows):
        grids = batch.image_grids[r][batch.image_grids[r].prod(-1) > 0]
        ids = batch.tokens[r : r + 1]
        pixels = batch.pixel_values[r, : int(grids.prod(-1).sum())]
        types = (ids == pad).int()
        with torch.no_grad():
            logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grids,
                           mm_token_type_ids=types).logits  # fmt: skip
        out.append(logits)
    return torch.cat(out)


def tiny_vision_maker():
    """tools/make_tiny_vision.py as a module (the tool is a script, not a package)."""
    import importlib.util

    tool = Path(__file__).resolve().parents[2] / "tools" / "make_tiny_vision.py"
    spec = importlib.util.spec_from_file_location("make_tiny_vision", tool)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
