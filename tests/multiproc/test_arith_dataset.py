"""tools/make_arith_dataset.py: seeded, disjoint, correct natural-language arithmetic rows."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "make_arith_dataset.py"


def _make(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(TOOL), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _recompute(question: str) -> tuple[str, int]:
    """(op, answer) read from the words of the question alone, not from the row's fields."""
    a, b = (int(x) for x in re.findall(r"\d+", question))
    if " from " in question:  # "Subtract b from a", "take b away from a"
        a, b = b, a
    if re.search(r"plus|sum|Add|\+", question):
        return "+", a + b
    if re.search(r"minus|Subtract|away|-", question):
        return "-", a - b
    if re.search(r"times|product|Multiply|\*", question):
        return "*", a * b
    raise AssertionError(f"no operation in {question!r}")


def test_rows_are_correct_disjoint_and_counted(tmp_path: Path):
    proc = _make(tmp_path, "--train", "600", "--eval", "150", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    train, evals = _read(tmp_path / "train.jsonl"), _read(tmp_path / "eval.jsonl")
    assert (len(train), len(evals)) == (600, 150)
    assert {q["question"] for q in train}.isdisjoint(q["question"] for q in evals)
    # Disjoint as problems, too: a rephrasing of a train question is not a new eval question.
    problems = [
        {(r["op"], *sorted(map(int, re.findall(r"\d+", r["question"])))) for r in rows}
        for rows in (train, evals)
    ]
    assert problems[0].isdisjoint(problems[1])
    ops, phrasings = set(), set()
    for row in train + evals:
        assert set(row) == {"question", "answer", "source", "op"}
        assert row["source"] == "arith"
        assert row["question"].endswith("Answer with the number only.")
        assert re.fullmatch(r"\d+", row["answer"]), row  # number only, never negative
        op, value = _recompute(row["question"])
        assert op == row["op"] and int(row["answer"]) == value, row
        ops.add(op)
        phrasings.add(re.sub(r"\d+", "N", row["question"]))
    assert ops == {"+", "-", "*"}
    assert len(phrasings) >= 9  # a few per operation


def test_same_flags_same_bytes_and_seed_matters(tmp_path: Path):
    for name, seed in (("a", "7"), ("b", "7"), ("c", "8")):
        proc = _make(tmp_path / name, "--train", "50", "--eval", "20", "--seed", seed)
        assert proc.returncode == 0, proc.stderr
    for f in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
    assert (tmp_path / "a/train.jsonl").read_bytes() != (tmp_path / "c/train.jsonl").read_bytes()


def test_keys_and_digits_are_honoured(tmp_path: Path):
    proc = _make(
        tmp_path, "--train", "30", "--eval", "10", "--digits", "3",
        "--prompt-key", "prompt", "--label-key", "label",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = _read(tmp_path / "train.jsonl") + _read(tmp_path / "eval.jsonl")
    assert all(set(r) == {"prompt", "label", "source", "op"} for r in rows)
    for r in rows:
        op, value = _recompute(r["prompt"])
        assert op == r["op"] and int(r["label"]) == value
        assert all(int(x) < 1000 for x in re.findall(r"\d+", r["prompt"]))
    assert any(int(x) >= 100 for r in rows for x in re.findall(r"\d+", r["prompt"]))


def test_parquet_matches_jsonl(tmp_path: Path):
    import pyarrow.parquet as pq  # requirements/base.txt installs it

    args = ("--train", "40", "--eval", "10", "--seed", "1")
    assert _make(tmp_path / "j", *args).returncode == 0
    assert _make(tmp_path / "p", *args, "--format", "parquet").returncode == 0
    for split in ("train", "eval"):
        assert pq.read_table(tmp_path / "p" / f"{split}.parquet").to_pylist() == _read(
            tmp_path / "j" / f"{split}.jsonl"
        )


@pytest.mark.parametrize(
    "args, message",
    [
        (("--digits", "1", "--train", "500"), "allow at most"),
        (("--prompt-key", "op"), "must differ"),
    ],
)
def test_bad_requests_fail_in_one_line(tmp_path: Path, args: tuple[str, ...], message: str):
    proc = _make(tmp_path / "out", *args)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()
