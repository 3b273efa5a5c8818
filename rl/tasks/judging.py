"""A generative reward model's text side: the prompt a judge reads and how its verdict
becomes a score (``reward.fn=judge``; the judge itself is served on the reward ranks,
rl/reward/judge.py).

The prompt is a template (a shipped one by name, or a text file) whose placeholders are
filled with what the reward function would be given: ``{prompt}``, ``{response}``,
``{label}``, and ``{conversation}`` (a multi-turn episode's messages as ``role: content``
lines; the prompt and the response for a one-turn sample). It is the judge's user turn.

The parser turns the judge's answer into a score. Built-ins: ``yes_no`` (the first word,
yes -> 1, no -> 0) and ``score10`` (the first whole number 0-10, divided by 10); or a
user's ``fn(text) -> float`` by path. An answer the parser cannot read is a
:class:`VerdictError`: the item's score is 0 and it is counted as a failure, never guessed.

Pure logic: re and the path loader only.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rl.plugins import load_object

PROMPTS = Path(__file__).with_name("judge_prompts")
PLACEHOLDERS = ("prompt", "response", "label", "conversation")
_FIELD = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
Parser = Callable[[str], float]


class JudgeError(ValueError):
    """A judge config that cannot work: one line naming the field."""


class VerdictError(ValueError):
    """A judge's answer the parser cannot read as a score."""


def prompt_template(name_or_path: str) -> str:
    """A shipped template by name (``correctness``) or a text file; it must use
    ``{response}`` or ``{conversation}``."""
    shipped = PROMPTS / f"{name_or_path}.txt"
    path = shipped if shipped.is_file() else Path(name_or_path).expanduser()
    if not path.is_file():
        known = sorted(p.stem for p in PROMPTS.glob("*.txt"))
        raise JudgeError(f"reward.judge.prompt={name_or_path!r}: not one of {known} nor a file")
    text = path.read_text()
    used = set(_FIELD.findall(text))
    if not used & {"response", "conversation"}:
        raise JudgeError(
            f"reward.judge.prompt={name_or_path!r}: the template shows the judge neither "
            "{response} nor {conversation}"
        )
    return text


def conversation_text(prompt: str, response: str, metadata: Mapping[str, Any]) -> str:
    messages = metadata.get("messages")
    if not messages:
        return f"user: {prompt}\nassistant: {response}"
    return "\n".join(f"{m.get('role', '?')}: {m.get('content', '')}" for m in messages)


def render(template: str, prompt: str, response: str, label: object,
           metadata: Mapping[str, Any]) -> str:  # fmt: skip
    """The judge's user turn. Placeholders are filled in one pass, so a response that
    itself contains ``{label}`` is shown as written, never filled."""
    values = {"prompt": prompt, "response": response, "label": "" if label is None else str(label),
              "conversation": conversation_text(prompt, response, metadata)}  # fmt: skip
    return _FIELD.sub(lambda m: values[m.group(1)], template)


# ---------------------------------------------------------------------- parsers
def yes_no(text: str) -> float:
    """1 when the answer's first word is yes, 0 when it is no."""
    words = re.findall(r"[a-z]+", text.lower())
    if words and words[0] in ("yes", "no"):
        return float(words[0] == "yes")
    raise VerdictError(f"not yes or no: {text[:60]!r}")


def score10(text: str) -> float:
    """The first whole number of the answer, 0 to 10, divided by 10."""
    m = re.search(r"(?<![\d.])(\d+)(?![\d.])", text)
    if m is None or int(m.group(1)) > 10:
        raise VerdictError(f"no score from 0 to 10: {text[:60]!r}")
    return int(m.group(1)) / 10


PARSERS: dict[str, Parser] = {"yes_no": yes_no, "score10": score10}
_FORMS = "a built-in (score10, yes_no), 'pkg.module:fn' or 'path/to/parsers.py:fn'"


class _SpecError(JudgeError):
    def __init__(self, message: str):
        super().__init__(f"reward.judge.parser {message}")


def load_parser(spec: str) -> Parser:
    spec = spec.strip()
    if spec in PARSERS:
        return PARSERS[spec]
    if ":" not in spec:
        raise _SpecError(f"{spec!r}: not {_FORMS}")
    fn = load_object(spec, _FORMS, _SpecError)
    if not callable(fn):
        raise _SpecError(f"{spec!r}: a {type(fn).__name__}, not a function")
    return fn
