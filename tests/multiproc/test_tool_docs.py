"""Every ``tools/*.py`` command README.md and docs/*.md show runs its ``--help``, and
every option the docs give it is one its ``--help`` lists: a tool renamed, broken at
import, or with a flag renamed fails here, not in a user's shell.

Commands are read from fenced code blocks (``\\`` continuations joined) and inline code
spans: from ``tools/<path>.py`` to the end of its command (a newline, ``&&``, ``;``,
``|`` or the span's end). Each tool's ``--help`` runs once, all in one interpreter.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict

import pytest

from tests.unit.test_docs import DOC_FILES, FENCE, ROOT

INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
TOOL = re.compile(r"(?<![\w/.])(tools/[\w/]+\.py)\b([^\n;|&]*)")
FLAG = re.compile(r"(?<![\w-])(--[a-z][\w-]*)")


def code_of(text: str) -> list[str]:
    """The text of every fenced block (continuations joined) and inline code span."""
    out, block, inside = [], [], False
    for line in text.splitlines():
        if FENCE.match(line):
            if inside:
                out.append("\n".join(block).replace("\\\n", " "))
            inside, block = not inside, []
        elif inside:
            block.append(line)
        else:
            out += INLINE.findall(line)
    return out


def documented_flags(text: str) -> dict[str, set[str]]:
    """Each tool a page shows, with the options shown with it."""
    found: dict[str, set[str]] = defaultdict(set)
    for code in code_of(text):
        for tool, rest in TOOL.findall(code):
            found[tool] |= set(FLAG.findall(rest.split("#", 1)[0]))
    return found


def _all_documented() -> dict[str, set[str]]:
    found: dict[str, set[str]] = defaultdict(set)
    for f in DOC_FILES:
        for tool, flags in documented_flags(f.read_text()).items():
            found[tool] |= flags
    return dict(sorted(found.items()))


DOCUMENTED = _all_documented()


# One interpreter runs every tool's --help in turn (runpy, as ``python tool --help``):
# each tool's imports (torch for most) are paid once, not thirty times.
DRIVER = """
import contextlib, io, json, os, runpy, sys, traceback
out, path = {}, list(sys.path)
for tool in sys.argv[1:]:
    sys.argv, so, se, code = [tool, "--help"], io.StringIO(), io.StringIO(), 0
    sys.path[:] = [os.path.dirname(os.path.abspath(tool)), *path]  # as python tool.py
    with contextlib.redirect_stdout(so), contextlib.redirect_stderr(se):
        try:
            runpy.run_path(tool, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            code, _ = 1, traceback.print_exc(file=se)
    out[tool] = {"returncode": code, "stdout": so.getvalue(), "stderr": se.getvalue()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", DRIVER, *DOCUMENTED], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def unknown_flags(flags: set[str], help_text: str) -> list[str]:
    listed = set(FLAG.findall(help_text))
    return sorted(flags - listed - {"--help"})


@pytest.mark.parametrize("tool", DOCUMENTED)
def test_every_documented_tool_runs_its_help_and_takes_the_options_shown(tool, helps):
    assert (ROOT / tool).is_file(), f"the docs show {tool}, which does not exist"
    res = helps[tool]
    assert res["returncode"] == 0, f"{tool} --help: {res['stderr'].strip()[-1500:]}"
    assert unknown_flags(DOCUMENTED[tool], res["stdout"]) == [], res["stdout"]


def test_the_tools_commands_are_found_and_a_renamed_flag_is_reported():
    text = (
        "Run `python tools/compare_runs.py run_a run_b` and\n\n```bash\n"
        "$V/bin/python tools/bench/packing.py --out x.json \\\n  --quick  # a comment --no\n"
        "PYTHONPATH=. python tools/make_smollm2.py --out d && ls --all\n```\n"
    )
    assert documented_flags(text) == {
        "tools/compare_runs.py": set(),
        "tools/bench/packing.py": {"--out", "--quick"},
        "tools/make_smollm2.py": {"--out"},
    }
    assert len(DOCUMENTED) >= 25 and "tools/make_tiny_vision.py" in DOCUMENTED
    help_text = "usage: x [-h] [--out OUT] [--steps N]\n  --out OUT  where\n"
    assert unknown_flags({"--out", "--stepz"}, help_text) == ["--stepz"]
