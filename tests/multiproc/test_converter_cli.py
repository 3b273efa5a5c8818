"""The converter tools (tools/convert_*.py) as a user runs them: bad input fails in one
line and leaves nothing behind, and every flag is documented. They import Megatron."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.helpers.hf_models import make_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import convert_hf_to_mcore  # noqa: E402
import convert_mcore_to_hf  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_model("llama", tmp_path_factory.mktemp("hf") / "llama")


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
