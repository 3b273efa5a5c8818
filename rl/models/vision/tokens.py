"""A vision-language model's tokens: which ones a policy must never sample, how many
patches merge into one, and a rendered prompt's image tokens expanded to their images'
counts. Pure logic without torch (the controller's task and the planner import it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl.config.schema import VisionConfig


def special_ids(v: VisionConfig) -> tuple[int, ...]:
    """The vision tokens a policy must never sample: the image and video pads and the
    markers around them (the server bans them, the trainer refuses a response with one)."""
    ids = (v.image_token_id, v.video_token_id, v.vision_start_token_id, v.vision_end_token_id)
    return tuple(sorted({i for i in ids if i is not None}))


def merge_of(v: VisionConfig) -> int:
    return int(v.tower.get("spatial_merge_size", 2))


def expand_pads(ids: Sequence[int], tokens: Sequence[int], image_token_id: int) -> list[int]:
    """A rendered prompt (one image-pad token per image, as a chat template writes it) with
    each pad repeated as many times as its image takes (``tokens``), as the server expands
    it. ValueError when the pads are not one per image (the text itself holds the token)."""
    pad = image_token_id
    found = sum(1 for t in ids if t == pad)
    if found != len(tokens):
        raise ValueError(f"the prompt holds {found} image tokens (id {pad}), {len(tokens)} images")
    counts = iter(tokens)
    out: list[int] = []
    for t in ids:
        out.extend([t] * next(counts) if t == pad else [t])
    return out


__all__ = ["expand_pads", "merge_of", "special_ids"]
