#!/usr/bin/env python
"""Write a seeded dataset of natural-language arithmetic questions (no downloads).

    python tools/make_arith_dataset.py --out DIR [--train N] [--eval N] [--seed S]
        [--digits 2] [--prompt-key question] [--label-key answer] [--format jsonl|parquet]

Writes ``DIR/train.<fmt>`` and ``DIR/eval.<fmt>``, one row per question, e.g.::

    {"question": "What is 37 plus 48? Answer with the number only.", "answer": "85",
     "source": "arith", "op": "+"}

Operations: addition, subtraction (first operand >= second, so answers are never negative)
and small multiplication (one operand is a single digit). Each question is phrased with one
of a few templates. Train and eval hold disjoint problems: the same (op, a, b) never appears
in both, whatever the phrasing or operand order (37+48 is 48+37), so eval accuracy measures
more than recall of train rows.
The same flags give byte-identical files. The prompt and label column names are flags so the
files match whatever ``task.prompt_key`` / ``task.label_key`` a config uses.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

SOURCE = "arith"
SUFFIX = " Answer with the number only."
TEMPLATES: dict[str, tuple[str, ...]] = {
    "+": (
        "What is {a} plus {b}?",
        "What is the sum of {a} and {b}?",
        "Add {a} and {b}.",
        "Compute {a} + {b}.",
    ),
    "-": (
        "What is {a} minus {b}?",
        "Subtract {b} from {a}.",
        "What is {a} - {b}?",
        "How much is left if you take {b} away from {a}?",
    ),
    "*": (
        "What is {a} times {b}?",
        "What is the product of {a} and {b}?",
        "Multiply {a} by {b}.",
        "Compute {a} * {b}.",
    ),
}
# Addition and subtraction are the bulk; multiplication is kept small so a 135M model has a
# chance at it and the answer stays short.
OP_WEIGHTS = {"+": 0.45, "-": 0.35, "*": 0.20}


class DatasetError(Exception):
    """A bad request (too many rows for the digit count, clashing keys, missing pyarrow)."""


def _draw_problem(rng: random.Random, digits: int) -> tuple[str, int, int]:
    hi = 10**digits - 1
    op = rng.choices(list(OP_WEIGHTS), weights=list(OP_WEIGHTS.values()))[0]
    if op == "*":
        a, b = rng.randint(2, hi), rng.randint(2, 9)
        if rng.random() < 0.5:
            a, b = b, a
    else:
        a, b = rng.randint(0, hi), rng.randint(0, hi)
        if op == "-" and a < b:
            a, b = b, a
    return op, a, b


def problem_key(op: str, a: int, b: int) -> tuple[str, int, int]:
    """The identity of a problem: 37+48 and 48+37 are one, so they never straddle the split."""
    return (op, min(a, b), max(a, b)) if op in "+*" else (op, a, b)


def _distinct_problems(digits: int) -> int:
    """How many different problem keys the generator can draw, to refuse impossible sizes."""
    n = 10**digits
    adds = subs = n * (n + 1) // 2  # unordered pairs; ordered pairs with a >= b
    # One operand in 2..9, the other in 2..n-1, unordered: 8 * (n - 2) ordered pairs less the
    # 64 with both small, plus those 64 counted unordered (36).
    muls = 8 * (n - 2) - 64 + 36
    return adds + subs + muls


def solve(op: str, a: int, b: int) -> int:
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown op {op!r}")


def make_rows(
    n_train: int,
    n_eval: int,
    seed: int = 0,
    digits: int = 2,
    prompt_key: str = "question",
    label_key: str = "answer",
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train rows, eval rows): distinct problems, eval's disjoint from train's."""
    if digits < 1:
        raise DatasetError(f"--digits {digits} must be >= 1")
    if n_train < 0 or n_eval < 0:
        raise DatasetError("--train and --eval must be >= 0")
    if len({prompt_key, label_key, "source", "op"}) != 4:
        raise DatasetError(
            f"--prompt-key {prompt_key!r} and --label-key {label_key!r} must differ "
            "from each other and from 'source' and 'op'"
        )
    total = n_train + n_eval
    # Rejection sampling slows down near the limit; half the space is plenty for any test.
    limit = _distinct_problems(digits) // 2
    if total > limit:
        raise DatasetError(
            f"{total} rows asked but {digits}-digit operands allow at most {limit}; "
            "raise --digits or lower --train/--eval"
        )
    rng = random.Random(seed)
    seen: set[tuple[str, int, int]] = set()
    problems: list[tuple[str, int, int]] = []
    while len(problems) < total:
        p = _draw_problem(rng, digits)
        if problem_key(*p) not in seen:
            seen.add(problem_key(*p))
            problems.append(p)
    rows = []
    for op, a, b in problems:
        question = rng.choice(TEMPLATES[op]).format(a=a, b=b) + SUFFIX
        rows.append(
            {prompt_key: question, label_key: str(solve(op, a, b)), "source": SOURCE, "op": op}
        )
    train, evals = rows[:n_train], rows[n_train:]
    # Unreachable while problems are drawn distinct; a guard against future edits.
    shared_q = {r[prompt_key] for r in train} & {r[prompt_key] for r in evals}
    shared_p = {problem_key(*p) for p in problems[:n_train]} & {
        problem_key(*p) for p in problems[n_train:]
    }
    if shared_q or shared_p:
        raise DatasetError(f"train and eval share {len(shared_q | shared_p)} questions")
    return train, evals


def _write_atomic(path: Path, rows: list[dict[str, Any]], fmt: str) -> None:
    # A file half-written by an interrupted run must never look like a finished dataset.
    tmp = path.with_name(path.name + ".tmp")
    if fmt == "jsonl":
        with open(tmp, "w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    else:
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq
        except ImportError:
            raise DatasetError(
                "--format parquet needs pyarrow (pip install pyarrow), or use --format jsonl"
            ) from None
        columns = list(rows[0]) if rows else []
        table = pa.table({c: [r[c] for r in rows] for c in columns})
        pq.write_table(table, tmp)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Write train/eval files of seeded natural-language arithmetic questions "
        "(addition, non-negative subtraction, small multiplication) with number-only answers.",
    )
    ap.add_argument("--out", required=True, type=Path, help="output directory (created)")
    ap.add_argument("--train", type=int, default=2000, help="train rows (default 2000)")
    ap.add_argument("--eval", type=int, default=200, help="eval rows (default 200)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--digits", type=int, default=2, help="max digits per operand (default 2)")
    ap.add_argument("--prompt-key", default="question", help="question column (default question)")
    ap.add_argument("--label-key", default="answer", help="answer column (default answer)")
    ap.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl")
    args = ap.parse_args(argv)
    try:
        train, evals = make_rows(
            args.train, args.eval, args.seed, args.digits, args.prompt_key, args.label_key
        )
        try:
            args.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DatasetError(f"cannot create --out {args.out}: {e.strerror}") from None
        for name, rows in (("train", train), ("eval", evals)):
            _write_atomic(args.out / f"{name}.{args.format}", rows, args.format)
    except DatasetError as e:
        print(f"make_arith_dataset: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(train)} train + {len(evals)} eval rows to {args.out} ({args.format})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
