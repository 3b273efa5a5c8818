"""Build a Megatron-Core ``GPTModel`` from a ModelConfig of any registered family.

Uses the local (Megatron-Core only) layer spec with RMSNorm, SwiGLU, GQA and RoPE, so it
runs on CPU; with Transformer Engine present on a GPU machine the TE spec is used instead.
The local spec's core attention is torch's fused scaled-dot-product attention unless
``trainer.attention=dot_product``, and its norms train in the parameters' dtype.
The family's options are model data (``qkv_bias``, ``qk_norm``, ``head_dim``, experts),
mapped here one to one onto Megatron's spec and TransformerConfig: no family names.
Weights are initialised on CPU from one master tensor per weight and then split, which
makes the initial model identical for every tensor-parallel size (same seed).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from megatron_patches import cuda_to_cpu
from rl.config.dtypes import torch_dtype
from rl.models import registry
from rl.models.arch import has_score_head
from rl.models.shapes import kv_channels, padded_vocab_size, sequence_parallel

if TYPE_CHECKING:  # Megatron is imported only after megatron_patches.apply_all
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rl.config.schema import ModelConfig, TrainerConfig


def have_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # TE raises OSError, not ImportError, when CUDA libraries are missing
        return False
    return torch.cuda.is_available()


def transformer_config(
    m: ModelConfig, t: TrainerConfig, initialize: bool = True
) -> TransformerConfig:
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = torch_dtype(t.params_dtype)
    return TransformerConfig(
        **moe_options(m, t),
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        kv_channels=kv_channels(m),
        normalization="RMSNorm",
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=m.qkv_bias,
        qk_layernorm=m.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=m.init_method_std,
        tensor_model_parallel_size=t.tp,
        pipeline_model_parallel_size=t.pp,
        context_parallel_size=t.cp,
        sequence_parallel=sequence_parallel(m, t.tp, t.sequence_parallel),
        **recompute_options(t.recompute),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=True,
        perform_initialization=initialize,
        # Loss is a token sum; Megatron divides by the global token count across
        # microbatches and DP ranks, so any (micro)batching gives the same gradient.
        calculate_per_token_loss=True,
        # Fusions that need CUDA kernels.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        mrope_section=list(m.vision.mrope_section) if m.vision is not None else None,
    )


def recompute_options(recompute: str) -> dict[str, object]:
    """TransformerConfig fields of ``trainer.recompute``: ``full`` checkpoints every layer
    on its own (the layer's input is kept; its forward runs again in the backward)."""
    if recompute == "none":
        return {}
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def moe_options(m: ModelConfig, t: TrainerConfig) -> dict[str, object]:
    """TransformerConfig fields of a Mixture-of-Experts model (none for a dense one).

    Routing matches HF's: softmax over the router logits, top-k, renormalised when
    ``moe_norm_topk_prob`` (Megatron: top-k of the logits, then softmax over them) and
    otherwise the softmax over all experts (``moe_router_pre_softmax``). No token is dropped
    (no capacity factor), and the load-balancing loss is Switch-style ``aux_loss``."""
    if not m.num_experts:
        return {}
    # Under sequence parallelism (MoE with TP > 1) Megatron-Core 0.16 scales the aux-loss
    # gradient by the *local* token count, 1/tp of the sequence (router.py,
    # attach_and_log_load_balancing_loss with calculate_per_token_loss): times tp restores
    # the configured weight. Measured: TP=2 then matches TP=1 losses to 3e-7 over 5 steps,
    # and differs by 2e-4 without it.
    sp = t.tp if t.tp > 1 else 1
    return dict(
        num_moe_experts=m.num_experts,
        moe_ffn_hidden_size=m.moe_ffn_hidden_size,
        moe_router_topk=m.moe_router_topk,
        moe_router_pre_softmax=not m.moe_norm_topk_prob,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=m.moe_aux_loss_coeff * sp,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_shared_expert_intermediate_size=m.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=m.shared_expert_gate,
        expert_model_parallel_size=t.ep,
    )


def layer_spec(m: ModelConfig, attention: str = "sdpa") -> ModuleSpec:
    """Transformer Engine's spec when TE imports on a GPU (its own fused attention and
    norms); otherwise Megatron's local spec, whose core attention is ``attention``:
    ``sdpa`` (torch's fused scaled-dot-product kernels, rl/models/sdpa_attention.py) or
    ``dot_product`` (Megatron's ``DotProductAttention``, which holds the score matrix)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    options = dict(
        num_experts=m.num_experts or None, moe_grouped_gemm=False, qk_layernorm=m.qk_norm
    )
    if have_transformer_engine():
        return specs.get_gpt_layer_with_transformer_engine_spec(**options)
    spec = specs.get_gpt_layer_local_spec(normalization="RMSNorm", **options)
    if attention == "sdpa":
        from rl.models.sdpa_attention import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    elif attention != "dot_product":
        raise ValueError(f"trainer.attention={attention!r} must be 'sdpa' or 'dot_product'")
    return spec


def norms_in_compute_dtype(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Put the local spec's torch norms (``torch.nn.RMSNorm``/``LayerNorm``) in ``dtype``.

    Why: Megatron builds them in torch's default dtype, float32, and casts them to bf16 only
    through its ``Float16Module`` wrapper, which this trainer does not use. A bf16 input
    with a float32 weight makes torch skip its fused norm kernel (it warns "Cannot
    dispatch to fused implementation") for the slower composite one. In ``dtype`` they
    become like every other parameter: Megatron's mixed-precision optimizer keeps their
    float32 master copy and writes the rounded value back after each step, as for the
    linear weights. In float32 training this changes nothing, bit for bit. TE's norms
    are built in ``params_dtype`` already and are not torch norms.
    """
    for mod in model.modules():
        if isinstance(mod, torch.nn.RMSNorm | torch.nn.LayerNorm):
            mod.to(dtype)  # in place: the Parameter objects (and their attributes) stay


def build_gpt(
    m: ModelConfig,
    t: TrainerConfig,
    pre_process: bool,
    post_process: bool,
    pg_collection: ProcessGroupCollection,
    initialize: bool = True,
) -> GPTModel:
    """The model chunk for this pipeline stage (all layers of the stage, one chunk).

    ``initialize=False`` skips random init (weights are about to be overwritten, e.g. by a
    checkpoint converter), which matters for large models on CPU. A scalar-head
    architecture (``*ForSequenceClassification``) gets a :mod:`rl.models.score_head` in
    place of the LM head, and outputs ``[b, s, 1]`` values.
    """
    from megatron.core.models.gpt import GPTModel

    score = has_score_head(m.architecture)
    rs = m.rope_scaling  # validate_model checked it against Megatron's fixed constants
    config = transformer_config(m, t, initialize)
    cls: type[GPTModel] = GPTModel
    vision = registry.get(m.architecture).vision
    if vision is not None:  # a vision-language model: multimodal RoPE, a vision tower
        from rl.models.vision.model import VisionGPTModel, build_tower

        cls = VisionGPTModel
    # Tied embeddings under PP move the shared weight with .cuda() while building.
    with cuda_to_cpu():
        model = cls(
            config=config,
            transformer_layer_spec=layer_spec(m, t.attention),
            vocab_size=padded_vocab_size(m),
            max_sequence_length=m.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=m.tie_embeddings and not score,
            position_embedding_type="rope" if vision is None else "mrope",
            rotary_base=int(m.rotary_base),
            rope_scaling=rs is not None,
            rope_scaling_factor=rs.factor if rs is not None else 8.0,
            pg_collection=pg_collection,
        )
        if vision is not None:  # inside: Qwen3-VL's RoPE asks for the current device
            assert isinstance(model, VisionGPTModel)
            model.attach(build_tower(m, vision, config.params_dtype) if pre_process else None,
                         vision)  # fmt: skip
    if score:
        from rl.models import score_head

        score_head.attach(model, m.init_method_std, t.seed)
    norms_in_compute_dtype(model, config.params_dtype)
    return model
