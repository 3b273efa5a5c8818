"""rl/models/vision/positions.py against transformers' ``Qwen2_5_VLModel.get_rope_index``.

The reference is a one-layer Qwen2.5-VL built from a tiny config; ``get_rope_index`` reads
only the config, so the random weights do not matter. Adjacent images (pad runs with no text
between them) have no direct reference: transformers groups tokens by type, so two adjacent
images form one group, take one grid for the whole run and fail with a RuntimeError (shape
mismatch). Ours places them one after the other; the test derives that from transformers'
answer for the same row with one text token between the images.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from rl.models.vision.positions import mrope_positions, text_positions

IMAGE = 150
MERGE = 2


@pytest.fixture(scope="module")
def hf() -> transformers.Qwen2_5_VLModel:
    config = transformers.Qwen2_5_VLConfig(
        text_config={
            "hidden_size": 64,
            "intermediate_size": 176,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "vocab_size": 160,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 3, 3],
            },
        },
        vision_config={
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "patch_size": 14,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [0],
        },
        image_token_id=IMAGE,
        video_token_id=151,
        vision_start_token_id=148,
        vision_end_token_id=149,
    )
    return transformers.Qwen2_5_VLModel(config).eval()


def _row(layout: list[int | tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and grids from a layout: an int is that many text tokens, a tuple an image
    wrapped in vision start/end tokens as the Qwen chat template writes it."""
    ids: list[int] = []
    grids: list[tuple[int, int, int]] = []
    for part in layout:
        if isinstance(part, int):
            ids += [10 + i % 100 for i in range(part)]
        else:
            t, h, w = part
            ids += [148] + [IMAGE] * (t * h * w // MERGE**2) + [149]
            grids.append(part)
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(grids, dtype=torch.int64)


def _reference(hf: transformers.Qwen2_5_VLModel, ids: torch.Tensor, grids: torch.Tensor):
    row = ids[None]
    pos, delta = hf.get_rope_index(
        row,
        mm_token_type_ids=(row == IMAGE).int(),
        image_grid_thw=grids if grids.numel() else None,
    )
    return pos[:, 0], int(delta[0, 0])


LAYOUTS = {
    "middle": [5, (1, 4, 4), 7],
    "first": [(1, 4, 4), 3],
    "last": [4, (1, 2, 4)],
    "two_with_text": [2, (1, 4, 4), 3, (1, 2, 4), 2],
    "wide": [3, (1, 4, 6), 2],
    "tall": [3, (1, 6, 2), 2],
    "frames": [1, (2, 4, 2), 4],
    "three": [(1, 2, 2), 1, (1, 6, 4), 2, (2, 2, 2), 1],
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_matches_transformers(hf: transformers.Qwen2_5_VLModel, layout) -> None:
    ids, grids = _row(layout)
    want, _ = _reference(hf, ids, grids)
    got = mrope_positions(ids, grids, image_token_id=IMAGE, merge=MERGE)
    assert got.dtype == torch.int64
    assert got.shape == (3, ids.numel())
    assert torch.equal(got, want)
    # A 1-D arange is what a text model would use; it must not pass for a row with an image.
    assert not torch.equal(text_positions(ids.numel()), want)


def test_text_only(hf: transformers.Qwen2_5_VLModel) -> None:
    ids, grids = _row([9])
    want, want_delta = _reference(hf, ids, grids)
    assert torch.equal(text_positions(9), want)
    assert torch.equal(torch.arange(9).expand(3, 9), want)
    assert torch.equal(mrope_positions(ids, grids, image_token_id=IMAGE, merge=MERGE), want)
    assert want_delta == 0


def test_adjacent_images_transformers_fails(hf: transformers.Qwen2_5_VLModel) -> None:
    ids = torch.tensor([7] + [IMAGE] * 6 + [8])
    grids = torch.tensor([[1, 4, 4], [1, 2, 4]])
    with pytest.raises(RuntimeError):
        _reference(hf, ids, grids)


def test_adjacent_images_follow_each_other(hf: transformers.Qwen2_5_VLModel) -> None:
    grids = torch.tensor([[1, 4, 4], [1, 2, 4]])
    spaced = torch.tensor([7] + [IMAGE] * 4 + [9] + [IMAGE] * 2 + [8])
    want, _ = _reference(hf, spaced, grids)
    # Drop the separator: everything after it moves back by the one position it took.
    want = torch.cat([want[:, :5], want[:, 6:] - 1], dim=1)
    ids = torch.cat([spaced[:5], spaced[6:]])
    assert torch.equal(mrope_positions(ids, grids, image_token_id=IMAGE, merge=MERGE), want)


def test_adjacent_images_by_hand() -> None:
    # Grids (1, 4, 4) and (1, 2, 4): 4 then 2 pad tokens with nothing between them.
    ids = torch.tensor([7, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, IMAGE, 8])
    grids = torch.tensor([[1, 4, 4], [1, 2, 4]])
    want = torch.tensor(
        [
            [0, 1, 1, 1, 1, 3, 3, 5],
            [0, 1, 1, 2, 2, 3, 3, 5],
            [0, 1, 2, 1, 2, 3, 4, 5],
        ]
    )
    assert torch.equal(mrope_positions(ids, grids, image_token_id=IMAGE, merge=MERGE), want)


def test_wrong_pad_count_raises() -> None:
    ids, grids = _row([2, (1, 4, 4), 2])
    short = ids[ids != IMAGE][:2].tolist() + [IMAGE] * 3 + [9, 9]
    with pytest.raises(ValueError, match=r"3 image-pad tokens .* need 4"):
        mrope_positions(torch.tensor(short), grids, image_token_id=IMAGE, merge=MERGE)


def test_grid_not_divisible_by_merge_raises() -> None:
    ids = torch.tensor([1] + [IMAGE] * 3 + [2])
    with pytest.raises(ValueError, match="divisible by merge=2"):
        mrope_positions(ids, torch.tensor([[1, 3, 4]]), image_token_id=IMAGE, merge=MERGE)
