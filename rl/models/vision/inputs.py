"""A micro-batch's images as the vision model takes them, from the trainer's batch rows.

A :class:`~rl.batch.TrainBatch` of a vision-language model carries each row's images as
per-row tensors (so row selection, splitting and the channel treat them as any other
field): ``image_grids`` ``[B, K, 3]`` (t, h, w in patches; all-zero rows are no image)
and ``pixel_values`` ``[B, P, D]`` (the row's patches, image after image, zero-padded).
:func:`vision_input` turns the rows of one micro-batch into one :class:`VisionInput`.

Pure logic: torch only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

from rl.models.vision.positions import mrope_positions
from rl.models.vision.tokens import merge_of, special_ids

if TYPE_CHECKING:
    from rl.batch import TrainBatch
    from rl.config.schema import VisionConfig


@dataclass
class VisionInput:
    """One micro-batch's images. ``pixel_values``: the patches of every image, image after
    image ``[patches, channels * t * p * p]``; ``grid_thw``: ``[images, 3]``; ``slots``:
    shaped as the decoder's ``input_ids``, the index of the merged image embedding each
    position takes (-1: its own token's)."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    slots: torch.Tensor

    def with_slots(self, slots: torch.Tensor) -> VisionInput:
        return VisionInput(self.pixel_values, self.grid_thw, slots)


def image_tokens(grids: torch.Tensor, merge: int) -> torch.Tensor:
    """The image-pad tokens each image takes, ``t * h * w / merge**2``, per grid row."""
    return grids.prod(-1) // (merge * merge)


def vision_input(
    tokens: torch.Tensor,
    pixel_values: torch.Tensor,
    image_grids: torch.Tensor,
    *,
    image_token_id: int,
    merge: int,
) -> VisionInput | None:
    """The images of the rows ``tokens`` ``[b, s]`` (None: none has one).

    Each row's image-pad tokens must be exactly its images' tokens, in order: a row with a
    pad token more (a sampled one) or fewer is refused, naming the row, since its
    embeddings would otherwise land on the wrong positions."""
    grids = image_grids.reshape(tokens.shape[0], -1, 3).long()
    present = grids.prod(-1) > 0  # [b, K]
    pads = tokens == image_token_id
    want = (image_tokens(grids, merge) * present).sum(-1)
    have = pads.sum(-1)
    bad = (want != have).nonzero()
    if bad.numel():
        r = int(bad[0, 0])
        raise ValueError(
            f"row {r} holds {int(have[r])} image-pad tokens (id {image_token_id}) where its "
            f"images take {int(want[r])}: an image token outside the prompt's images"
        )
    if not bool(present.any()):
        return None
    patches = grids.prod(-1) * present  # [b, K]
    per_row = patches.sum(-1).tolist()
    pixels = torch.cat([pixel_values[r, :n] for r, n in enumerate(per_row) if n])
    slots = torch.where(pads, pads.reshape(-1).cumsum(0).view_as(pads) - 1, -1)
    return VisionInput(pixels, grids[present], slots)


class PixelSource(Protocol):
    """What turns image references into patches (rl/models/vision/images.py:Images)."""

    def pixels(self, refs: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]: ...


def with_images(
    batch: TrainBatch, images: Sequence[Sequence[str]], source: PixelSource, v: VisionConfig
) -> TrainBatch:
    """``batch`` with its rows' images (``images[r]``: row r's references, in prompt order):
    their patches, grids and the rows' 3-D positions. Refuses a row whose scored tokens
    hold a vision token (a sampled one: the server bans them), naming the row."""
    if len(images) != batch.rows:
        raise ValueError(f"images for {len(images)} rows, the batch has {batch.rows}")
    if batch.loss_mask is not None:
        special = torch.tensor(special_ids(v))
        hit = (torch.isin(batch.tokens[:, 1:], special) & (batch.loss_mask[:, :-1] > 0)).any(-1)
        if bool(hit.any()):
            r = int(hit.nonzero()[0, 0])
            raise ValueError(
                f"row {r} samples a vision token ({list(special_ids(v))}): the server must "
                "ban them (rollout sampling's banned ids)"
            )
    per_row = [source.pixels(refs) if refs else None for refs in images]
    k = max((len(refs) for refs in images), default=0)
    dim = next((p.shape[1] for p, _ in filter(None, per_row)), 1)
    n = max((p.shape[0] for p, _ in filter(None, per_row)), default=0)
    pixels = torch.zeros(batch.rows, max(n, 1), dim)
    grids = torch.zeros(batch.rows, max(k, 1), 3, dtype=torch.int64)
    positions = torch.empty(batch.rows, batch.seq, 3, dtype=torch.int64)
    for r, got in enumerate(per_row):
        g = got[1] if got is not None else grids.new_zeros(0, 3)
        if got is not None:
            pixels[r, : got[0].shape[0]] = got[0]
            grids[r, : len(g)] = g
        positions[r] = mrope_positions(
            batch.tokens[r], g, image_token_id=v.image_token_id, merge=merge_of(v)
        ).T
    return replace(batch, positions=positions, image_grids=grids, pixel_values=pixels)


__all__ = ["PixelSource", "VisionInput", "image_tokens", "vision_input", "with_images"]
