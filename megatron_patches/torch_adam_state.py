"""Patch: resuming a ``fully_reshardable`` DistributedOptimizer checkpoint with torch Adam.

Why: without Transformer Engine or apex, Megatron-Core falls back to ``torch.optim.Adam``,
whose per-parameter state carries a ``step`` tensor. Two bugs follow on load:
1. ``DistributedOptimizer.load_state_dict`` re-creates ``step`` from the checkpoint's param
   groups, then ``_set_main_param_and_optimizer_states`` copies *every* key of the live
   state from the loaded tensors, which hold only ``param``/``exp_avg``/``exp_avg_sq``:
   KeyError 'step'. The replacement copies the keys the checkpoint provides.
2. It assigns *one shared* ``step`` tensor to every parameter; torch Adam's foreach update
   increments each parameter's step in place, so the shared tensor advances once per
   parameter and every later bias correction is wrong. After loading, each parameter
   gets its own copy.
Replaces: ``DistributedOptimizer._set_main_param_and_optimizer_states`` (non-precision-aware
branch; otherwise the original runs) and wraps ``DistributedOptimizer.load_state_dict``.
Versions: megatron-core 0.16.1 without TE/apex (TE's FusedAdam has no per-param ``step``).
Tested by tests/multiproc/test_checkpoint.py::test_resume_with_optimizer_state_is_exact.
"""

from __future__ import annotations

import torch

from megatron_patches._util import once, replace_attr

NAME = "torch_adam_state"


def apply() -> bool:
    def _do() -> None:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DO

        original = DO._set_main_param_and_optimizer_states

        def _set_states(self, model_param, tensors):
            if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                return original(self, model_param, tensors)
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            dst = {"param": main_param, **self.optimizer.state[main_param]}
            missing = set(dst) - set(tensors) - {"step"}
            if missing:
                raise KeyError(f"optimizer checkpoint lacks state {sorted(missing)}")
            for key, value in dst.items():
                if key in tensors:
                    value.copy_(tensors[key])
            return None

        original_load = DO.load_state_dict

        def _load_state_dict(self, state_dict):
            out = original_load(self, state_dict)
            for st in self.optimizer.state.values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"] = st["step"].clone()
            return out

        replace_attr(DO, "_set_main_param_and_optimizer_states", _set_states)
        replace_attr(DO, "load_state_dict", _load_state_dict)

    return once(NAME, _do)
