"""A vision-language policy's images on the trainer ranks: a batch's rows come with image
references (rl/models/vision/images.py), and every rank makes their patches, grids and 3-D
positions itself with the checkpoint's image processor (the one that expanded the
prompts), so no pixels cross the job's store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rl.batch import TrainBatch
    from rl.config.schema import ModelConfig
    from rl.models.vision.images import Images


class BatchImages:
    """``batch_images(batch, images)``: ``batch`` with its rows' images (``images[r]``,
    row r's references; empty: none). The processor is loaded at the first image."""

    def __init__(self, model: ModelConfig):
        self.model = model
        self._source: Images | None = None

    def __call__(self, batch: TrainBatch, images: Sequence[Sequence[str]]) -> TrainBatch:
        if not any(images):
            return batch
        from rl.models.vision import inputs
        from rl.models.vision.images import Images
        from rl.models.vision.tokens import merge_of

        m = self.model
        if m.vision is None:
            raise ValueError(
                f"the batch has images for model.architecture={m.architecture}, a text-only model"
            )
        if self._source is None:
            if not m.hf_checkpoint:
                raise ValueError("a batch with images needs model.hf_checkpoint (its processor)")
            self._source = Images(m.hf_checkpoint, merge_of(m.vision), m.max_pixels)
        return inputs.with_images(batch, images, self._source, m.vision)
