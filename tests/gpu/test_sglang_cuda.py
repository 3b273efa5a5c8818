"""DDMA over ``cuda_ipc`` into live SGLang servers on one CUDA GPU: a bf16 server, and an
FP8 server (blockwise 128, built from its checkpoint's FP8 config with dummy weights, as
``rollout=gpu_fp8`` starts it), each with a small share of the GPU's memory.

After one sync from a "trainer rank" in this process (its shards on the GPU, perturbed
from the servers' start so the sync must change them), each server holds exactly the
trainer's weights: every parameter read back through SGLang's ``/get_weights_by_name``
equals, bit for bit, what SGLang's own loaders make of the same weights (bf16), or of the
same weights quantized by SGLang's own block quantizer (FP8). Then each decodes greedily,
and transformers (float32, CPU) scores the served tokens on the same weights (for FP8 the
dequantized ones): the log-prob differences stay within the stated bounds, which cover
bf16 arithmetic, and for FP8 its per-token activation quantization as well.

Not yet run on a GPU when written (no device was lent): the bounds are first guesses, to
be set from the first run's printed figures.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rl.ddma import fp8
from rl.ddma.plan import DstLayout, SrcLayout, make_plan
from rl.generator.ddma_target import SGLangTarget
from rl.serving import server_api as api
from rl.serving.launcher import ServerConfig, ServerLauncher, fp8_serving_dir
from tests.helpers.ddma_util import megatron_globals, megatron_shards, model_dims
from tests.helpers.hf_reference import HFReferenceGenerator
from tests.helpers.sglang_reference import sglang_rank_params, write_fp8_checkpoint

BLOCK = 128
# Widths in whole 128-blocks: q 256 rows (4 heads x 64), k and v 128 each, MLP 512.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
             max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
             tie_word_embeddings=False)  # fmt: skip
PROMPTS = [[1, 5, 6, 7, 8], [1, 40, 41, 42], [1, 300, 12, 60, 700]]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
# |served - transformers| log-prob of the served tokens (first guesses: see the docstring).
BF16_MAX, FP8_MEAN, FP8_MAX = 0.15, 0.25, 1.5
MEMORY = ("--mem-fraction-static", "0.2")  # two servers and this process share the GPU


def _write_hf(path: Path, state: dict[str, torch.Tensor] | None = None) -> Path:
    import transformers

    cfg = transformers.LlamaConfig(**SHAPE)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    if state is not None:
        model.load_state_dict(state)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The servers' start (bf16) and the trainer's weights (perturbed), as HF dirs."""
    root = tmp_path_factory.mktemp("sglang_cuda")
    start = _write_hf(root / "start")
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(1)
    state = {n: t.float() + 0.02 * torch.randn(t.shape, generator=g)
             for n, t in load_file(str(start / "model.safetensors")).items()}  # fmt: skip
    trained = _write_hf(root / "trained", state)
    return {"root": root, "start": start, "trained": trained}


def _sync(url: str, keys: api.ServerKeys, trained: Path, fp8_block: int | None) -> None:
    """One trainer rank (TP 1) DDMAs ``trained`` from GPU shards over cuda_ipc."""
    from safetensors.torch import load_file

    d = model_dims(trained, src_tp=1)
    hf = {n: t.float() for n, t in load_file(str(trained / "model.safetensors")).items()}
    plan = make_plan(d, SrcLayout(1), DstLayout.sglang(1, "cuda"), 2, 1 << 20, fp8_block)
    shards = {k: v.to("cuda", torch.bfloat16)
              for k, v in megatron_shards(megatron_globals(hf, d), plan, 0).items()}  # fmt: skip
    target = SGLangTarget(url, plan, torch.bfloat16, keys=keys, transport="cuda_ipc",
                          device="cuda")  # fmt: skip
    target.begin(1)
    stats = target.push(0, lambda k, i: shards[(k, i)], 1)
    target.commit(1)
    assert stats.payload_bytes == plan.dst_bytes(), stats


def _held(url: str, keys: api.ServerKeys, name: str) -> torch.Tensor:
    reply = api.call(
        url, api.Call("/get_weights_by_name", {"name": name, "truncate_size": 1 << 30}), keys
    )
    return torch.tensor(reply, dtype=torch.float32)


def _served_gap(url: str, keys: api.ServerKeys, ref: HFReferenceGenerator) -> list[float]:
    """|served - transformers| log-prob of every token each prompt decodes greedily."""
    gaps = []
    for prompt in PROMPTS:
        out = api.call(url, api.generate([prompt], [GREEDY]), keys, timeout=120)
        served = [lp for lp, *_ in out["meta_info"]["output_token_logprobs"]]
        want = ref.score(prompt, out["output_ids"])
        gaps += [abs(a - b) for a, b in zip(served, want, strict=True)]
    return gaps


def _server(model_path: Path, logs: Path, load_format: str | None = None) -> ServerLauncher:
    cfg = ServerConfig(model_path=str(model_path), device="cuda", dtype="bfloat16",
                       extra_args=MEMORY, startup_timeout=600)  # fmt: skip
    return ServerLauncher(replace(cfg, load_format=load_format), n=1, log_dir=logs)


def test_cuda_ipc_into_a_bf16_server(models):
    with _server(models["start"], models["root"] / "logs_bf16") as launcher:
        url, keys = launcher.urls[0], launcher.keys
        _sync(url, keys, models["trained"], None)
        want = sglang_rank_params(models["trained"], 1, 0)
        for name, t in want.items():
            got = _held(url, keys, name)
            assert torch.equal(got, t.to(torch.bfloat16).float()), name
        gaps = _served_gap(url, keys, HFReferenceGenerator(models["trained"]))
    print(f"bf16: log-prob gap max {max(gaps):.4f} mean {sum(gaps) / len(gaps):.4f}")
    assert max(gaps) < BF16_MAX


def test_cuda_ipc_into_an_fp8_server(models):
    root = models["root"]
    served = fp8_serving_dir(models["start"], root / "start_fp8", BLOCK)
    assert json.loads((served / "config.json").read_text())["quantization_config"]
    with _server(served, root / "logs_fp8", load_format="dummy") as launcher:
        url, keys = launcher.urls[0], launcher.keys
        _sync(url, keys, models["trained"], BLOCK)
        quantized = write_fp8_checkpoint(models["trained"], root / "trained_fp8", BLOCK)
        want = sglang_rank_params(quantized, 1, 0)
        for name, t in want.items():
            if not name.endswith((".k_scale", ".v_scale")):
                got = _held(url, keys, name)
                assert torch.equal(got, t.float()), name
        ref = HFReferenceGenerator(models["trained"])
        ref.load_weights(_dequantized(quantized))
        gaps = _served_gap(url, keys, ref)
    mean = sum(gaps) / len(gaps)
    print(f"fp8: log-prob gap max {max(gaps):.4f} mean {mean:.4f}")
    assert mean < FP8_MEAN and max(gaps) < FP8_MAX


def _dequantized(quantized: Path) -> list[tuple[str, torch.Tensor]]:
    """The FP8 checkpoint's weights as the server computes with them (HF names)."""
    from safetensors.torch import load_file

    state = load_file(str(quantized / "model.safetensors"))
    out = []
    for name, t in state.items():
        if name.endswith("weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale = state[name.removesuffix("weight") + "weight_scale_inv"]
            t = fp8.dequantize_blockwise(t, scale, BLOCK)
        out.append((name, t.float()))
    return out
