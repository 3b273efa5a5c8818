"""A job's images: one string per image, from the prompt file to the server and the trainer.

A reference is an absolute file path or a ``data:`` URI (bytes a prompt file holds inline).
Examples, rollouts and the trainer's command carry references, never pixels: the servers
get each image as a data URI (they need not see the job's filesystem), and the trainer's
first pipeline stage turns references into patches with the checkpoint's own image
processor (:class:`Images`), the one the controller expanded the prompt with. What crosses
the store is a path or the image file's own bytes, not its float patches (hundreds of
times larger).

Pure logic: PIL, torch and transformers' image processor, imported when first used (the
controller's task and the planner import this module).
"""

from __future__ import annotations

import base64
import mimetypes
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

DATA = "data:"
CACHED = 4096  # images whose patches the trainer keeps (a group's samples share them)


class ImageError(ValueError):
    """An image that cannot be used: missing, unreadable or too large; one line naming it."""


def _short(ref: str) -> str:
    return ref if not ref.startswith(DATA) else f"{ref[:40]}... ({len(ref)} characters)"


def reference(value: object, base: Path) -> str:
    """A prompt file's image cell as a reference: a path (relative to ``base``, the file's
    directory, or absolute, or ``file://``), a data URI, raw bytes, or a mapping with
    ``bytes`` or ``path`` (Hugging Face datasets' image feature as Parquet stores it)."""
    if isinstance(value, Mapping):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, bytes | bytearray):
        kind = _sniff(bytes(value))
        return f"{DATA}{kind};base64,{base64.b64encode(value).decode()}"
    if not isinstance(value, str) or not value:
        raise ImageError(f"an image must be a path, a data URI or bytes, not {str(value)[:60]!r}")
    if value.startswith(DATA):
        return value
    path = Path(unquote(urlparse(value).path) if value.startswith("file://") else value)
    path = (base / path).expanduser() if not path.is_absolute() else path
    if not path.is_file():
        raise ImageError(f"image file {str(path)!r} does not exist")
    return str(path.resolve())


def _sniff(data: bytes) -> str:
    for magic, kind in ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"),
                        (b"GIF8", "image/gif"), (b"RIFF", "image/webp")):  # fmt: skip
        if data.startswith(magic):
            return kind
    return "application/octet-stream"


def image_bytes(ref: str) -> bytes:
    if ref.startswith(DATA):
        try:
            return base64.b64decode(ref.split(",", 1)[1], validate=True)
        except (IndexError, ValueError):
            raise ImageError(f"image {_short(ref)!r} is not a base64 data URI") from None
    try:
        return Path(ref).read_bytes()
    except OSError as e:
        raise ImageError(f"image file {ref!r} cannot be read ({e.strerror})") from None


def open_image(ref: str) -> Image:
    """The image as RGB; :class:`ImageError` when it is not an image PIL reads."""
    import io

    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    try:
        with PILImage.open(io.BytesIO(image_bytes(ref))) as im:
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError) as e:
        raise ImageError(f"image {_short(ref)!r} is not a readable image ({e})") from None


def data_uri(ref: str) -> str:
    """The image as a server takes it wherever it runs: a data URI."""
    if ref.startswith(DATA):
        return ref
    kind = mimetypes.guess_type(ref)[0] or _sniff(image_bytes(ref))
    return f"{DATA}{kind};base64,{base64.b64encode(image_bytes(ref)).decode()}"


def image_size(ref: str) -> tuple[int, int]:
    """(width, height) from the image's header (nothing decoded); :class:`ImageError` when
    it is not an image PIL reads."""
    import io

    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    try:
        with PILImage.open(io.BytesIO(image_bytes(ref))) as im:
            return im.size
    except (UnidentifiedImageError, OSError) as e:
        raise ImageError(f"image {_short(ref)!r} is not a readable image ({e})") from None


def blank_image(size: int) -> str:
    """A white ``size`` x ``size`` PNG as a data URI (a server's warm-up image)."""
    import io

    from PIL import Image as PILImage

    buf = io.BytesIO()
    PILImage.new("RGB", (size, size), "white").save(buf, format="PNG")
    return f"{DATA}image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"


class Images:
    """The checkpoint's image processor: how many image-pad tokens each image takes (for
    the controller, which expands the prompts) and patches for the trainer, cached by
    reference. ``max_pixels``: an image larger than this (width x height, before the
    processor resizes it) is refused; None: any size. ``merge``: the tower's spatial merge
    (merge x merge patches make one token)."""

    def __init__(self, path: str, merge: int, max_pixels: int | None = None):
        from transformers import AutoImageProcessor

        self.processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        self.merge, self.max_pixels = merge, max_pixels
        self._cache: OrderedDict[str, tuple[torch.Tensor, torch.Tensor]] = OrderedDict()

    def _fits(self, ref: str, size: tuple[int, int]) -> None:
        if self.max_pixels is not None and size[0] * size[1] > self.max_pixels:
            raise ImageError(
                f"image {_short(ref)!r} has {size[0]}x{size[1]} pixels, over "
                f"model.max_pixels={self.max_pixels}"
            )

    def tokens(self, refs: Sequence[str]) -> list[int]:
        """The image-pad tokens each image takes. From the header's size by the processor's
        own rule where it has one (``get_number_of_image_patches``: nothing decoded), else
        by processing the image."""
        count = getattr(self.processor, "get_number_of_image_patches", None)
        out = []
        for ref in refs:
            if count is None:
                out.append(int(self._one(ref)[1].prod()) // self.merge**2)
                continue
            w, h = image_size(ref)
            self._fits(ref, (w, h))
            out.append(int(count(h, w, {})) // self.merge**2)
        return out

    def _one(self, ref: str) -> tuple[torch.Tensor, torch.Tensor]:
        if ref in self._cache:
            self._cache.move_to_end(ref)
            return self._cache[ref]
        image = open_image(ref)
        self._fits(ref, image.size)
        out = self.processor(images=[image], return_tensors="pt")
        got = (out["pixel_values"].float(), out["image_grid_thw"][0].long())
        self._cache[ref] = got
        if len(self._cache) > CACHED:
            self._cache.popitem(last=False)
        return got

    def pixels(self, refs: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The images' patches, image after image ``[P, D]``, and their grids ``[K, 3]``."""
        import torch

        parts = [self._one(r) for r in refs]
        return torch.cat([p for p, _ in parts]), torch.stack([g for _, g in parts])


__all__ = ["DATA", "ImageError", "Images", "blank_image", "data_uri", "image_size",
           "open_image", "reference"]  # fmt: skip
