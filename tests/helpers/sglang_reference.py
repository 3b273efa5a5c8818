"""SGLang's own per-rank parameters for a Hugging Face checkpoint: the reference for resharding.

Why: the resharding planner (rl/ddma) must deliver, to generator rank ``rank`` of a TP
``tp`` SGLang server, exactly the tensors SGLang's loaders would have produced from the full
checkpoint. Checking it against a second hand-written slicer would only test that two
copies of our assumptions agree, so this module takes every slice from SGLang itself: its
model class (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``MistralForCausalLM``, ``Qwen3MoeForCausalLM``, ``Qwen2MoeForCausalLM``) is built with the
real layer classes, which size their per-rank parameters, and SGLang's ``DefaultModelLoader``
feeds the full checkpoint tensors through the model's ``load_weights`` and the layers' weight
loaders (QKV with KV-head replication, merged gate/up, row-parallel, vocab-parallel with
padding, replicated QK-norms and MoE router, and FusedMoE's per-expert loader, which stacks
each expert's gate/up into ``w13_weight`` and its down into ``w2_weight``).
Nothing here is imported from ``rl/`` but the architecture registry's name of the SGLang
module that defines each architecture (``Arch.sglang_module``) and, for FP8 checkpoints,
the list of weights an FP8 engine quantizes: every slice and every FP8 byte still comes
from SGLang.

How TP is faked, in one process, without a GPU or a process group (SGLang 0.5.23):

* ``create_context(ServerArgs(tp_size=tp, device="cpu"), ranks=SpawnRanks(world_rank=rank))``
  is SGLang's own way to build a model-owned runtime context without replacing the
  process-wide one; from the rank it derives ``tp_rank``, ``attn_tp_rank`` and the rest, and
  ``use_context`` activates it only for the duration of the call.
* No process groups exist, so ``get_parallel().override(...)`` (a scoped override) installs
  metadata-only stand-ins for the TP, attention-TP, MoE-TP, MoE-EP and pipeline groups,
  carrying ``rank_in_group`` / ``world_size`` as SGLang's test fixture
  ``sglang/test/parallel_groups.py`` does. The layers read their partition from these, and
  ``get_tensor_model_parallel_rank`` / ``_world_size`` answer ``rank`` / ``tp``. Attention-TP
  and MoE-TP are the TP stand-in itself, as ``initialize_model_parallel`` aliases them when
  their widths equal TP; MoE-EP is one rank wide (SGLang's default ``ep_size`` 1).
* MoE: ``FusedMoE`` takes its placement from the context's ``moe_tp_rank`` / ``moe_tp_size``
  / ``moe_ep_rank`` / ``moe_ep_size``, which ``create_context`` derives from ``ep_size`` 1 as
  (rank, tp) and (0, 1); they are checked before the model is built. The MoE backend flags
  (``get_moe_a2a_backend()`` / ``get_moe_runner_backend()``) live in the context's
  ``flags.moe``: a context that never ran ``initialize_moe_config`` lazily answers ``none`` /
  ``auto`` and records that in the created context only, not in the process-wide one. No
  shared-expert fusion happens (it needs CUDA or aiter), so Qwen2-MoE keeps its separate
  ``shared_expert`` MLP and ``shared_expert_gate``.
* ``vllm._custom_ops`` (imported by SGLang's rotary embedding when it is built off CUDA) is
  served by a stub from a temporary directory that is on ``sys.path`` only during the call.

The linear layers take their rank from the group (``tp_group.rank_in_group``), the
vocab-parallel embedding and LM head from the context's ``tp_rank``; both are checked to agree
with ``rank`` before the model is built, as they do in a real server.

Scope: the weight loaders run the branch a CUDA server runs (``SGLANG_USE_CPU_ENGINE`` unset;
with it set, SGLang takes CPU-engine branches that pad non-divisible shards, FusedMoE
included), and the default legacy ``load_weights`` (``SGLANG_ENABLE_WEIGHT_LOADER_V2`` unset;
the v2 loader gave identical tensors for llama, llama_tied and qwen2 at TP 1, 2 and 4 when
checked). The config is the checkpoint's as a GPU server sees it: a ``device="cpu"`` server
additionally runs ``adjust_config_with_unaligned_cpu_tp`` (model_runner.py), which pads
``intermediate_size`` / ``moe_intermediate_size`` / ``shared_expert_intermediate_size`` to a
multiple of 32*tp and the head counts when TP does not divide them; that is not applied here,
so e.g. llama's ``gate_up_proj`` is (352, 64) here at TP 1 but (384, 64) = [gate; 0; up; 0]
on a CPU server.

Nothing is monkeypatched; the scoped context, ``sys.path``, ``sys.modules['vllm*']`` and the
environment variables that ``ServerArgs`` resolution writes are all restored on return.

Parameters start as NaN before loading, so an element SGLang's loaders never write (SGLang
allocates with ``torch.empty``) comes back NaN instead of as arbitrary memory. Vocabulary
padding rows are written by SGLang as zeros.

FP8: a checkpoint whose config carries a blockwise-FP8 ``quantization_config`` (DeepSeek-V3
/ Qwen3-FP8 style: e4m3 weights plus ``weight_scale_inv``; :func:`write_fp8_checkpoint`
makes one) is built with SGLang's ``Fp8Config`` and loaded through the model's
``load_weights``, so the FP8 linear and FusedMoE loaders place every weight and scale, as
a weight update into an FP8 server does. ``process_weights_after_loading`` is skipped: it
only re-lays the weights for the GPU's kernels. FP8 parameters start as zeros (NaN has
no e4m3fn bit pattern that survives a comparison of bytes), scales as NaN.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

_VLLM_STUB = '''"""Stub of vllm._custom_ops written by tests/helpers/sglang_reference.py.

SGLang's RotaryEmbedding imports rotary_embedding from here when it is built off CUDA; the
reference only loads weights and never runs a forward, so it is never called.
"""


def rotary_embedding(*args, **kwargs):
    raise RuntimeError("vllm._custom_ops stub (tests/helpers/sglang_reference.py): never called")
'''

_CACHE: dict[tuple, dict[str, torch.Tensor]] = {}


@dataclass(frozen=True)
class _GroupStandIn:
    """Placement metadata of a process group that was never built.

    The layers only read ``rank_in_group`` / ``world_size`` while being built and loaded;
    anything that would communicate (``cpu_group``, ``device_group``) is None so that an
    accidental collective fails loudly instead of hanging.
    """

    rank_in_group: int
    world_size: int
    ranks: list[int] = field(default_factory=list)
    cpu_group: None = None
    device_group: None = None

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1


@contextlib.contextmanager
def _vllm_stub_on_path() -> Iterator[None]:
    """Make ``vllm._custom_ops`` importable for the duration of the block, then undo it.

    The real vLLM wheel is CUDA-only; a stub left in ``sys.modules`` would shadow it for the
    rest of the pytest process, so whatever was (not) imported before is put back.
    """
    saved_modules = {k: v for k, v in sys.modules.items() if k == "vllm" or k.startswith("vllm.")}
    with tempfile.TemporaryDirectory(prefix="sglang_ref_stub_") as root:
        pkg = Path(root) / "vllm"
        pkg.mkdir()
        (pkg / "__init__.py").write_text(
            '"""Stub package (tests/helpers/sglang_reference.py)."""\n'
        )
        (pkg / "_custom_ops.py").write_text(_VLLM_STUB)
        sys.path.insert(0, root)
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):
                sys.path.remove(root)
            for k in [k for k in sys.modules if k == "vllm" or k.startswith("vllm.")]:
                del sys.modules[k]
            sys.modules.update(saved_modules)


@contextlib.contextmanager
def _environ_restored() -> Iterator[None]:
    """Undo the environment variables SGLang's ServerArgs resolution sets (e.g.
    ``SGLANG_ENABLE_TORCH_COMPILE=0``), so they do not leak into other tests."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        for k in [k for k in os.environ if k not in saved]:
            del os.environ[k]
        for k, v in saved.items():
            if os.environ.get(k) != v:
                os.environ[k] = v


def _hf_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, full (unsharded), as read by safetensors."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no *.safetensors")
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, st.get_tensor(name)


def _model_class(architecture: str) -> type[torch.nn.Module]:
    """Resolved from the module's own ``EntryClass`` list instead of SGLang's ModelRegistry,
    which imports every model SGLang ships (several seconds, noisy import errors on CPU)."""
    from rl.models import registry

    module = importlib.import_module(registry.get(architecture, "architecture").sglang_module)
    entries = module.EntryClass  # a class or a list of classes, as SGLang's registry accepts
    by_name = {c.__name__: c for c in (entries if isinstance(entries, list) else [entries])}
    return by_name[architecture]


def _load_rank(model_dir: Path, tp: int, rank: int) -> dict[str, torch.Tensor]:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.runtime_context import SpawnRanks, create_context, get_parallel, use_context
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path=str(model_dir),
        tp_size=tp,
        device="cpu",
        dtype="float32",
        skip_tokenizer_init=True,
    )
    context = create_context(server_args, role="test", ranks=SpawnRanks(world_rank=rank))
    with use_context(context):
        parallel = get_parallel()
        # FusedMoE reads its MoE-TP / MoE-EP placement from these context ranks (not from
        # the groups); with ep_size 1 SGLang makes MoE-TP the whole TP width.
        placed = {
            "tp": (parallel.tp_rank, parallel.tp_size),
            "moe_tp": (parallel.moe_tp_rank, parallel.moe_tp_size),
            "moe_ep": (parallel.moe_ep_rank, parallel.moe_ep_size),
        }
        expected = {"tp": (rank, tp), "moe_tp": (rank, tp), "moe_ep": (0, 1)}
        if placed != expected:
            raise AssertionError(f"SGLang placed world rank {rank} at {placed}, not {expected}")
        model_config = ModelConfig.from_server_args(server_args)
        cls = _model_class(model_config.hf_config.architectures[0])
        tp_group = _GroupStandIn(rank, tp, list(range(tp)))
        groups = {
            "tp_group": tp_group,
            "attn_tp_group": tp_group,
            "moe_tp_group": tp_group,
            "moe_ep_group": _GroupStandIn(0, 1, [rank]),
            "pp_group": _GroupStandIn(0, 1, [rank]),
        }
        with (
            parallel.override(**groups),
            set_default_torch_dtype(torch.float32),
            torch.device("cpu"),
        ):
            # Deprecated in 0.5.23 (the layers read get_parallel()), but still public API.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                legacy = (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())
            if legacy != (rank, tp):
                raise AssertionError(f"legacy TP accessors answer {legacy}, expected {(rank, tp)}")
            quant = getattr(model_config.hf_config, "quantization_config", None)
            fp8 = None
            if quant is not None:
                from sglang.srt.layers.quantization.fp8 import Fp8Config

                fp8 = Fp8Config.from_config(dict(quant))
            model = cls(config=model_config.hf_config, quant_config=fp8)
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(0.0 if p.dtype == torch.float8_e4m3fn else float("nan"))
            if fp8 is not None:  # the loaders only (see the module docstring)
                model.load_weights(_hf_weights(model_dir))
                _load_dropped_block_scales(model, _hf_weights(model_dir))
            else:
                DefaultModelLoader.load_weights_and_postprocess(
                    model, _hf_weights(model_dir), torch.device("cpu")
                )
    return {name: p.detach().to("cpu", copy=True) for name, p in model.named_parameters()}


# The stacked-parameter mapping of SGLang's Llama loader (models/llama.py).
_STACKED = [(".qkv_proj", ".q_proj", "q"), (".qkv_proj", ".k_proj", "k"),
            (".qkv_proj", ".v_proj", "v"), (".gate_up_proj", ".gate_proj", 0),
            (".gate_up_proj", ".up_proj", 1)]  # fmt: skip


def _load_dropped_block_scales(
    model: torch.nn.Module, weights: Iterator[tuple[str, torch.Tensor]]
) -> None:
    """SGLang 0.5.23's Llama loaders (legacy and v2) rename every ``.weight_scale_inv`` to
    ``.weight_scale`` (a per-tensor FP8 checkpoint's name), so the scales of a blockwise
    checkpoint never reach the ``weight_scale_inv`` its FP8 layers hold (they stay NaN
    here). Those are fed through the layers' own weight loaders, by the loader's mapping."""
    params = dict(model.named_parameters())
    for name, w in weights:
        if not name.endswith(".weight_scale_inv"):
            continue
        target, shard = name, None
        for fused, part, shard_id in _STACKED:
            if part in name:
                target, shard = name.replace(part, fused), shard_id
                break
        p = params.get(target)
        if p is None or not p.isnan().any():
            continue  # loaded by the model's own load_weights (or not a parameter)
        args = () if shard is None else (shard,)
        p.weight_loader(p, w, *args)  # type: ignore[attr-defined]


def write_fp8_checkpoint(src: Path, dst: Path, block: int) -> Path:
    """A copy of the HF checkpoint ``src`` in ``dst`` with every linear weight an FP8 engine
    quantizes stored as blockwise e4m3 plus its ``weight_scale_inv``, quantized by SGLang's
    own ``bf16_to_block_fp8_128`` (the DeepSeek-V3 contract, any block), and the config's
    ``quantization_config`` saying so. Which weights: rl/ddma/fp8.py's list (a weight SGLang
    does not quantize would fail its loader with an unexpected scale)."""
    import json
    import shutil

    from safetensors.torch import save_file
    from sglang.srt.layers.quantization.mxfp8_block_convert import bf16_to_block_fp8_128

    from rl.ddma.fp8 import is_quantized_weight

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    out: dict[str, torch.Tensor] = {}
    for name, t in _hf_weights(src):
        if is_quantized_weight(name):
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = (
                bf16_to_block_fp8_128(t, block)
            )
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _cache_key(model_dir: Path, tp: int, rank: int) -> tuple:
    """Include file stamps so a checkpoint rewritten in place is not served stale."""
    stamps = tuple(
        (f.name, f.stat().st_mtime_ns, f.stat().st_size)
        for f in sorted(model_dir.iterdir())
        if f.suffix in (".json", ".safetensors")
    )
    return (str(model_dir), tp, rank, stamps)


def sglang_rank_params(model_dir: str | Path, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """``{SGLang parameter name: tensor}`` held by TP rank ``rank`` of ``tp`` after SGLang
    loads the full Hugging Face checkpoint in ``model_dir`` (float32, CPU, cloned).

    Names are SGLang's ``model.named_parameters()`` (``model.layers.0.self_attn.qkv_proj
    .weight``, ``...mlp.gate_up_proj.weight``, ``lm_head.weight`` only when untied; for MoE
    ``...mlp.experts.w13_weight`` (E, 2*I/tp, H), ``...mlp.experts.w2_weight`` (E, H, I/tp),
    the replicated router ``...mlp.gate.weight`` and, for Qwen2-MoE,
    ``...mlp.shared_expert.{gate_up,down}_proj.weight`` and ``...mlp.shared_expert_gate
    .weight``). Results
    are cached per checkpoint/tp/rank; each call returns fresh clones, so callers may mutate
    them.
    """
    model_dir = Path(model_dir).resolve()
    if tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is not a rank of tp={tp}")
    key = _cache_key(model_dir, tp, rank)
    if key not in _CACHE:
        with _environ_restored(), _vllm_stub_on_path():
            _CACHE[key] = _load_rank(model_dir, tp, rank)
    return {name: t.clone() for name, t in _CACHE[key].items()}
