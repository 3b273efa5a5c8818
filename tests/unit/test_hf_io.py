"""Bad Hugging Face input is refused up front, in one line, and leaves no output behind."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers.hf_models import make_model

from rl.config.validate import ConfigError
from rl.weights.convert import prepare_hf_to_mcore
from rl.weights.hf_config import HFConfigError
from rl.weights.hf_io import HFCheckpoint, HFCheckpointError, plan_shards, write_safetensors

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import convert_hf_to_mcore  # noqa: E402
import convert_mcore_to_hf  # noqa: E402


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


def test_cli_errors_are_one_line_and_leave_no_output(tmp_path, llama, capsys):
    out = tmp_path / "out"
    assert convert_hf_to_mcore.main(["--hf-dir", str(llama), "--out", str(out), "--tp", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: trainer.tp=3 does not divide") and "\n" not in err
    assert not out.exists() and not (tmp_path / "out.tmp").exists()
    missing = tmp_path / "nothing"
    assert convert_mcore_to_hf.main(["--ckpt", str(missing), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not out.exists()
    out.mkdir()
    assert convert_hf_to_mcore.main(["--hf-dir", str(llama), "--out", str(out)]) == 2
    assert "exists (pass --force" in capsys.readouterr().err


@pytest.mark.parametrize("tool", [convert_hf_to_mcore, convert_mcore_to_hf])
def test_every_flag_is_documented(tool):
    actions = [a for a in tool.parser()._actions if a.dest != "help"]
    assert actions
    for a in actions:
        assert a.help and len(a.help) > 10, a.dest
    text = tool.parser().format_help()
    for a in actions:
        assert a.option_strings[0] in text


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
    ck = HFCheckpoint(tmp_path)  # read back through the same reader
    assert torch.equal(ck.get("t3"), tensors["t3"])
    assert ck.get_rows("t2", 2, 5).tolist() == [2.0, 2.0, 2.0]
