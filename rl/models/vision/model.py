"""A vision-language policy: Megatron's ``GPTModel`` with multimodal RoPE, and the family's
vision tower (transformers' own module) feeding it image embeddings.

The decoder is the text families' Megatron model, so TP, SP, PP, packing, checkpoints and
DDMA treat its tensors as they treat a text model's (same keys). The tower and merger stay
transformers' modules, held whole on the first pipeline stage (attribute ``visual``, so
their parameter names are the HF checkpoint's ``visual.*``): they are small beside the
decoder, and their exact numerics are transformers'.

Each micro-batch's images run through the tower once; the merged embeddings replace the
embeddings of the image-pad tokens at the positions ``VisionInput.slots`` names, which the
trainer derives from the prompt (never from a sampled token). Under sequence parallelism
the decoder's input is this rank's slice of the sequence, so each rank splices the
embeddings of its own slice and the tower's gradients are summed over the TP group
(Megatron's ``sequence_parallel`` parameter attribute). Positions are 3-D ``[3, b, s]``
(rl/models/vision/positions.py). Imported only once Megatron is patched (build_gpt).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from megatron.core.models.gpt import GPTModel

from rl.models.vision.inputs import VisionInput

if TYPE_CHECKING:
    from rl.config.schema import ModelConfig
    from rl.models.arch import VisionArch


def build_tower(m: ModelConfig, vision: VisionArch, dtype: torch.dtype) -> torch.nn.Module:
    """The family's vision tower and merger, randomly initialised (a checkpoint fills it)."""
    import transformers

    assert m.vision is not None
    config = getattr(transformers, vision.config_class)(**m.vision.tower)
    config._attn_implementation = "sdpa"
    tower = getattr(transformers, vision.tower_class)._from_config(config, dtype=dtype)
    tower.requires_grad_(m.train_vision)
    return tower


def image_embeddings(tower: torch.nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
    """The merged embeddings ``[tokens, hidden]`` of every image, image after image."""
    dtype = next(tower.parameters()).dtype
    return tower(pixel_values.to(dtype), grid_thw=grid_thw).pooler_output


class VisionGPTModel(GPTModel):
    """``GPTModel`` whose first stage splices image embeddings into the decoder's input."""

    def __init__(self, *args: Any, tower: torch.nn.Module | None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.visual = tower if self.pre_process else None
        if self.visual is not None and self.config.sequence_parallel:
            for p in self.visual.parameters():  # summed over TP in finalize_model_grads
                setattr(p, "sequence_parallel", True)  # noqa: B010 (not a declared attribute)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        vision: VisionInput | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        if vision is not None and self.visual is not None and decoder_input is None:
            decoder_input = self.spliced(input_ids, vision)
        return super().forward(
            input_ids, position_ids, attention_mask, decoder_input=decoder_input,
            labels=labels, **kwargs,
        )  # fmt: skip

    def spliced(self, input_ids: torch.Tensor, vision: VisionInput) -> torch.Tensor:
        """The decoder's input ``[s, b, h]`` (this rank's slice under SP): the token
        embeddings with each slot's image embedding in place."""
        assert self.visual is not None
        emb = self.embedding(input_ids=input_ids, position_ids=None)
        slots = vision.slots.t()  # [s, b], as the embedding's output
        if self.config.sequence_parallel:
            tp = self.pg_collection.tp
            n = emb.shape[0]
            slots = slots[tp.rank() * n : (tp.rank() + 1) * n]
        feats = image_embeddings(self.visual, vision.pixel_values, vision.grid_thw)
        used = int((vision.slots >= 0).sum())
        if used != feats.shape[0]:
            raise ValueError(
                f"{used} image-pad positions for {feats.shape[0]} image embeddings "
                f"(grid_thw={vision.grid_thw.tolist()})"
            )
        where = slots >= 0
        emb = emb.clone()
        emb[where] = feats[slots[where]].to(emb.dtype)
        return emb
