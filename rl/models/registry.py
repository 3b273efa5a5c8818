"""The architecture registry: every family module under ``rl/models/families/``.

A family is one module that defines ``ARCH`` (an :class:`rl.models.arch.Arch`); the registry
finds them by listing the package, so adding a family adds one module and nothing else here.
Lookups fail in one line naming the unknown value and the supported ones.
"""

from __future__ import annotations

from functools import cache

from rl.models import families
from rl.models.arch import Arch, Dims, TensorSpec, causal_class, spec_numel
from rl.plugins import discover


class UnknownArchitecture(ValueError):
    """An architecture or model_type no family module declares."""


@cache
def architectures() -> dict[str, Arch]:
    """HF class name -> Arch, for every module in ``rl/models/families``."""
    return discover(families, "ARCH", lambda arch: arch.hf_class)


def supported() -> str:
    return ", ".join(sorted(architectures()))


def get(hf_class: str, field: str = "model.architecture") -> Arch:
    """The family of an HF class name, with the LM head or a scalar one
    (``LlamaForSequenceClassification`` is the llama family's)."""
    arch = architectures().get(causal_class(hf_class))
    if arch is None:
        raise UnknownArchitecture(
            f"{field}={hf_class!r} is not supported (supported: {supported()})"
        )
    return arch


def by_model_type(model_type: str, field: str = "model_type") -> Arch:
    for arch in architectures().values():
        if arch.model_type == model_type:
            return arch
    types = ", ".join(sorted(a.model_type for a in architectures().values()))
    raise UnknownArchitecture(f"{field}={model_type!r} is not supported (supported: {types})")


def tensors(d: Dims) -> list[TensorSpec]:
    """The model's tensors as its family declares them (its ``Arch.tensors``)."""
    return get(d.arch, "architecture").tensors(d)


def count(d: Dims, tp: int = 1, ep: int = 1, per_layer: bool = True) -> int:
    """Elements of one layer's tensors (``per_layer``) or of the globals, as held by one rank
    of TP ``tp`` and EP ``ep`` (split tensors / tp, experts / ep)."""
    n = 0
    for s in tensors(d):
        if s.per_layer != per_layer:
            continue
        k = spec_numel(s, d)
        if s.tp_dim is not None:
            k //= tp
        if s.expert:
            k //= ep
        n += k
    return n


def expert_count(d: Dims) -> int:
    """Elements of one layer's routed experts, all of them."""
    return sum(spec_numel(s, d) for s in tensors(d) if s.expert)


def active_count(d: Dims, topk: int) -> int:
    """Parameters one token goes through per layer (top-k of the experts)."""
    if not d.experts:
        return count(d)
    return count(d) - expert_count(d) * (d.experts - topk) // d.experts
