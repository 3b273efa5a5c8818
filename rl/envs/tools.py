"""Tools a policy may call: a name, a JSON-Schema for the arguments, a function returning
the observation text.

Built-ins are a registry (``BUILTIN``): ``calculator`` (exact arithmetic on an
expression, never ``eval``) and ``python`` (the code runs in rl/envs/sandbox.py). A user's
own tool is named by path like ``reward.fn``: ``pkg.module:obj`` or ``path/to/tools.py:obj``,
where ``obj`` is a :class:`Tool`, or a function with type hints and a Google-style
docstring (its schema is then made the way ``apply_chat_template(tools=[fn])`` makes it).

``run_tool`` never raises for what a call did: an unknown tool, arguments that break the
schema, an exception or a sandbox limit all come back as a :class:`ToolOutcome` whose text
the model reads as the observation.
"""

from __future__ import annotations

import ast
import operator
import threading
from collections.abc import Callable, Mapping
from dataclasses import KW_ONLY, dataclass, field, replace
from fractions import Fraction
from typing import Any

from rl.envs import sandbox
from rl.envs.tool_worker import WorkerPool
from rl.envs.toolcall import ToolCall
from rl.plugins import load_object
from rl.threads import start_thread

JSON = Any  # a JSON value
_FORMS = "a built-in (calculator, python), 'pkg.module:obj' or 'path/to/tools.py:obj'"


class ToolError(ValueError):
    """A tool config that cannot work: one line naming the tool."""


class _ToolSpecError(ToolError):
    """The path loader's error, worded as the others: ``tool '<spec>': ...``."""

    def __init__(self, message: str):
        super().__init__(f"tool {message}")


@dataclass(frozen=True)
class ToolOutcome:
    text: str
    status: str = "ok"  # "ok", "error" (the call or the tool failed) or "timeout"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, JSON]  # the JSON Schema of the arguments object
    fn: Callable[..., str | ToolOutcome]  # fn(**arguments) -> the observation
    _: KW_ONLY
    limits: sandbox.Limits = field(default_factory=sandbox.Limits)
    # Enforces ``limits.wall_s`` itself (the sandbox kills its process group and says so):
    # the call's own wait is then only a backstop.
    bounded: bool = False
    # A user's tool by path: its calls run in worker processes that load it from this spec
    # (rl/envs/tool_worker.py); None: in a thread of this process (the built-ins).
    spec: str | None = None

    def schema(self) -> dict[str, JSON]:
        """As chat templates take it: ``apply_chat_template(messages, tools=[...])``."""
        body = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**body, "parameters": self.parameters}}


# ---------------------------------------------------------------------- calculator
_BINARY: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_MAX_DIGITS = 200  # an answer longer than this is refused, so 9**9**9 cannot hang the job


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        x = _value(node.operand)
        return -x if isinstance(node.op, ast.USub) else x
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exp = _value(node.left), _value(node.right)
        if exp.denominator != 1 or abs(exp) > 64:
            raise ValueError("an exponent must be a whole number from -64 to 64")
        return base ** int(exp)
    raise ValueError(f"{ast.unparse(node)!r} is not arithmetic")


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: Numbers, + - * / // % ** and parentheses, e.g. "(12 + 7) * 3".
    """
    try:
        x = _value(ast.parse(expression.strip(), mode="eval").body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError) as e:
        return f"error: {e.msg if isinstance(e, SyntaxError) else e}"
    text = str(x.numerator) if x.denominator == 1 else f"{float(x):.12g}"
    return text if len(text) <= _MAX_DIGITS else "error: the result is too long"


def _python_tool(limits: sandbox.Limits) -> Callable[..., ToolOutcome]:
    def run(code: str) -> ToolOutcome:
        result = sandbox.run_python(code, limits)
        text = result.stdout
        if result.stderr:
            text += ("\n" if text else "") + result.stderr
        if result.reason:
            text += f"\n[{result.reason}]"
        status = "ok" if result.ok else "timeout" if result.reason == "timeout" else "error"
        return ToolOutcome(text.strip() or "(no output)", status)

    return run


def _string_schema(arg: str, description: str) -> dict[str, JSON]:
    return {
        "type": "object",
        "properties": {arg: {"type": "string", "description": description}},
        "required": [arg],
    }


BUILTIN: dict[str, Callable[[sandbox.Limits], Tool]] = {
    "calculator": lambda limits: Tool(
        "calculator",
        "Evaluate an arithmetic expression exactly.",
        _string_schema("expression", 'e.g. "(12 + 7) * 3"'),
        calculate,
        limits=limits,
    ),
    "python": lambda limits: Tool(
        "python",
        "Run Python code in a sandbox and return what it printed.",
        _string_schema("code", "a Python program; print the values you need"),
        _python_tool(limits),
        limits=limits,
        bounded=True,
    ),
}


# ---------------------------------------------------------------------- loading and checks
def check_schema(name: str, schema: JSON) -> None:
    """A ToolError unless ``schema`` is a valid JSON Schema for an arguments object."""
    import jsonschema

    if not isinstance(schema, Mapping) or schema.get("type") != "object":
        raise ToolError(f"tool {name!r}: parameters must be a JSON Schema of type 'object'")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        raise ToolError(
            f"tool {name!r}: parameters are not valid JSON Schema: {e.message}"
        ) from None


def _from_function(spec: str, fn: Callable[..., str], limits: sandbox.Limits) -> Tool:
    from transformers.utils import get_json_schema

    try:
        described = get_json_schema(fn)["function"]
    except Exception as e:  # transformers' DocstringParsingException and TypeErrors
        raise ToolError(f"tool {spec!r}: no schema from its signature and docstring: {e}") from None
    params = described.get("parameters", {"type": "object", "properties": {}})
    return Tool(described["name"], described.get("description", ""), params, fn, limits=limits)


DEFAULT_LIMITS = sandbox.Limits()


def load_tool(spec: str, limits: sandbox.Limits = DEFAULT_LIMITS) -> Tool:
    """The tool a spec names, schema checked; a one-line ToolError otherwise."""
    spec = spec.strip()
    if spec in BUILTIN:
        return BUILTIN[spec](limits)
    if ":" not in spec:
        raise ToolError(f"tool {spec!r}: unknown; not {_FORMS}")
    obj = load_object(spec, _FORMS, _ToolSpecError)
    if isinstance(obj, Tool):
        tool = obj
    elif callable(obj):
        tool = _from_function(spec, obj, limits)
    else:
        raise ToolError(f"tool {spec!r}: a {type(obj).__name__}, neither a Tool nor a function")
    check_schema(tool.name, tool.parameters)
    return replace(tool, spec=spec)


def load_tools(specs: list[str], limits: sandbox.Limits = DEFAULT_LIMITS) -> dict[str, Tool]:
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec, limits)
        if tool.name in tools:
            raise ToolError(f"tool {spec!r}: the name {tool.name!r} is given twice")
        tools[tool.name] = tool
    return tools


def run_tool(tools: Mapping[str, Tool], call: ToolCall) -> ToolOutcome:
    """The observation for one call, cut to the tool's ``limits.output_chars``; never
    raises for what the call or the tool did."""
    import jsonschema

    if call.error:
        return ToolOutcome(f"error: {call.error}", "error")
    tool = tools.get(call.name)
    if tool is None:
        return ToolOutcome(f"error: no tool {call.name!r}; tools: {sorted(tools)}", "error")
    try:
        jsonschema.validate(call.arguments, tool.parameters)
    except jsonschema.ValidationError as e:
        return ToolOutcome(f"error: bad arguments for {call.name!r}: {e.message}", "error")
    out = _in_worker(tool, call.arguments) if tool.spec else _timed(tool, call.arguments)
    return _capped(out, tool.limits.output_chars)


def _capped(out: ToolOutcome, chars: int) -> ToolOutcome:
    if len(out.text) <= chars:
        return out
    return replace(out, text=f"{out.text[:chars]}\n[cut: {len(out.text) - chars} more characters]")


_POOLS: dict[str, WorkerPool] = {}  # a user tool's workers, by its spec
_POOLS_LOCK = threading.Lock()


def _in_worker(tool: Tool, arguments: dict[str, JSON]) -> ToolOutcome:
    """A user tool's call in one of its worker processes; an overrun kills that worker."""
    assert tool.spec is not None
    with _POOLS_LOCK:
        pool = _POOLS.setdefault(tool.spec, WorkerPool(tool.spec))
    out = pool.call(arguments, tool.limits.wall_s)
    if out is None:
        return ToolOutcome(
            f"error: {tool.name!r} took longer than {tool.limits.wall_s:g} s", "timeout"
        )
    if "raised" in out:
        return ToolOutcome(f"error: {tool.name!r} raised {out['raised']}", "error")
    return ToolOutcome(str(out["text"]), str(out["status"]))


def worker_pool(tool: Tool) -> WorkerPool | None:
    """The worker processes of a user's tool, once it has been called."""
    return _POOLS.get(tool.spec) if tool.spec else None


def close_workers() -> None:
    """Kill every user tool's workers (the run is over; a later call starts new ones)."""
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.close()


# Past a bounded tool's wall clock: a sandbox killing a fork bomb's processes and reporting
# takes seconds on a busy machine.
_BACKSTOP_S = 30.0


def _timed(tool: Tool, arguments: dict[str, JSON]) -> ToolOutcome:
    """``tool.fn`` in a thread of its own, waited for ``tool.limits.wall_s`` (a bounded
    tool's, longer). A Python thread cannot be stopped: one that overruns is left to
    finish in the background, a daemon, and its call is answered as a timeout now."""
    box: list[str | ToolOutcome | Exception] = []

    def call() -> None:
        try:
            box.append(tool.fn(**arguments))
        except Exception as e:
            box.append(e)

    worker = start_thread(f"tool-{tool.name}", call)
    worker.join(tool.limits.wall_s + (_BACKSTOP_S if tool.bounded else 0.0))
    if not box:
        return ToolOutcome(
            f"error: {tool.name!r} took longer than {tool.limits.wall_s:g} s", "timeout"
        )
    out = box[0]
    if isinstance(out, Exception):
        return ToolOutcome(f"error: {tool.name!r} raised {type(out).__name__}: {out}", "error")
    return out if isinstance(out, ToolOutcome) else ToolOutcome(str(out))
