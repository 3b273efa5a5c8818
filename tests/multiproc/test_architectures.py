"""Every registered family through conversion and the trainer, against transformers.

For each family a tiny random HF model (tests/helpers/hf_models.py) is converted HF -> Megatron on
gloo ranks at one TP x PP (x EP) layout, loaded into the trainer, and its logits compared with
transformers' forward; the checkpoint is then converted back to HF and must equal the
original bit for bit. The layouts together cover TP, PP and EP in {1, 2}: Qwen3 with a
head_dim other than hidden / heads (untied), Qwen3 with one KV head (tied), Mistral, and the
two MoE families (routed experts with EP 2; Qwen2-MoE adds a gated shared expert).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl.runtime.launch import spawn
from rl.weights.convert import mcore_to_hf, prepare_hf_to_mcore
from tests.helpers.hf_models import SHAPES, hf_logits, make_model
from tests.helpers.workers import convert_then_logits

TOKENS = torch.randint(0, SHAPES["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(5))
# (kind, tp, pp, ep)
CASES = [
    ("qwen3", 2, 2, 1),
    ("qwen3_kv1", 1, 2, 1),
    ("mistral", 2, 1, 1),
    ("qwen3_moe", 1, 1, 2),
    ("qwen3_moe", 2, 2, 1),
    ("qwen2_moe", 2, 1, 2),
]


def _tensors(p: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(p.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize(
    ("kind", "tp", "pp", "ep"), CASES, ids=[f"{k}-tp{t}pp{p}ep{e}" for k, t, p, e in CASES]
)
def test_family_converts_and_matches_transformers(tmp_path, kind: str, tp: int, pp: int, ep: int):
    hf = make_model(kind, tmp_path / "hf")
    m, dtype = prepare_hf_to_mcore(str(hf), tp, pp, vocab_multiple=128, dtype=None, ep=ep)
    out = tmp_path / "mcore"
    res = spawn(
        convert_then_logits, tp * pp * ep, str(hf), str(out), m, tp, pp, dtype, TOKENS, (), ep
    )
    want = hf_logits(hf, TOKENS)
    for r in res:
        got = r["logits"][..., : SHAPES["vocab_size"]]
        assert (got - want).abs().max() < 1e-4

    back = tmp_path / "back"
    mcore_to_hf(str(out), str(back))
    src, dst = _tensors(hf), _tensors(back)
    assert sorted(src) == sorted(dst)
    for name, t in src.items():
        assert torch.equal(t, dst[name]), name
    cfg = json.loads((back / "config.json").read_text())
    assert cfg["architectures"] == json.loads((hf / "config.json").read_text())["architectures"]
    assert hf_logits(back, TOKENS).sub(want).abs().max() == 0
