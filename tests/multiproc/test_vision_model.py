"""Vision-language policies (Qwen2.5-VL, Qwen3-VL) in the trainer, against transformers.

A tiny random model of each family (tests/helpers/vision_models.py) is converted HF ->
Megatron ``torch_dist`` on gloo ranks at TP1, TP2 with sequence parallelism and PP2,
padded and packed; the trainer's logits of rows with images (their 3-D positions, their
patches through transformers' own vision tower, spliced at the image-pad positions, and
Qwen3-VL's deepstack embeddings added after its first layers) must equal transformers'
forward in fp32. The same model given 1-D positions, its image tokens one position off, or
(Qwen3-VL) no deepstack, must not. Converting back gives the original files bit for bit, and the
processor with them (AutoProcessor loads it).
With
``model.train_vision=true`` one optimizer step moves the tower's weights, and TP2 with
sequence parallelism (whose ranks each splice a slice of the sequence, and sum the tower's
gradients) ends where TP1 does; a frozen tower does not move; a checkpoint saved after
the step resumes to the same second step (the tower's Adam state included).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoProcessor

from rl.runtime.launch import spawn
from rl.weights.convert import mcore_to_hf, prepare_hf_to_mcore
from tests.helpers.hf_models import tiny_models
from tests.helpers.vision_models import (
    PROCESSORS,
    hf_vision_logits,
    image_batch,
    make_vision_model,
    tiny,
)
from tests.helpers.workers import vision_logits

KINDS = list(tiny_models(vision=True))
VOCAB = tiny()["text_config"]["vocab_size"]
# Row 0: one 4x4 image (4 tokens); row 1: a 4x6 image and a 2x2 one with text between.
ROWS = [([3], [(1, 4, 4)]), ([2, 10], [(1, 4, 6), (1, 2, 2)])]
SEQ = 24
# (tp, pp, overrides)
LAYOUTS = {
    "tp1-padded": (1, 1, ("trainer.packing=false",)),
    "tp2-sp-packed": (2, 1, ("trainer.sequence_parallel=true",)),
    "pp2-packed": (1, 2, ()),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vl")
    return {kind: make_vision_model(root / kind, kind) for kind in KINDS}


@pytest.fixture(scope="module")
def hf(models) -> Path:
    return models["qwen2_5_vl"]


def _batches(kind: str) -> dict:
    good = image_batch(ROWS, SEQ, kind=kind)
    # The image tokens one position later: the embeddings land one token off.
    later = [([s + 1 for s in starts], grids) for starts, grids in ROWS]
    shifted = image_batch(later, SEQ, kind=kind)
    return {
        "image": good,
        "one_d": replace(good, positions=None),
        "shifted": replace(good, tokens=shifted.tokens, positions=shifted.positions),
    }


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", KINDS)
def test_trainer_logits_match_transformers(tmp_path, models, kind: str, layout: str) -> None:
    tp, pp, more = LAYOUTS[layout]
    hf = models[kind]
    want = hf_vision_logits(hf, image_batch(ROWS, SEQ, kind=kind), kind)
    m, _ = prepare_hf_to_mcore(str(hf), tp, pp, vocab_multiple=128, dtype=None)
    out = tmp_path / "mcore"
    for r in spawn(vision_logits, tp * pp, str(hf), str(out), m, tp, pp, _batches(kind), more):
        got = {k: v[..., :VOCAB] for k, v in r["logits"].items()}
        assert (got["image"] - want).abs().max() < 1e-5
        assert (got["one_d"] - want).abs().max() > 1e-3  # 1-D positions: not the model
        assert (got["shifted"] - want).abs().max() > 1e-3
        deepstack = (got["no_deepstack"] - want).abs().max()
        assert deepstack > 1e-3 if kind == "qwen3_vl" else deepstack < 1e-5
    if layout != "tp1-padded":
        return
    back = tmp_path / "back"
    mcore_to_hf(str(out), str(back), tokenizer_dir=str(hf))
    assert type(AutoProcessor.from_pretrained(back)).__name__ == PROCESSORS[kind]
    src, dst = load_file(hf / "model.safetensors"), load_file(back / "model.safetensors")
    assert sorted(src) == sorted(dst) and any(".visual." in f".{k}" for k in src)
    for name, t in src.items():
        assert torch.equal(t, dst[name]), name
    assert torch.equal(hf_vision_logits(back, image_batch(ROWS, SEQ, kind=kind), kind), want)


def test_training_the_vision_tower_is_the_same_at_tp2_with_sp_and_resumes(tmp_path, hf) -> None:
    batches = {"image": image_batch(ROWS, SEQ)}  # Qwen2.5-VL
    res = {}
    for name, tp, trained, more in (
        ("tp1", 1, True, ()),
        ("tp2", 2, True, ("trainer.sequence_parallel=true",)),
        ("frozen", 1, False, ()),
    ):
        m, _ = prepare_hf_to_mcore(str(hf), tp, 1, vocab_multiple=128, dtype=None)
        m = replace(m, train_vision=trained)
        res[name] = spawn(vision_logits, tp, str(hf), str(tmp_path / name), m, tp, 1, batches,
                          more, True)  # fmt: skip
    assert res["tp1"][0]["tower_moved"] > 1e-5
    assert res["frozen"][0]["tower_moved"] == 0
    ref = res["tp1"][0]["logits"]["image"]
    for r in res["tp1"] + res["tp2"] + res["frozen"]:
        assert r["resumed_gap"] < 1e-6
    for r in res["tp2"]:
        assert r["tower_moved"] > 1e-5
        assert (r["logits"]["image"] - ref).abs().max() < 1e-5
    assert (res["frozen"][0]["logits"]["image"] - ref).abs().max() > 1e-4
