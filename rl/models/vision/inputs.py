"""A micro-batch's images as the vision model takes them, from the trainer's batch rows.

A :class:`~rl.batch.TrainBatch` of a vision-language model carries each row's images as
per-row tensors (so row selection, splitting and the channel treat them as any other
field): ``image_grids`` ``[B, K, 3]`` (t, h, w in patches; all-zero rows are no image)
and ``pixel_values`` ``[B, P, D]`` (the row's patches, image after image, zero-padded).
:func:`vision_input` turns the rows of one micro-batch into one :class:`VisionInput`.

Pure logic: torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


__all__ = ["VisionInput", "image_tokens", "vision_input"]
