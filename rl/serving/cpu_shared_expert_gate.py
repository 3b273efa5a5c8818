"""Qwen2-MoE's gated shared expert on SGLang's CPU servers (imported at start-up in every
process of a CPU server, by the ``sitecustomize`` that rl/serving/cpu_shim.py writes).

Why: SGLang's ``Qwen2MoeSparseMoeBlock.forward`` (``sglang/srt/models/qwen2_moe.py``)
adds the shared expert's output to the routed experts' through
``fused_gate_sigmoid_mul_add``, a Triton kernel, whenever the block has a shared-expert
gate and its backend is neither Intel AMX nor an NPU. A CPU server here has neither, and
Triton has no CPU driver: a tiny Qwen2-MoE died in its first forward, at start-up
("RuntimeError: 0 active drivers ([]). There should only be one."). The out-of-place
``fused_gate_sigmoid_mul`` (the deferred-finalize and dual-stream paths) is the same
kernel.

What it replaces, once ``sglang.srt.models.qwen2_moe`` is imported: that module's own
names ``fused_gate_sigmoid_mul_add`` and ``fused_gate_sigmoid_mul`` (what the block
calls), with torch on the same arguments: ``out += sigmoid(hidden @ w) * shared``, the
sum transformers' ``Qwen2MoeSparseMoeBlock`` takes. The kernels' own module, and every
other model that imports them from it, keep the kernels; the blocks that reuse Qwen2-MoE's
block class (Qwen3-Next, Qwen3.5) resolve the names in ``qwen2_moe`` and get torch too.
Versions: sglang 0.5.23. Without SGLang, or if those names are gone, it does nothing and
says so in the server's log.

Standard library only at import time: it runs before anything else in the process.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING

from rl.serving.after_import import patch_on_import

if TYPE_CHECKING:
    import torch

QWEN2_MOE = "sglang.srt.models.qwen2_moe"
NAMES = ("fused_gate_sigmoid_mul_add", "fused_gate_sigmoid_mul")


def _gated(hidden: torch.Tensor, gate_weight: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """``sigmoid(hidden @ gate_weight) * shared``, one gate per token (a ``[1, hidden]``
    linear, as transformers' ``shared_expert_gate``)."""
    import torch
    import torch.nn.functional as F

    return torch.sigmoid(F.linear(hidden, gate_weight.view(1, -1))) * shared


def gate_sigmoid_mul_add(
    hidden_states: torch.Tensor,
    gate_weight: torch.Tensor,
    shared_output: torch.Tensor,
    final_hidden_states: torch.Tensor,
) -> None:
    """``fused_gate_sigmoid_mul_add`` in torch: the gated shared expert added in place to
    the routed experts' output."""
    final_hidden_states += _gated(hidden_states, gate_weight, shared_output)


def gate_sigmoid_mul(
    hidden_states: torch.Tensor, gate_weight: torch.Tensor, shared_output: torch.Tensor
) -> torch.Tensor:
    """``fused_gate_sigmoid_mul`` in torch: the gated shared expert, a new tensor."""
    return _gated(hidden_states, gate_weight, shared_output)


TORCH = {NAMES[0]: gate_sigmoid_mul_add, NAMES[1]: gate_sigmoid_mul}


def patch_qwen2_moe(module: ModuleType) -> None:
    """Torch for the gated shared expert in ``module`` (idempotent)."""
    missing = [n for n in NAMES if n not in vars(module)]
    if missing:
        print(f"[cpu_shared_expert_gate] {QWEN2_MOE}.{', '.join(missing)} gone: not patched; "
              "a Qwen2-MoE with a shared-expert gate may fail on CPU", file=sys.stderr)  # fmt: skip
        return
    vars(module).update(TORCH)


def install() -> None:
    """Patch Qwen2-MoE's block as its module is imported (idempotent)."""
    patch_on_import({QWEN2_MOE: patch_qwen2_moe})
