"""Prompts with images, for a vision-language policy: a row's images placed in its first
user message as the chat template's image parts, and the rendered prompt's image tokens
expanded to the count each image takes (the checkpoint's own image processor gives the
grids), as the server expands them. A row whose images cannot be used, or whose text
itself holds the image token, is skipped and counted, never sent.

Pure logic: no torch.distributed, no Megatron.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl.models.vision.images import ImageError, Images, reference
from rl.models.vision.tokens import expand_pads, merge_of
from rl.tasks.common import TaskError

if TYPE_CHECKING:
    from rl.config.schema import VisionConfig


class SkippedRow(Exception):
    """A data row left out (counted by its reason); the message says why."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class ImagePrompts:
    """A dataset's images for the policy's processor in ``path`` (its tokenizer's directory)."""

    def __init__(
        self, path: str, vision: VisionConfig | None, max_pixels: int | None, key: str | None
    ):
        if vision is None:
            raise TaskError(
                f"task.image_key={key!r} gives prompts images, but the policy is a text-only "
                "model (model.architecture has no vision tower)"
            )
        self.vision, self.key = vision, key
        try:
            self.images = Images(path, merge_of(vision), max_pixels)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TaskError(f"{path!r}: the image processor does not load: {first}") from None
        self.skipped: Counter[str] = Counter()
        self.first_skip: dict[str, str] = {}

    def refs(self, value: object, base: Path) -> tuple[str, ...]:
        """A JSON or Parquet cell's image references (one image, or a list of them)."""
        cells = value if isinstance(value, list | tuple) else [value]
        try:
            return tuple(reference(c, base) for c in cells)
        except ImageError as e:
            raise SkippedRow("missing", str(e)) from None

    @staticmethod
    def with_images(messages: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
        """The first user message with ``n`` image parts before its text."""
        out = [dict(m) for m in messages]
        first = next((m for m in out if m["role"] == "user"), None)
        if first is None:
            raise SkippedRow("no_user", "the prompt has no user message to hold its images")
        first["content"] = [*({"type": "image"} for _ in range(n)),
                            {"type": "text", "text": first["content"]}]  # fmt: skip
        return out

    def expand(self, ids: Sequence[int], refs: Sequence[str]) -> list[int]:
        """``ids`` with each image token repeated as many times as its image takes."""
        try:
            tokens = self.images.tokens(refs)
        except ImageError as e:
            reason = "too_large" if "max_pixels" in str(e) else "unreadable"
            raise SkippedRow(reason, str(e)) from None
        try:
            return expand_pads(ids, tokens, self.vision.image_token_id)
        except ValueError as e:
            raise SkippedRow("image_token_in_text", str(e)) from None

    def skip(self, where: str, row: SkippedRow) -> None:
        self.skipped[row.reason] += 1
        self.first_skip.setdefault(row.reason, f"{where}: {row}")

    def describe(self) -> str:
        """The rows skipped for their images, by reason, with the first of each."""
        return "; ".join(f"{n} skipped ({self.first_skip[r]})" for r, n in self.skipped.items())
