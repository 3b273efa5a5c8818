"""Rank functions for the MoE tests: a tiny Megatron-Core GPTModel with MoE layers.

Module level, so spawned ranks import them. Every function here runs in a rank that
``rl.runtime.launch.spawn`` set up (CPU patches applied, gloo default group joined).
Weights are deterministic per *global* parameter name (a local expert is named by its
global index), so any expert-parallel layout starts from the same model.
"""

from __future__ import annotations

import re
import zlib
from typing import Any

import torch

VOCAB = 128
SEQ = 8
ROWS = 4  # the fixed batch; with EP=2 (and DP=2 for the dense weights) each rank takes 2
NUM_LAYERS = 2
NUM_EXPERTS = 4
AUX_COEFF = 1e-2


def moe_config(dispatcher: str, tp: int = 1, ep: int = 1, **overrides: Any) -> Any:
    """The tiny MoE model's TransformerConfig, as the trainer builds it
    (rl/models/megatron_gpt.py: fp32, the CPU fusion flags off), with the dispatcher under
    test and Megatron's defaults for the loss scaling and sequence parallelism."""
    import dataclasses

    from rl.config.schema import ModelConfig, TrainerConfig
    from rl.models.megatron_gpt import transformer_config

    m = ModelConfig(
        name="moe_patch_test",
        architecture="Qwen3MoeForCausalLM",
        num_layers=NUM_LAYERS,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        qk_norm=True,
        num_experts=NUM_EXPERTS,
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        moe_aux_loss_coeff=AUX_COEFF,
    )
    base = transformer_config(m, TrainerConfig(tp=tp, ep=ep))
    return dataclasses.replace(
        base,
        moe_token_dispatcher_type=dispatcher,
        moe_aux_loss_coeff=AUX_COEFF,
        calculate_per_token_loss=False,
        sequence_parallel=False,
        **overrides,
    )


def build_moe_gpt(config: Any) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=False,
        qk_layernorm=True,
        normalization="RMSNorm",
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
    )


def init_parallel(tp: int = 1, ep: int = 1, seed: int = 1234) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def _moe_layers(model: Any) -> list[Any]:
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def global_param_names(model: Any) -> dict[str, str]:
    """Local parameter name -> the name it has in the EP=1 model (global expert index)."""
    out = {}
    for li, layer in enumerate(model.decoder.layers):
        indices = getattr(layer.mlp, "local_expert_indices", None)
        prefix = f"decoder.layers.{li}.mlp.experts.local_experts."
        for name, _ in layer.named_parameters(prefix=f"decoder.layers.{li}"):
            m = re.match(re.escape(prefix) + r"(\d+)\.(.*)", name)
            out[name] = f"{prefix}{indices[int(m[1])]}.{m[2]}" if m else name
    for name, _ in model.named_parameters():
        out.setdefault(name, name)
    return out


def deterministic_init(model: Any) -> None:
    """Set every weight from a generator seeded by its global name (TP=1 shapes)."""
    names = global_param_names(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(zlib.crc32(names[name].encode()))
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "layernorm" in name or name.endswith("final_layernorm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.05 * noise)


def fixed_batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=g)


def _sync_grads(model: Any) -> None:
    """Sum gradients over the data-parallel group (expert weights: the expert-DP group)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dense, expert = ps.get_data_parallel_group(), ps.get_expert_data_parallel_group()
    for p in model.parameters():
        if p.grad is None:
            continue
        group = dense if getattr(p, "allreduce", True) else expert
        if dist.get_world_size(group) > 1:
            dist.all_reduce(p.grad, group=group)


def train_moe(dispatchers: list[str], ep: int, steps: int = 3, lr: float = 1e-2) -> dict:
    """Train the tiny MoE model ``steps`` Adam steps on the fixed batch for each dispatcher.

    With EP=1 (one rank) the batch runs as ``ROWS // 2``-row micro-batches accumulated
    into one step; with EP=2 each rank takes one such micro-batch (data parallel for the
    dense weights, expert parallel for the experts), which is the same computation. The
    main loss is the token sum over the global token count; the router's aux loss is
    added per micro-batch by Megatron (MoEAuxLossAutoScaler, scale 1).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe import moe_utils

    init_parallel(tp=1, ep=ep)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batch = fixed_batch()
    micro = ROWS // 2
    chunks = [batch[i : i + micro] for i in range(0, ROWS, micro)]
    mine = chunks[dp_rank::dp]
    total_tokens = ROWS * SEQ
    out: dict[str, Any] = {
        "ep_size": ps.get_expert_model_parallel_world_size(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "dp_size": dp,
    }
    for dispatcher in dispatchers:
        moe_utils.clear_aux_losses_tracker()
        model = build_moe_gpt(moe_config(dispatcher, ep=ep))
        deterministic_init(model)
        model.train()
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        losses, aux = [], []
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            step_loss = torch.zeros(())
            for chunk in mine:
                tokens, labels = chunk[:, :-1], chunk[:, 1:]
                pos = torch.arange(SEQ).unsqueeze(0).expand_as(tokens)
                per_token = model(tokens, pos, None, labels=labels)
                loss = per_token.sum() / total_tokens
                loss.backward()
                step_loss += loss.detach()
            _sync_grads(model)
            opt.step()
            dist.all_reduce(step_loss, group=ps.get_data_parallel_group())
            losses.append(step_loss.item())
            # Megatron's own logging path: reduce over ranks, scale by 1/micro-batches.
            logged: dict[str, torch.Tensor] = {}
            moe_utils.track_moe_metrics(
                loss_scale=1.0 / len(mine),
                iteration=0,
                total_loss_dict=logged,
                num_layers=NUM_LAYERS,
            )
            aux.append(logged["load_balancing_loss"].item())
        layer0 = model.decoder.layers[0].mlp
        out[dispatcher] = {
            "losses": losses,
            "aux_losses": aux,
            "local_expert_indices": list(layer0.local_expert_indices),
            "expert_params": sorted(
                n for n, _ in model.named_parameters() if ".mlp.experts." in n and ".0.mlp" in n
            ),
            "local_params": sum(p.numel() for p in model.parameters()),
        }
    return out


def _error(fn: Any) -> str:
    """Run ``fn``; return "ok" or the exception's type name (and first line)."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return "ok"


def _forward_loss(dispatcher: str) -> float:
    model = build_moe_gpt(moe_config(dispatcher))
    deterministic_init(model)
    tokens = fixed_batch()
    pos = torch.arange(SEQ).unsqueeze(0).expand(ROWS, SEQ)
    per_token = model(tokens[:, :-1], pos, None, labels=tokens[:, 1:])
    loss = per_token.mean()
    loss.backward()
    return loss.item()


def patch_checks() -> dict:
    """One rank, spawned ``fresh`` with ``setup=False`` (nothing patched): the MoE failures
    without the three MoE patches, then each patch applied twice, then the same calls with
    them applied."""
    from datetime import timedelta

    import torch.distributed as dist

    import megatron_patches as mp
    from megatron_patches import moe_cuda_stream, moe_split_sizes, moe_te_gemm

    moe = (moe_te_gemm, moe_cuda_stream, moe_split_sizes)
    base = [p.apply() for p in mp.PATCHES if p not in moe]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    init_parallel(tp=1, ep=1)

    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    def dispatcher() -> Any:
        return token_dispatcher.MoEAlltoAllTokenDispatcher(
            NUM_EXPERTS,
            list(range(NUM_EXPERTS)),
            moe_config("alltoall"),
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        )

    def splits_all_to_all(splits: Any) -> list[float]:
        x = torch.arange(3.0)
        y = torch.empty(3)
        dist.all_to_all_single(y, x, output_split_sizes=splits, input_split_sizes=splits)
        return y.tolist()

    def host_splits() -> Any:
        return token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([3]), as_numpy=True)

    out: dict[str, Any] = {"base_applied": all(base)}
    out["before"] = {
        "has_te_general_gemm": hasattr(moe_utils, "te_general_gemm"),
        "forward_allgather": _error(lambda: _forward_loss("allgather")),
        "alltoall_dispatcher": _error(dispatcher),
        "dtoh_stream": repr(token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream),
        "host_splits_type": type(host_splits()).__name__,
        "all_to_all_tensor_splits": _error(lambda: splits_all_to_all(host_splits())),
    }
    out["first"] = [p.apply() for p in moe]
    out["second"] = [p.apply() for p in moe]
    out["applied"] = sorted(set(mp.applied()) & {p.NAME for p in moe})
    stream = token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
    t = torch.tensor([1, 2])
    out["after"] = {
        "te_general_gemm": repr(moe_utils.te_general_gemm),
        "forward_allgather": _forward_loss("allgather"),
        "forward_alltoall": _forward_loss("alltoall"),
        "alltoall_dispatcher": _error(dispatcher),
        "stream_is_cuda": isinstance(stream, torch.cuda.Stream),
        "stream_ops": [
            repr(stream.wait_stream(torch.cuda.current_stream())),
            repr(stream.record_event().synchronize()),
        ],
        "host_splits": repr(host_splits()),
        "host_splits_type": type(host_splits()).__name__,
        "not_numpy_is_same": token_dispatcher.maybe_move_tensor_to_cpu(t) is t,
        "moe_utils_original_kept": moe_utils.maybe_move_tensor_to_cpu(t, as_numpy=True) is t,
        "all_to_all_numpy_splits": splits_all_to_all(host_splits()),
    }
    return out
