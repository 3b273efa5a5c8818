"""What an architecture is, as data: its tensors, their layouts, and its HF config map.

Every consumer (HF <-> Megatron conversion, the DDMA planner, the memory planner, the
trainer's model builder, config validation, the SGLang reference in the tests) reads a model
through two objects defined here:

* :class:`Dims`, the shape facts of one model (taken from a ``ModelConfig``);
* :class:`TensorSpec`, one Megatron tensor with its Hugging Face names, its SGLang parameter
  name and its *layout*, which says how it is fused and how tensor parallelism splits it.

:func:`decoder_tensors` lists a decoder's tensors from its :class:`Dims` (QKV bias, QK norm,
dense or Mixture-of-Experts MLP, shared expert, tied embeddings), and :class:`Arch` is what a
family module under ``rl/models/families/`` declares: HF class and ``model_type``, the
SGLang module, the ``ModelConfig`` fields the family fixes, and its ``config.json`` fields
both ways. Parameter counts are sums over the same tensors, so the planner and the
converter cannot disagree on what a model holds.

Key conventions. Per-layer Megatron keys are relative to ``decoder.layers.`` and HF / SGLang
names to ``model.layers.{i}.``. A per-expert tensor has ``{e}`` in its names: Megatron keys
``mlp.experts.{e}.linear_fc1.weight`` (a torch_dist checkpoint stacks them along an expert
axis), HF ``mlp.experts.{e}.gate_proj.weight``, and SGLang ``mlp.experts.w13_weight[{e}]``,
expert ``e``'s slab of SGLang's fused expert parameter.

Pure logic: no torch, no Megatron.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # types only: the config layer sits above this one
    from rl.config.schema import ModelConfig

# Layouts: how a tensor is fused from its HF parts and split by tensor parallelism.
REPLICATED = "replicated"  # whole on every TP rank (norms, the MoE router)
QKV = "qkv"  # rows [q heads of group g | k_g | v_g] per query group; TP splits groups
GATE_UP = "gate_up"  # [gate ; up]; each TP shard is [gate_r ; up_r]
ROW = "row"  # TP splits dim 1 (row-parallel linear)
VOCAB = "vocab"  # TP splits dim 0 of the padded vocabulary

# A model with a scalar head (a reward model, a critic) is named by HF's class for one:
# ``LlamaForSequenceClassification`` is ``LlamaForCausalLM``'s decoder with a ``score``
# linear of one output in place of the LM head.
CAUSAL, SCORE = "ForCausalLM", "ForSequenceClassification"

EMBED = "embedding.word_embeddings.weight"
OUTPUT = "output_layer.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
LAYERS = "decoder.layers."

_EXPERT_INDEX = re.compile(r"\.experts\.(\d+)\.")


class ModelShape(Protocol):
    """What the shape arithmetic reads of a model config: a ``ModelConfig`` or the composed
    ``DictConfig`` of one (this layer does not import the config layer)."""

    architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int | None
    vocab_size: int
    make_vocab_size_divisible_by: int
    tie_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int
    moe_ffn_hidden_size: int | None
    shared_expert_ffn_hidden_size: int
    shared_expert_gate: bool


@dataclass(frozen=True)
class Dims:
    """The shape facts the layouts depend on, taken from a ModelConfig."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    _: KW_ONLY
    groups: int
    head_dim: int
    vocab: int
    padded_vocab: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool = False
    experts: int = 0  # 0: a dense MLP in every layer
    moe_ffn: int = 0  # one expert's intermediate size
    shared_ffn: int = 0  # the shared expert's intermediate size (0: none)
    shared_gate: bool = False  # a sigmoid gate on the shared expert's output
    arch: str = "LlamaForCausalLM"

    @property
    def score_head(self) -> bool:
        """A scalar head (``score.weight``, ``[1, hidden]``) in place of the LM head."""
        return has_score_head(self.arch)

    @classmethod
    def of(cls, m: ModelShape) -> Dims:
        moe = m.num_experts > 0
        return cls(
            layers=m.num_layers,
            hidden=m.hidden_size,
            ffn=m.ffn_hidden_size,
            heads=m.num_attention_heads,
            groups=m.num_query_groups,
            head_dim=kv_channels(m),
            vocab=m.vocab_size,
            padded_vocab=padded_vocab_size(m),
            tied=m.tie_embeddings,
            qkv_bias=m.qkv_bias,
            qk_norm=m.qk_norm,
            experts=m.num_experts,
            moe_ffn=(m.moe_ffn_hidden_size or 0) if moe else 0,
            shared_ffn=m.shared_expert_ffn_hidden_size if moe else 0,
            shared_gate=bool(moe and m.shared_expert_gate),
            arch=m.architecture,
        )

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.groups) * self.head_dim

    def width(self, name: str) -> int:
        """The intermediate size a gate_up/row tensor splits: ffn, moe_ffn or shared_ffn."""
        return getattr(self, name)


@dataclass(frozen=True)
class TensorSpec:
    """One Megatron tensor: per layer (or global), per expert (or not), and its names."""

    key: str
    hf: tuple[str, ...]  # HF names, fused in this order
    sglang: str | None  # SGLang parameter (None: SGLang has no such tensor)
    layout: str
    _: KW_ONLY
    shape: Callable[[Dims], tuple[int, ...]]
    # MLP tensors: the Dims field (ffn, moe_ffn, shared_ffn) of the split dimension, which
    # SGLang may pad on CPU; None for every other tensor.
    width: str | None = None
    per_layer: bool = True
    expert: bool = False

    @property
    def tp_dim(self) -> int | None:
        return {REPLICATED: None, ROW: 1}.get(self.layout, 0)


def _norm(d: Dims) -> tuple[int, ...]:
    return (d.hidden,)


def attention_tensors(d: Dims) -> list[TensorSpec]:
    qkv = "self_attention.linear_qkv."
    out = [
        TensorSpec(
            qkv + "layer_norm_weight", ("input_layernorm.weight",), "input_layernorm.weight",
            REPLICATED, shape=_norm,
        ),
        TensorSpec(
            qkv + "weight",
            ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
            "self_attn.qkv_proj.weight", QKV, shape=lambda d: (d.qkv_rows, d.hidden),
        ),
    ]  # fmt: skip
    if d.qkv_bias:
        hf = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")
        out.append(
            TensorSpec(
                qkv + "bias", hf, "self_attn.qkv_proj.bias", QKV, shape=lambda d: (d.qkv_rows,)
            )
        )
    if d.qk_norm:
        for x in "qk":
            out.append(
                TensorSpec(
                    f"self_attention.{x}_layernorm.weight", (f"self_attn.{x}_norm.weight",),
                    f"self_attn.{x}_norm.weight", REPLICATED, shape=lambda d: (d.head_dim,),
                )
            )  # fmt: skip
    out.append(
        TensorSpec(
            "self_attention.linear_proj.weight", ("self_attn.o_proj.weight",),
            "self_attn.o_proj.weight", ROW, shape=lambda d: (d.hidden, d.heads * d.head_dim),
        )
    )  # fmt: skip
    return out


def _swiglu(key: str, hf: str, sglang: str | None, width: str, expert: bool) -> list[TensorSpec]:
    """fc1 ([gate ; up]) and fc2 of a SwiGLU MLP; ``key``/``hf``/``sglang`` are prefixes
    (``sglang`` None: SGLang's fused expert slabs, named by the caller's convention)."""
    up = sglang + "gate_up_proj.weight" if sglang is not None else None
    down = sglang + "down_proj.weight" if sglang is not None else None
    if expert:
        up, down = f"{hf}w13_weight[{{e}}]", f"{hf}w2_weight[{{e}}]"
        hf = hf + "{e}."
    return [
        TensorSpec(
            key + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"), up,
            GATE_UP, shape=lambda d: (2 * d.width(width), d.hidden), width=width, expert=expert,
        ),
        TensorSpec(
            key + "linear_fc2.weight", (hf + "down_proj.weight",), down, ROW,
            shape=lambda d: (d.hidden, d.width(width)), width=width, expert=expert,
        ),
    ]  # fmt: skip


def mlp_tensors(d: Dims) -> list[TensorSpec]:
    # An MoE layer's pre_mlp_layernorm is checkpointed under the dense (fused) name too.
    post = "post_attention_layernorm.weight"
    norm = TensorSpec("mlp.linear_fc1.layer_norm_weight", (post,), post, REPLICATED, shape=_norm)
    if not d.experts:
        return [norm, *_swiglu("mlp.", "mlp.", "mlp.", "ffn", expert=False)]
    out = [
        norm,
        TensorSpec(
            "mlp.router.weight", ("mlp.gate.weight",), "mlp.gate.weight", REPLICATED,
            shape=lambda d: (d.experts, d.hidden),
        ),
        *_swiglu("mlp.experts.{e}.", "mlp.experts.", None, "moe_ffn", expert=True),
    ]  # fmt: skip
    if d.shared_ffn:
        shared = "mlp.shared_expert."
        out += _swiglu("mlp.shared_experts.", shared, shared, "shared_ffn", expert=False)
    if d.shared_gate:
        out.append(
            TensorSpec(
                "mlp.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",),
                "mlp.shared_expert_gate.weight", REPLICATED, shape=lambda d: (1, d.hidden),
            )
        )  # fmt: skip
    return out


def global_tensors(d: Dims) -> list[TensorSpec]:
    vocab = lambda d: (d.padded_vocab, d.hidden)  # noqa: E731
    out = [
        TensorSpec(EMBED, ("model.embed_tokens.weight",), "model.embed_tokens.weight", VOCAB,
                   shape=vocab, per_layer=False),
        TensorSpec(FINAL_NORM, ("model.norm.weight",), "model.norm.weight", REPLICATED, shape=_norm,
                   per_layer=False),
    ]  # fmt: skip
    if d.score_head:  # replicated: one row, on every TP rank whole
        out.append(
            TensorSpec(OUTPUT, ("score.weight",), None, REPLICATED, shape=lambda d: (1, d.hidden),
                       per_layer=False)
        )  # fmt: skip
    elif not d.tied:
        out.append(
            TensorSpec(
                OUTPUT, ("lm_head.weight",), "lm_head.weight", VOCAB, shape=vocab, per_layer=False
            )
        )
    return out


def decoder_tensors(d: Dims) -> list[TensorSpec]:
    """Every tensor of a decoder-only model, globals last."""
    return attention_tensors(d) + mlp_tensors(d) + global_tensors(d)


# ------------------------------------------------------------------ expert indices
def expert_of(key: str) -> int | None:
    """The expert index in a per-expert key or name (None: not per expert)."""
    m = _EXPERT_INDEX.search(key) or re.search(r"\[(\d+)\]$", key)
    return int(m.group(1)) if m else None


def for_expert(name: str, e: int) -> str:
    return name.replace("{e}", str(e))


def template(key: str) -> str:
    """``mlp.experts.3.linear_fc1.weight`` -> ``mlp.experts.{e}.linear_fc1.weight``."""
    return _EXPERT_INDEX.sub(".experts.{e}.", key, count=1)


def has_score_head(architecture: str) -> bool:
    return architecture.endswith(SCORE)


def causal_class(architecture: str) -> str:
    """The family's own (causal LM) class of an HF class name with either head."""
    if has_score_head(architecture):
        return architecture[: -len(SCORE)] + CAUSAL
    return architecture


# ------------------------------------------------------------------ shape arithmetic
def kv_channels(m: ModelShape) -> int:
    """Per-head width: the explicit ``head_dim`` (Qwen3, Mistral) or hidden / heads."""
    return m.head_dim or m.hidden_size // m.num_attention_heads


def padded_vocab_size(m: ModelShape) -> int:
    """Rows of the embedding and output layer: vocab_size rounded up to the padding multiple."""
    mult = m.make_vocab_size_divisible_by
    return -(-m.vocab_size // mult) * mult


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def spec_numel(s: TensorSpec, d: Dims) -> int:
    """Elements of one tensor, all experts included."""
    return _numel(s.shape(d)) * (d.experts if s.expert else 1)


# The fields every MoE family's tiny test model sets beyond the tests' shared tiny shape
# (tests/helpers/hf_models.py; tools/bench/moe_r3.py serves the same model): fewer layers
# keep them fast, and PP=2 still fits.
TINY_MOE = {
    "num_hidden_layers": 2,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
}


@dataclass(frozen=True)
class VisionArch:
    """A vision-language family's image side: transformers' classes for its vision tower
    (held whole on the trainer's first pipeline stage, built from ``ModelConfig.vision``)
    and the prefix of the tower's tensors in an HF checkpoint."""

    tower_class: str
    config_class: str
    _: KW_ONLY
    prefix: str = "visual."
    # Qwen3-VL's multimodal RoPE: the three planes' frequencies interleaved (t h w t h w
    # ...) rather than in three contiguous sections.
    interleaved: bool = False
    # The tower's and merger's parameter count from its HF ``vision_config`` (the
    # planner's; tests/unit/test_vision_config.py checks it against transformers' module).
    params: Callable[[dict], int] = lambda tower: 0


def _same(hf: dict) -> dict:
    return hf


def _flat(out: dict, m: ModelConfig) -> dict:
    return out


@dataclass(frozen=True)
class Arch:
    """One architecture, declared once (in ``rl/models/families/<name>.py``).

    ``fixed`` holds the ModelConfig fields the family determines (a Qwen2 model has QKV
    biases, a Llama model does not): a config that disagrees is refused naming the field.
    ``from_hf(config_json)`` returns the family's ModelConfig fields beyond the common ones
    (refusing what it cannot reproduce, see ``hf_fields``); ``to_hf(model_config)`` the
    family's config.json fields beyond the common ones.
    """

    name: str
    hf_class: str
    model_type: str
    sglang_module: str
    _: KW_ONLY
    fixed: dict[str, bool | int] = field(default_factory=dict)
    from_hf: Callable[[dict], dict] = lambda hf: {}
    to_hf: Callable[[ModelConfig], dict] = lambda m: {}
    moe: bool = False
    # The family's tiny test models (tests/helpers/hf_models.py builds them): a name for
    # each and the HF config fields it sets beyond the tests' shared tiny shape, chosen to
    # exercise what the family adds (tied embeddings, KV layouts, head_dim, experts).
    tiny: dict[str, dict[str, object]] = field(default_factory=dict)
    # A vision-language family: its decoder's fields sit in a nested ``text_config``
    # (``decoder_fields`` gives them, flat, to the common reader) and ``nest`` puts the
    # common writer's flat fields back in that layout.
    vision: VisionArch | None = None
    # Where the decoder's HF names live (the ``model.`` of ``model.layers.{i}.`` and
    # ``model.embed_tokens.weight``): Qwen3-VL writes ``model.language_model.``.
    hf_decoder: str = "model."
    decoder_fields: Callable[[dict], dict] = _same
    nest: Callable[[dict, ModelConfig], dict] = _flat

    def tensors(self, d: Dims) -> list[TensorSpec]:
        return decoder_tensors(d)

    @property
    def score_class(self) -> str:
        """The HF class of this family's decoder with a scalar head."""
        return self.hf_class[: -len(CAUSAL)] + SCORE
