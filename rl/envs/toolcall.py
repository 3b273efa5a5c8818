"""Tool calls as a model writes them, in its chat template's own format.

A format is a parser from the assistant's response text to the calls it makes. Formats
are a registry (``register_format``), chosen by ``env.tool_format``:

- ``qwen`` (Hermes style, Qwen 2.5/3 and our ChatML template): every
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block;
- ``llama3``: Llama 3.1's JSON tool call, the whole response (after an optional
  ``<|python_tag|>``) being ``{"name": ..., "parameters": {...}}``, or several joined by
  ``;``.

A call the model wrote badly (not JSON, no name, arguments not an object) is returned as a
:class:`ToolCall` with ``error`` set, so the environment can answer it as an observation
and the model can learn from it; it is never an exception.

Pure logic: json and re only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

JSON = Any  # a JSON value


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, JSON] = field(default_factory=dict)
    error: str = ""  # why the call cannot run; empty when it can


Parser = Callable[[str], list[ToolCall]]
FORMATS: dict[str, Parser] = {}


def register_format(name: str) -> Callable[[Parser], Parser]:
    def add(fn: Parser) -> Parser:
        if name in FORMATS:
            raise RuntimeError(f"tool-call format {name!r} is registered twice")
        FORMATS[name] = fn
        return fn

    return add


def parse(fmt: str, text: str) -> list[ToolCall]:
    """The calls in ``text``; a KeyError naming the known formats for an unknown one."""
    if fmt not in FORMATS:
        raise KeyError(f"env.tool_format={fmt!r}: not one of {sorted(FORMATS)}")
    return FORMATS[fmt](text)


def _call(obj: JSON, args_key: str, where: str) -> ToolCall:
    if not isinstance(obj, dict):
        return ToolCall("", {}, f"{where}: expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, f"{where}: no tool name")
    args = obj.get(args_key, {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCall(name, {}, f"{where}: {args_key!r} is not a JSON object")
    return ToolCall(name, args)


def _loads(text: str, where: str) -> JSON | ToolCall:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        return ToolCall("", {}, f"{where}: not JSON ({e.msg} at char {e.pos})")


_QWEN = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@register_format("qwen")
def parse_qwen(text: str) -> list[ToolCall]:
    out = []
    for i, m in enumerate(_QWEN.finditer(text)):
        where = f"tool call {i + 1}"
        obj = _loads(m.group(1).strip(), where)
        out.append(obj if isinstance(obj, ToolCall) else _call(obj, "arguments", where))
    return out


@register_format("llama3")
def parse_llama3(text: str) -> list[ToolCall]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return []  # plain prose: the final answer
    out: list[ToolCall] = []
    decoder, pos = json.JSONDecoder(), 0
    while pos < len(body):
        where = f"tool call {len(out) + 1}"
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            out.append(ToolCall("", {}, f"{where}: not JSON ({e.msg} at char {e.pos})"))
            break
        out.append(_call(obj, "parameters", where))
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return out
