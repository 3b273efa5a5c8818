"""The environment protocol: an episode starts from a dataset row; after each assistant
turn the environment answers with observation messages, or ends the episode, with a
reward or without one (then the reward function scores the whole conversation).

``ToolEnvironment`` is the built-in one: it parses the turn's tool calls in the model's
format (rl/envs/toolcall.py), runs them (rl/envs/tools.py) and answers each with a
``tool`` message; a turn without a call is the final answer. A user's own environment is
named by path (``env.cls``: ``pkg.module:Class`` or ``path/to/env.py:Class``) and built
with the tools and the row's fields it asks for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from rl.envs.toolcall import parse
from rl.envs.tools import Tool, run_tool

Message = dict[str, Any]


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
        """Answer the conversation so far, which ends with the assistant's turn."""
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
