"""Bad Hugging Face input is refused up front, in one line, and leaves no output behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rl.config.errors import ConfigError
from rl.weights.convert import prepare_hf_to_mcore
from rl.weights.hf_config import HFConfigError
from rl.weights.hf_io import HFCheckpoint, HFCheckpointError, plan_shards, write_safetensors
from tests.helpers.hf_models import make_model


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_model("llama", tmp_path_factory.mktemp("hf") / "llama")


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_good_checkpoint_validates(llama):
    m, dtype = prepare_hf_to_mcore(str(llama), tp=2, pp=2, vocab_multiple=128, dtype=None)
    assert (m.num_layers, m.num_query_groups, m.vocab_size) == (4, 2, 99)
    assert m.make_vocab_size_divisible_by == 128 and dtype == "float32"


def test_missing_config(tmp_path, llama):
    bad = _copy(llama, tmp_path / "m")
    (bad / "config.json").unlink()
    with pytest.raises(HFCheckpointError, match=r"has no config\.json"):
        HFCheckpoint(bad)


def test_missing_weights(tmp_path, llama):
    bad = _copy(llama, tmp_path / "m")
    (bad / "model.safetensors").unlink()
    with pytest.raises(HFCheckpointError, match="only safetensors is supported"):
        HFCheckpoint(bad)


def test_truncated_safetensors(tmp_path, llama):
    bad = _copy(llama, tmp_path / "m")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:-1000])
    with pytest.raises(HFCheckpointError, match=r"model.safetensors is truncated: tensors need"):
        HFCheckpoint(bad)
    (bad / "model.safetensors").write_bytes(data[:20])
    with pytest.raises(HFCheckpointError, match="truncated: header declares"):
        HFCheckpoint(bad)


def test_unsupported_architecture(tmp_path, llama):
    bad = _copy(llama, tmp_path / "m")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFConfigError, match="GPT2LMHeadModel"):
        prepare_hf_to_mcore(str(bad), 1, 1, 128, None)


def test_shape_mismatch_names_the_tensor(tmp_path, llama):
    bad = _copy(llama, tmp_path / "m")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 192
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(HFCheckpointError, match=r"model.layers.0.mlp.gate_proj.weight has shape"):
        prepare_hf_to_mcore(str(bad), 1, 1, 128, None)


def test_tp_that_does_not_divide_heads(llama):
    with pytest.raises(
        ConfigError, match=r"trainer\.tp=3 does not divide model\.num_attention_heads"
    ):
        prepare_hf_to_mcore(str(llama), 3, 1, 128, None)


def test_shard_plan_and_index(tmp_path):
    tensors = {f"t{i}": torch.full((10,), float(i)) for i in range(5)}
    sizes = {n: t.numel() * 4 for n, t in tensors.items()}
    shards = plan_shards(sizes, 100)
    assert shards == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    write_safetensors(tmp_path, iter(tensors.items()), shards)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["t4"] == "model-00003-of-00003.safetensors"
    assert index["metadata"]["total_size"] == 200
    (tmp_path / "config.json").write_text("{}")
    # Readable as config.json is (safetensors alone writes 0600).
    mode = (tmp_path / "config.json").stat().st_mode & 0o777
    assert (tmp_path / "model-00001-of-00003.safetensors").stat().st_mode & 0o777 == mode
    ck = HFCheckpoint(tmp_path)  # read back through the same reader
    assert torch.equal(ck.get("t3"), tensors["t3"])
    assert ck.get_rows("t2", 2, 5).tolist() == [2.0, 2.0, 2.0]
