"""Core attention through ``torch.nn.functional.scaled_dot_product_attention``.

Why: the local spec's core attention (Megatron-Core's ``DotProductAttention``) multiplies
out the whole ``[b, heads, s, s]`` score matrix, softmaxes it and keeps it for the
backward: at 4k tokens that is most of a layer's activation memory and time. torch's SDPA
dispatches to fused kernels that never hold the matrix (flash / cuDNN / memory-efficient on
CUDA, a flash kernel on CPU), with grouped-query attention handled inside the kernel
(``enable_gqa``) instead of by repeating the key and value heads.

This module keeps ``DotProductAttention``'s interface (constructor arguments, forward
signature, Megatron's ``[s, b, heads, dim]`` layout in and ``[s, b, heads * dim]`` out) and
its arithmetic: scores ``q.k * softmax_scale``, causal unless a mask is given, a boolean
mask meaning "masked out" where given. Packed sequences (``packed_seq_params`` in the
"thd" format) and context parallelism (the attention's ``cp`` group) go through
rl/models/packed_attention.py. What it cannot do the same way it refuses at build time,
in one line: attention dropout, sliding windows, softmax variants other than "vanilla",
and (at call time) attention bias, or context parallelism without packed sequences.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from rl.models.packed_attention import packed_attention

if TYPE_CHECKING:
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

NAME = "sdpa"


class SDPAttention(MegatronModule):
    """Drop-in core attention for the local layer spec (see the module docstring)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        *,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        refuse(dropout > 0, f"attention dropout {dropout} (config.attention_dropout)")
        refuse(config.softmax_type != "vanilla", f"softmax_type={config.softmax_type!r}")
        refuse(
            is_layer_window_attention(
                config.window_size, config.window_attn_skip_freq, layer_number
            ),
            f"sliding-window attention (window_size={config.window_size})",
        )
        # The caller's groups, never Megatron's globals (SelfAttention always passes them).
        if pg_collection is None or not hasattr(pg_collection, "tp"):
            raise ValueError("SDPAttention needs the attention's pg_collection (with tp)")
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        cp = getattr(pg_collection, "cp", None)
        self.cp_group = cp if cp is not None and cp.size() > 1 else None
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        tp = self.tp_group.size()
        heads, groups = config.num_attention_heads, config.num_query_groups
        if heads % tp or groups % tp or heads % groups:
            raise ValueError(
                f"SDPAttention: {heads} heads and {groups} query groups must split over TP={tp}"
            )
        self.heads_per_partition = heads // tp
        self.groups_per_partition = groups // tp
        head_dim = config.kv_channels
        self.hidden_size_per_partition = head_dim * self.heads_per_partition
        # DotProductAttention's scale. Its query-key layer scaling divides the scores by the
        # layer number and multiplies them back inside the softmax: the net scale is this.
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """``query [sq, b, np, hn]``, ``key``/``value [sk, b, ng, hn]`` -> ``[sq, b, np*hn]``.

        ``attn_mask_type`` is ignored, as in ``DotProductAttention``: the type given at
        construction decides. A given ``attention_mask`` (bool, True = masked out,
        broadcastable to ``[b, np, sq, sk]``) replaces the causal mask, as Megatron's
        softmax does; without one, a causal layer is causal whenever ``sq > 1``."""
        if attention_bias is not None:
            raise ValueError("SDPAttention does not take an attention_bias")
        gqa = self.heads_per_partition != self.groups_per_partition
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd" or attention_mask is not None:
                raise ValueError("SDPAttention takes packed sequences in the thd format, unmasked")
            # [t, np, hn] (Megatron squeezed the batch of one) -> [t, np * hn]
            out = packed_attention(query, key, value, packed_seq_params.cu_seqlens_q,
                                   self.softmax_scale, gqa, self.cp_group)  # fmt: skip
            return out.reshape(out.shape[0], self.hidden_size_per_partition)
        if self.cp_group is not None:
            raise ValueError("SDPAttention runs context parallelism on packed sequences only")
        sq, sk = query.shape[0], key.shape[0]
        mask = None
        causal = False
        if attention_mask is not None:
            if attention_mask.dtype != torch.bool:
                raise ValueError(
                    f"SDPAttention takes a boolean attention_mask, got {attention_mask.dtype}"
                )
            mask = ~attention_mask  # SDPA: True = may attend
        elif self.attn_mask_type == AttnMaskType.causal and sq > 1:
            # One query position (decoding with a KV cache) attends to every key, as in
            # Megatron; otherwise SDPA's causal mask is the top-left aligned one, which is
            # Megatron's only when the query and key lengths agree.
            if sq != sk:
                raise ValueError(f"causal SDPAttention needs sq == sk, got {sq} and {sk}")
            causal = True
        # [s, b, n, d] -> [b, n, s, d]: views, no copies; the kernels take strided inputs.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        extra: dict[str, Any] = {}
        if gqa:
            extra["enable_gqa"] = True
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=causal,
            scale=self.softmax_scale, **extra,
        )  # fmt: skip
        # [b, np, sq, hn] -> [sq, b, np * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, out.shape[0], self.hidden_size_per_partition)

    def sharded_state_dict(
        self,
        prefix: str = "",
        sharded_offsets: tuple[tuple[int, int, int], ...] = (),
        metadata: dict | None = None,
    ) -> dict:
        """Nothing to checkpoint: no parameters or buffers (vanilla softmax only)."""
        return {}


def refuse(cond: bool, what: str) -> None:
    if cond:
        raise ValueError(
            f"trainer.attention={NAME!r} does not support {what}: "
            "set trainer.attention=dot_product (Megatron's DotProductAttention)"
        )


__all__ = ["SDPAttention"]
