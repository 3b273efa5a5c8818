"""A vision-language policy: Megatron's ``GPTModel`` with multimodal RoPE, and the family's
vision tower (transformers' own module) feeding it image embeddings.

The decoder is the text families' Megatron model, so TP, SP, PP, packing, checkpoints and
DDMA treat its tensors as they treat a text model's (same keys). The tower and merger stay
transformers' modules, held whole on the first pipeline stage (attribute ``visual``: the
Megatron checkpoint's ``visual.*``, the HF one's under the family's prefix): they are small
beside the decoder, and their exact numerics are transformers'. Qwen3-VL's interleaved
multimodal RoPE and deepstack embeddings are here too (Megatron-Core 0.16 has neither).

Each micro-batch's images run through the tower once; the merged embeddings replace the
embeddings of the image-pad tokens at the positions ``VisionInput.slots`` names, which the
trainer derives from the prompt (never from a sampled token). Under sequence parallelism
the decoder's input is this rank's slice of the sequence, so each rank splices the
embeddings of its own slice and the tower's gradients are summed over the TP group
(Megatron's ``sequence_parallel`` parameter attribute). Positions are 3-D ``[3, b, s]``
(rl/models/vision/positions.py). Imported only once Megatron is patched (build_gpt).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import MultimodalRotaryEmbedding
from megatron.core.models.gpt import GPTModel

from rl.models.vision.inputs import VisionInput

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams
    from torch.distributed import ProcessGroup

    from rl.config.schema import ModelConfig
    from rl.models.arch import VisionArch


def _plain(value: object) -> Any:  # a JSON value
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str):
        return [_plain(v) for v in value]
    return value


def build_tower(m: ModelConfig, vision: VisionArch, dtype: torch.dtype) -> torch.nn.Module:
    """The family's vision tower and merger, randomly initialised (a checkpoint fills it)."""
    import transformers

    assert m.vision is not None
    # Plain JSON values: a config composed by Hydra holds OmegaConf containers, which
    # transformers' strict config classes refuse.
    config = getattr(transformers, vision.config_class)(**_plain(m.vision.tower))
    config._attn_implementation = "sdpa"
    module = getattr(transformers, vision.tower_class)._from_config(config, dtype=dtype)
    module.requires_grad_(m.train_vision)
    return module


def image_embeddings(
    tower: torch.nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The merged embeddings ``[tokens, hidden]`` of every image, image after image, and
    the tower's deepstack embeddings (one such tensor per deepstack layer; none without)."""
    dtype = next(tower.parameters()).dtype
    out = tower(pixel_values.to(dtype), grid_thw=grid_thw)
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


class InterleavedMRoPE(MultimodalRotaryEmbedding):
    """Qwen3-VL's multimodal RoPE, which Megatron-Core 0.16 lacks: frequency pair j takes
    the height position when ``j % 3 == 1`` and ``j < 3 * sections[1]``, the width position
    when ``j % 3 == 2`` and ``j < 3 * sections[2]``, and the temporal one otherwise (not
    three contiguous sections). Context parallelism is refused for these models."""

    def forward(
        self,
        position_ids: torch.Tensor,
        mrope_section: list[int],
        cp_group: ProcessGroup | None = None,
    ) -> torch.Tensor:
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        out = freqs[0].clone()  # [b, s, dim / 2]
        for plane in (1, 2):
            pairs = slice(plane, mrope_section[plane] * 3, 3)
            out[..., pairs] = freqs[plane, ..., pairs]
        emb = torch.cat((out, out), dim=-1)
        return emb[..., None, :].transpose(0, 1).contiguous()  # [s, b, 1, dim]


class VisionGPTModel(GPTModel):
    """``GPTModel`` whose first stage splices image embeddings into the decoder's input,
    and adds the deepstack embeddings to the outputs of its first layers."""

    # Set by attach() (annotations only: a class-level value would shadow the submodule
    # nn.Module keeps in _modules): the tower, on the first stage, and this micro-batch's
    # deepstack embeddings with where they go ([s, b] slots of this rank), read by the
    # hooks on the first layers during its forward.
    visual: torch.nn.Module | None
    _stack: tuple[list[torch.Tensor], torch.Tensor] | None

    def attach(self, tower: torch.nn.Module | None, vision: VisionArch) -> None:
        """Give the model its family's vision side: the tower on the first stage (its
        grads summed over TP under SP), Qwen3-VL's RoPE and deepstack hooks."""
        self.visual = tower if self.pre_process else None
        self._stack = None
        if self.visual is not None and self.config.sequence_parallel:
            for p in self.visual.parameters():  # summed over TP in finalize_model_grads
                setattr(p, "sequence_parallel", True)  # noqa: B010 (not a declared attribute)
        if vision.interleaved:
            self.rotary_pos_emb = InterleavedMRoPE(
                kv_channels=self.config.kv_channels, rotary_percent=1.0,
                rotary_base=self.rotary_base, cp_group=self.pg_collection.cp,
            )  # fmt: skip
        deep = len(getattr(self.visual, "deepstack_visual_indexes", None) or [])
        for i in range(deep):
            self.decoder.layers[i].register_forward_hook(partial(self._deepstack, i))

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
        *,
        vision: VisionInput | None = None,
    ) -> torch.Tensor:
        if vision is not None and self.visual is not None and decoder_input is None:
            decoder_input = self.spliced(input_ids, vision)
        try:
            return super().forward(
                input_ids, position_ids, attention_mask, decoder_input=decoder_input,
                labels=labels, packed_seq_params=packed_seq_params,
            )  # fmt: skip
        finally:
            self._stack = None

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
        feats, deep = image_embeddings(self.visual, vision.pixel_values, vision.grid_thw)
        used = int((vision.slots >= 0).sum())
        if used != feats.shape[0]:
            raise ValueError(
                f"{used} image-pad positions for {feats.shape[0]} image embeddings "
                f"(grid_thw={vision.grid_thw.tolist()})"
            )
        where = slots >= 0
        emb = emb.clone()
        emb[where] = feats[slots[where]].to(emb.dtype)
        self._stack = (deep, slots) if deep else None
        return emb

    def _deepstack(
        self,
        layer: int,
        module: torch.nn.Module,
        args: tuple[object, ...],
        output: tuple[torch.Tensor, torch.Tensor | None],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer ``layer``'s output (hidden states, context) with its deepstack embedding
        added at the images."""
        if self._stack is None:
            return output
        deep, slots = self._stack
        hidden, context = output
        where = slots >= 0
        hidden = hidden.clone()
        hidden[where] = hidden[where] + deep[layer][slots[where]].to(hidden.dtype)
        return hidden, context
