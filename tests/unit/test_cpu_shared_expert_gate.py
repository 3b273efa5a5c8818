"""The CPU patch of Qwen2-MoE's gated shared expert (rl/serving/cpu_shared_expert_gate.py)
on a stand-in for SGLang's ``qwen2_moe`` module: torch computes what transformers'
``Qwen2MoeSparseMoeBlock`` adds, in place where the kernel writes in place. The live
server's parity with transformers is tests/servers/test_ddma_sglang_families.py."""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from rl.serving import cpu_shared_expert_gate as gate


def _kernel(*args: object) -> None:
    raise RuntimeError("0 active drivers ([]). There should only be one.")


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hidden, shared, routed = (torch.randn(5, 16, generator=g) for _ in range(3))
    return hidden, torch.randn(16, generator=g), shared, routed


def _transformers(hidden: torch.Tensor, w: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """transformers 5.19's ``Qwen2MoeSparseMoeBlock``: ``shared_expert_gate`` is a
    ``Linear(hidden, 1, bias=False)``."""
    return F.sigmoid(F.linear(hidden, w.view(1, -1))) * shared


def test_qwen2_moes_gate_runs_in_torch_and_nothing_else_changes(capsys):
    module = ModuleType(gate.QWEN2_MOE)
    module.fused_gate_sigmoid_mul_add = _kernel  # type: ignore[attr-defined]
    module.fused_gate_sigmoid_mul = _kernel  # type: ignore[attr-defined]
    module.other = _kernel  # type: ignore[attr-defined]
    gate.patch_qwen2_moe(module)
    gate.patch_qwen2_moe(module)  # idempotent
    assert module.fused_gate_sigmoid_mul_add is gate.gate_sigmoid_mul_add  # type: ignore[attr-defined]
    assert module.fused_gate_sigmoid_mul is gate.gate_sigmoid_mul  # type: ignore[attr-defined]
    assert module.other is _kernel  # type: ignore[attr-defined]
    assert capsys.readouterr().err == ""

    hidden, w, shared, routed = _inputs()
    want = routed + _transformers(hidden, w, shared)
    out = routed.clone()
    ptr = out.data_ptr()
    assert module.fused_gate_sigmoid_mul_add(hidden, w, shared, out) is None  # type: ignore[attr-defined]
    assert out.data_ptr() == ptr  # in place, as the kernel writes
    assert (out - want).abs().max() < 1e-6
    before = (hidden.clone(), shared.clone())
    alone = module.fused_gate_sigmoid_mul(hidden, w, shared)  # type: ignore[attr-defined]
    assert torch.equal(alone, _transformers(hidden, w, shared))
    assert torch.equal(hidden, before[0]) and torch.equal(shared, before[1])


def test_a_module_without_the_names_is_left_alone_and_the_log_says_so(capsys):
    module = ModuleType(gate.QWEN2_MOE)
    module.fused_gate_sigmoid_mul = _kernel  # type: ignore[attr-defined]
    gate.patch_qwen2_moe(module)
    assert module.fused_gate_sigmoid_mul is _kernel  # type: ignore[attr-defined]
    assert not hasattr(module, "fused_gate_sigmoid_mul_add")
    err = capsys.readouterr().err
    assert "fused_gate_sigmoid_mul_add gone: not patched" in err
