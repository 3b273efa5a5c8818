"""Scalar-head models (reward models, critics): HF ``*ForSequenceClassification`` checkpoints
of one label, converted through the family registry and run by the Megatron trainer, give
transformers' own scores.

The tiny random checkpoints are made here with transformers; each is converted at the
layout of the case on gloo ranks, loaded into a frozen trainer, and its value of every
token compared with ``score(hidden)`` from transformers' forward, and each sequence's score
where the reward model pools it (rl/companion/reward_model.py) with
``AutoModelForSequenceClassification``'s logits (transformers' own pooling).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl.companion.reward_model import scored_positions, sequence_scores
from rl.models.hf_fields import HFConfigError
from rl.runtime.launch import spawn
from rl.weights.convert import hf_to_mcore, mcore_to_hf, prepare_hf_to_mcore
from tests.helpers.hf_models import SHAPES, make_model
from tests.helpers.workers import convert_then_values

# The models' pad id is 0 (make_model): transformers scores each row's rightmost token that
# is not 0. Row 0 ends in pad ids (a response that ended in the pad id), row 1 has pad ids
# inside, row 2 none.
TOKENS = torch.randint(3, SHAPES["vocab_size"], (3, 20), generator=torch.Generator().manual_seed(5))
TOKENS[0, -3:] = 0
TOKENS[1, [4, 11, 12]] = 0
PAD = 0
CASES = [("llama", 1, 1), ("llama", 2, 1), ("llama", 1, 2), ("qwen2", 2, 1), ("qwen3", 1, 2)]
SP = ("trainer.sequence_parallel=true",)  # the head sees each rank's slice of the sequence


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("score")
    return {k: make_model(k, root / k, seed=11, score=True) for k in ("llama", "qwen2", "qwen3")}


def hf_scores(path: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(every token's value ``[B, S]``, the sequence scores ``[B]``) from transformers."""
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        hidden = model.model(tokens).last_hidden_state
        return model.score(hidden)[..., 0], model(tokens).logits[:, 0]


@pytest.mark.parametrize(
    ("kind", "tp", "pp", "more"),
    [(*c, ()) for c in CASES] + [("llama", 2, 1, SP)],
    ids=[f"{k}-tp{t}pp{p}" for k, t, p in CASES] + ["llama-tp2pp1-sp"],
)
def test_scores_match_transformers(models, tmp_path, kind: str, tp: int, pp: int, more: tuple):
    hf = models[kind]
    m, dtype = prepare_hf_to_mcore(str(hf), tp, pp, vocab_multiple=128, dtype=None)
    assert m.architecture.endswith("ForSequenceClassification"), m.architecture
    got = spawn(convert_then_values, tp * pp, str(hf), str(tmp_path / "mcore"), m, tp, pp, dtype,
                TOKENS, more)  # fmt: skip
    values, scores = hf_scores(hf, TOKENS)
    assert scores.abs().min() > 1e-3  # a real score, not a zero head
    assert (values[0, -1] - scores[0]).abs() > 1e-3  # the pad id's value is not the score
    at = scored_positions(TOKENS.tolist(), PAD)
    for rank_values in got:  # every rank returns the whole batch's values
        assert rank_values.shape == TOKENS.shape
        assert (rank_values - values).abs().max() < 1e-4
        assert (torch.tensor(sequence_scores(rank_values, at)) - scores).abs().max() < 1e-4


def test_a_classifier_of_two_labels_is_refused_in_one_line(models, tmp_path):
    """A ``*ForSequenceClassification`` with transformers' default two labels is a
    classifier, not a scalar reward: refused before any rank starts."""
    bad = tmp_path / "two_labels"
    bad.mkdir()
    for f in models["llama"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["id2label"] = {"0": "LABEL_0", "1": "LABEL_1"}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFConfigError) as err:
        prepare_hf_to_mcore(str(bad), 1, 1, vocab_multiple=128, dtype=None)
    assert str(err.value) == (
        "config.json: num_labels=2 (id2label) is not supported for "
        "LlamaForSequenceClassification: a reward model or critic has one label, its score "
        "(num_labels=1)"
    )


def test_round_trip_hf_megatron_tp2pp2_hf_keeps_the_score_head_bit_exact(models, tmp_path):
    """A reward model converted to Megatron at TP=2 x PP=2 and back is the same HF
    ``*ForSequenceClassification`` of one label, every tensor bit for bit."""
    src = models["qwen2"]
    hf_to_mcore(str(src), str(tmp_path / "mcore"), tp=2, pp=2)
    back = tmp_path / "back"
    mcore_to_hf(str(tmp_path / "mcore"), str(back))
    cfg = json.loads((back / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForSequenceClassification"]
    assert len(cfg["id2label"]) == 1
    want, got = _tensors(src), _tensors(back)
    assert sorted(got) == sorted(want) and "score.weight" in got
    for name, t in want.items():
        assert torch.equal(got[name], t), name


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out
