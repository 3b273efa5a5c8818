"""The converter tools (tools/convert_*.py) as a user runs them: bad input fails in one
line and leaves nothing behind, and every flag is documented. They import Megatron."""

from __future__ import annotations

import os
import subprocess
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
    assert err.startswith("error: --tp=3 does not divide") and "\n" not in err, err
    assert not out.exists() and not (tmp_path / "out.tmp").exists()
    missing = tmp_path / "nothing"
    assert convert_mcore_to_hf.main(["--ckpt", str(missing), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not out.exists()
    out.mkdir()
    assert convert_hf_to_mcore.main(["--hf-dir", str(llama), "--out", str(out)]) == 2
    assert "exists (pass --force" in capsys.readouterr().err
    # An output under a file: refused in one line before a rank starts or a shard is written.
    (tmp_path / "a_file").write_text("")
    under = tmp_path / "a_file" / "out"
    for tool, args in ((convert_hf_to_mcore, ["--hf-dir", str(llama)]),
                       (convert_mcore_to_hf, ["--ckpt", str(llama)])):  # fmt: skip
        assert tool.main([*args, "--out", str(under)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --out {str(under)!r}: its parent") and "\n" not in err, err


@pytest.mark.parametrize("tool", [convert_hf_to_mcore, convert_mcore_to_hf])
def test_every_flag_is_documented(tool):
    actions = [a for a in tool.parser()._actions if a.dest != "help"]
    assert actions
    for a in actions:
        assert a.help and len(a.help) > 10, a.dest
    text = tool.parser().format_help()
    for a in actions:
        assert a.option_strings[0] in text


@pytest.mark.parametrize(
    ("flag", "value", "low"),
    [
        ("--tp", "0", 1),
        ("--pp", "0", 1),
        ("--ep", "-1", 1),
        ("--vocab-multiple", "-1", 0),
    ],
)
def test_a_bad_count_names_its_flag(tmp_path, llama, capsys, flag, value, low):
    out = tmp_path / "out"
    args = ["--hf-dir", str(llama), "--out", str(out), flag, value]
    assert convert_hf_to_mcore.main(args) == 2
    assert capsys.readouterr().err == f"error: {flag}={value} must be an integer >= {low}\n"
    assert not out.exists()


def _tool(name: str, *args: str) -> subprocess.CompletedProcess:
    """A converter in a process of its own: Megatron's import-time warnings fire there."""
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / name), *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _noise(stderr: str) -> list[str]:
    """Lines of stderr other than the converters' own progress lines."""
    return [x for x in stderr.splitlines() if x.strip() and not x.startswith("[convert] ")]


def test_normal_runs_print_no_warnings_and_a_truncated_shard_is_named(tmp_path, llama, capsys):
    mcore, hf = tmp_path / "mcore", tmp_path / "hf"
    res = _tool("convert_hf_to_mcore.py", "--hf-dir", str(llama), "--out", str(mcore))
    assert res.returncode == 0, res.stderr
    assert _noise(res.stderr) == []
    res = _tool("convert_mcore_to_hf.py", "--ckpt", str(mcore), "--out", str(hf))
    assert res.returncode == 0, res.stderr
    # Transformer Engine / Apex fallbacks, torch's "No CUDA runtime": none of them.
    assert _noise(res.stderr) == []
    # --peft wants adapters: a checkpoint without them is refused in one line.
    peft = tmp_path / "adapter"
    assert convert_mcore_to_hf.main(["--ckpt", str(mcore), "--out", str(peft), "--peft"]) == 2
    assert capsys.readouterr().err == (
        f"error: checkpoint {str(mcore)!r} has no LoRA adapters (trainer.lora.rank=0)\n"
    )
    assert not peft.exists()
    shard = sorted(mcore.glob("*.distcp"))[-1]
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size // 2)
    out = tmp_path / "hf2"
    assert convert_mcore_to_hf.main(["--ckpt", str(mcore), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"error: checkpoint {str(mcore)!r} shard {str(shard)!r} is truncated: {size // 2} of "
        f"{size} bytes\n"
    )
    assert not out.exists()
