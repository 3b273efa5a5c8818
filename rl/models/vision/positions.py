"""Qwen2.5-VL's 3-D multimodal RoPE position ids (M-RoPE) for one packed row.

Qwen2.5-VL rotates each query/key by three position planes (temporal, height, width)
instead of one. Text tokens carry the same position on all three planes; the image-pad
tokens of an image carry their (t, h, w) coordinate on the merged patch grid, offset by the
position where the image starts. The trainer has to build exactly the positions that
transformers' ``Qwen2_5_VLModel.get_rope_index`` (and so the rollout engine) builds, or the
log-probs of the two sides drift apart; this module does it without transformers, Megatron
or torch.distributed so it runs anywhere and is tested against the reference in
milliseconds.
"""

from __future__ import annotations

import torch

__all__ = ["mrope_positions", "text_positions"]


def text_positions(s: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Positions of a text-only row: ``[3, s]``, ``arange(s)`` on every plane."""
    return torch.arange(s, dtype=torch.int64, device=device).expand(3, s).clone()


def _image_positions(start: int, t: int, h: int, w: int, device: torch.device) -> torch.Tensor:
    # Images use time_interval 1: temporal index is the patch-frame index itself.
    tt, hh, ww = torch.meshgrid(
        torch.arange(t, dtype=torch.int64, device=device),
        torch.arange(h, dtype=torch.int64, device=device),
        torch.arange(w, dtype=torch.int64, device=device),
        indexing="ij",
    )
    return torch.stack([tt, hh, ww]).reshape(3, -1) + start


def mrope_positions(
    ids: torch.Tensor, grids: torch.Tensor, *, image_token_id: int, merge: int
) -> torch.Tensor:
    """3-D positions ``[3, s]`` (int64) of one row ``ids`` ``[s]`` holding the images ``grids``.

    ``grids`` is ``[n_images, 3]``: (t, h, w) in patches before the spatial merge, one row per
    image in the order its pad tokens appear. Image k owns exactly ``t*h*w // merge**2``
    consecutive pad tokens; two images with no text between them are split by those counts,
    one after the other.
    """
    if ids.dim() != 1:
        raise ValueError(f"ids must be one row [s], got shape {tuple(ids.shape)}")
    grids = grids.reshape(-1, 3).to(torch.int64)
    s = ids.numel()
    is_pad = ids == image_token_id
    n_pad = int(is_pad.sum())
    if grids.numel() and bool(((grids[:, 1:] % merge) != 0).any()):
        raise ValueError(f"image grid h and w must be divisible by merge={merge}: {grids.tolist()}")
    llm = [(int(t), int(h) // merge, int(w) // merge) for t, h, w in grids.tolist()]
    counts = [t * h * w for t, h, w in llm]
    if n_pad != sum(counts):
        raise ValueError(
            f"row has {n_pad} image-pad tokens but the {len(llm)} image grids need {sum(counts)}"
        )
    if not llm:
        return text_positions(s, ids.device)

    # Walk the images rather than runs of equal token type: adjacent images form one run of
    # pads, and only the per-image token counts tell where one ends and the next begins.
    out = torch.empty(3, s, dtype=torch.int64, device=ids.device)
    pad_idx = torch.nonzero(is_pad).flatten().tolist()
    cursor = 0
    pos = 0
    used = 0
    for (t, h, w), n in zip(llm, counts, strict=True):
        first = pad_idx[used]
        if pad_idx[used + n - 1] != first + n - 1:
            raise ValueError(f"image-pad tokens of image at index {first} are not contiguous")
        if first > cursor:
            out[:, cursor:first] = torch.arange(
                pos, pos + first - cursor, dtype=torch.int64, device=ids.device
            )
            pos += first - cursor
        out[:, first : first + n] = _image_positions(pos, t, h, w, ids.device)
        pos += max(h, w)
        cursor = first + n
        used += n
    if cursor < s:
        out[:, cursor:] = torch.arange(pos, pos + s - cursor, dtype=torch.int64, device=ids.device)
    return out
