"""HF <-> Megatron conversion: logits parity with transformers and bit-exact round trips.

Tiny random models are made locally with transformers, converted at every TP x PP in
{1,2}^2 on gloo ranks, loaded into the Megatron trainer, and their logits compared with
transformers' own forward on the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl.runtime.launch import spawn
from rl.weights.convert import hf_to_mcore, mcore_to_hf, prepare_hf_to_mcore
from tests.helpers.hf_models import SHAPES, hf_logits, make_model, make_tokenizer
from tests.helpers.workers import convert_then_logits, random_batches, run_layout

TOKENS = torch.randint(0, SHAPES["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {k: make_model(k, root / k) for k in ("llama", "llama_tied", "qwen2")}


CASES = [("llama", 1, 1), ("llama", 1, 2), ("llama", 2, 1), ("llama", 2, 2)]
CASES += [("llama_tied", 2, 2), ("qwen2", 2, 2)]


@pytest.mark.parametrize(("kind", "tp", "pp"), CASES, ids=[f"{k}-tp{t}pp{p}" for k, t, p in CASES])
def test_megatron_logits_match_transformers(models, tmp_path, kind: str, tp: int, pp: int):
    """Logits at every layout; at TP=2 x PP=2 with a padded vocab (99 -> 128) also the
    trainer's log softmax(logits / T) of the next token over the real vocabulary (what
    SGLang reports as the behaviour log-prob) at two temperatures."""
    hf = models[kind]
    m, dtype = prepare_hf_to_mcore(str(hf), tp, pp, vocab_multiple=128, dtype=None)
    out = str(tmp_path / "mcore")
    temps = (1.0, 0.7) if (kind, tp, pp) == ("llama", 2, 2) else ()
    res = spawn(convert_then_logits, tp * pp, str(hf), out, m, tp, pp, dtype, TOKENS, temps)
    got = res[0]["logits"]
    assert got.shape == (2, 24, 128)  # vocab 99 padded to 128
    want = hf_logits(hf, TOKENS)
    assert (got[..., : SHAPES["vocab_size"]] - want).abs().max() < 1e-4
    assert all(len(r["summary"]["peak_rss_mb"]) == tp * pp for r in res)
    nxt = torch.roll(TOKENS, -1, dims=1)
    for t in temps:
        expect = torch.log_softmax(want / t, -1).gather(-1, nxt[..., None])[..., 0]
        for r in res:
            assert (r["logprobs"][t][:, :-1] - expect[:, :-1]).abs().max() < 1e-4, t


def _assert_same_tensors(a: Path, b: Path) -> None:
    def load_dir(p: Path) -> dict[str, torch.Tensor]:
        out = {}
        for f in sorted(p.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    ta, tb = load_dir(a), load_dir(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name].dtype == tb[name].dtype, name
        assert torch.equal(ta[name], tb[name]), name


def test_round_trip_hf_megatron_tp2pp2_hf_is_bit_exact_in_bf16(tmp_path):
    """bf16 kept bf16, sharded export, tokenizer and config carried (the fp32 round trip of
    every family is tests/multiproc/test_architectures.py's)."""
    dtype = torch.bfloat16
    src = make_model("qwen2", tmp_path / "src", dtype=dtype, seed=3)
    tok = make_tokenizer(tmp_path / "tok")
    summary = hf_to_mcore(str(src), str(tmp_path / "mcore"), tp=2, pp=2)
    assert len(summary["peak_rss_mb"]) == 4
    back = tmp_path / "back"
    s = mcore_to_hf(str(tmp_path / "mcore"), str(back), None, None, 200_000, str(tok))
    assert s["shards"] > 1 and (back / "model.safetensors.index.json").exists()
    assert "tokenizer.json" in s["tokenizer_files"]
    _assert_same_tensors(src, back)
    cfg_src = json.loads((src / "config.json").read_text())
    cfg_back = json.loads((back / "config.json").read_text())
    for k in ("architectures", "hidden_size", "num_key_value_heads", "vocab_size", "eos_token_id"):
        assert cfg_back[k] == cfg_src[k], k
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(back)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == dtype
    assert transformers.AutoTokenizer.from_pretrained(back).eos_token == "w2"


def test_trained_megatron_checkpoint_exports_to_hf(tmp_path):
    """After training at TP=2 the exported HF model gives the trainer's own log-probs."""
    batches = random_batches(2)
    overrides = ["trainer.micro_batch_size=2", "trainer.global_batch_size=8"]
    ckpt = str(tmp_path / "trained")
    res = spawn(run_layout, 2, [*overrides, "trainer.tp=2"], batches, None, None, False, ckpt)
    hf_dir = tmp_path / "hf"
    mcore_to_hf(ckpt, str(hf_dir))
    tokens = batches[0].tokens
    logp = torch.log_softmax(hf_logits(hf_dir, tokens), dim=-1)
    hf_lp = logp[:, :-1].gather(-1, tokens[:, 1:, None])[..., 0]
    mega_lp = res[0]["logprobs"][-1][:, :-1]
    scored = batches[0].loss_mask[:, :-1].bool()  # the trainer gives 0 past a row's last one
    assert (hf_lp - mega_lp)[scored].abs().max() < 1e-5
