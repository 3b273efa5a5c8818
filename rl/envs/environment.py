"""The environment protocol: an episode starts from a dataset row; after each assistant
turn the environment answers with observation messages, or ends the episode, with a
reward or without one (then the reward function scores the whole conversation).

``ToolEnvironment`` is the built-in one: it parses the turn's tool calls in the model's
format (rl/envs/toolcall.py), runs them (rl/envs/tools.py) and answers each with a
``tool`` message; a turn without a call is the final answer. A user's own environment is
named by path (``pkg.module:Class`` or ``path/to/env.py:Class``) and built as
``Class(tools, tool_format)`` (:func:`load_environment`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rl.envs.toolcall import parse
from rl.envs.tools import Tool, run_tool
from rl.plugins import load_object

Message = dict[str, Any]
_FORMS = "'pkg.module:Class' or 'path/to/env.py:Class'"


class EnvSpecError(ValueError):
    """An environment spec that names no usable class: one line, ``env.cls '<spec>': ...``."""

    def __init__(self, message: str):
        super().__init__(f"env.cls {message}")


@dataclass(frozen=True)
class Step:
    observations: tuple[Message, ...] = ()
    done: bool = False
    reward: float | None = None  # None: the reward function scores the conversation
    metrics: Mapping[str, float] = field(default_factory=dict)  # summed over the episode


class Environment(Protocol):
    @property
    def tools(self) -> Sequence[Tool]: ...

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        """The first messages of an episode (system and user turns)."""
        ...

    def step(self, messages: Sequence[Message]) -> Step:
        """Answer the conversation, whose last message is the assistant's turn."""
        ...


def first_messages(row: Mapping[str, Any]) -> list[Message]:
    """A row's ``messages`` as they are, or its ``prompt`` as one user turn."""
    if "messages" in row:
        return [dict(m) for m in row["messages"]]
    return [{"role": "user", "content": str(row["prompt"])}]


class ToolEnvironment:
    """Run the tools the assistant calls; a turn that calls none ends the episode."""

    def __init__(self, tools: Mapping[str, Tool], tool_format: str):
        self._tools = dict(tools)
        self.tool_format = tool_format
        parse(tool_format, "")  # an unknown format fails here, before any episode

    @property
    def tools(self) -> Sequence[Tool]:
        return list(self._tools.values())

    def reset(self, row: Mapping[str, Any]) -> list[Message]:
        return first_messages(row)

    def step(self, messages: Sequence[Message]) -> Step:
        calls = parse(self.tool_format, str(messages[-1]["content"]))
        if not calls:
            return Step(done=True)
        outcomes = [run_tool(self._tools, call) for call in calls]
        observations = tuple(
            {"role": "tool", "name": call.name, "content": out.text}
            for call, out in zip(calls, outcomes, strict=True)
        )
        metrics = {
            "tool_calls": float(len(calls)),
            "tool_errors": float(sum(o.status == "error" for o in outcomes)),
            "tool_timeouts": float(sum(o.status == "timeout" for o in outcomes)),
        }
        return Step(observations, metrics=metrics)


def load_environment(spec: str | None, tools: Mapping[str, Tool], tool_format: str) -> Environment:
    """The built-in :class:`ToolEnvironment` (``spec`` None), or the user's class a spec
    names, built as ``cls(tools, tool_format)``; a one-line error naming the spec when it
    cannot be (no such class, a constructor that refuses those arguments, or an object
    without ``reset`` and ``step``)."""
    if spec is None:
        return ToolEnvironment(tools, tool_format)
    cls = load_object(spec, _FORMS, EnvSpecError)
    if not callable(cls):
        raise EnvSpecError(f"{spec!r}: a {type(cls).__name__}, not a class")
    try:
        env = cls(dict(tools), tool_format)
    except Exception as e:
        raise EnvSpecError(
            f"{spec!r}: {type(e).__name__} building it with (tools, tool_format): {e}"
        ) from None
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing:
        raise EnvSpecError(f"{spec!r}: has no {' or '.join(missing)} method")
    return env
