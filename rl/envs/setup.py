"""Multi-turn episodes as the ``env`` config sets them up: the tools (with their time
and memory limits), the environment, and the chat renderer that writes the tools into the
prompt and the observations after each turn.

A task whose prompts are chats builds one :class:`EpisodeSetup` from its tokenizer and
renders every prompt through it, so a template that cannot carry tools, an unknown tool or
a tool schema that is not JSON Schema fails when the task is built: before launch, in one
line naming the field (:class:`EnvError`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl.envs.chat import ChatError, ChatRenderer, ChatTokenizer, template_text
from rl.envs.environment import Environment, EnvSpecError, load_environment
from rl.envs.sandbox import Limits
from rl.envs.toolcall import FORMATS
from rl.envs.tools import ToolError, load_tools

if TYPE_CHECKING:
    from rl.config.schema import EnvConfig


class EnvError(ValueError):
    """An ``env`` config that cannot work: one line naming the field."""


@dataclass(frozen=True)
class EpisodeSetup:
    env: Environment
    chat: ChatRenderer
    max_turns: int
    workers: int


def enabled(cfg: EnvConfig) -> bool:
    """Whether samples are multi-turn episodes (tools or an environment configured)."""
    return bool(cfg.tools) or cfg.cls is not None


def limits(cfg: EnvConfig) -> Limits:
    """Every tool call's: ``tool_timeout_s`` of wall clock (and as many CPU seconds, for
    the sandbox), the sandbox's address space, the observation's length."""
    return Limits(cpu_s=max(1, math.ceil(cfg.tool_timeout_s)), wall_s=cfg.tool_timeout_s,
                  memory_mb=cfg.sandbox_memory_mb,
                  output_chars=cfg.max_observation_chars)  # fmt: skip


def check_fields(cfg: EnvConfig) -> None:
    """The numbers and names alone (no tool or class imported)."""
    bad = [
        (f"env.max_turns={cfg.max_turns} must be >= 1", cfg.max_turns < 1),
        (f"env.tool_timeout_s={cfg.tool_timeout_s} must be > 0", not cfg.tool_timeout_s > 0),
        (f"env.sandbox_memory_mb={cfg.sandbox_memory_mb} must be >= 64",
         cfg.sandbox_memory_mb < 64),
        (f"env.workers={cfg.workers} must be >= 1", cfg.workers < 1),
        (f"env.max_observation_chars={cfg.max_observation_chars} must be >= 100",
         cfg.max_observation_chars < 100),
        (f"env.tool_format={cfg.tool_format!r} must be one of {', '.join(sorted(FORMATS))}",
         cfg.tool_format not in FORMATS),
    ]  # fmt: skip
    for message, wrong in bad:
        if wrong:
            raise EnvError(message)


def environment(cfg: EnvConfig) -> Environment:
    """The environment with its tools loaded and their schemas checked."""
    check_fields(cfg)
    try:
        tools = load_tools(list(cfg.tools), limits(cfg))
    except ToolError as e:
        raise EnvError(f"env.tools: {e}") from None
    try:
        return load_environment(cfg.cls, tools, cfg.tool_format)
    except EnvSpecError as e:
        raise EnvError(str(e)) from None


def build(cfg: EnvConfig, tok: ChatTokenizer, end_id: int) -> EpisodeSetup:
    """Everything an episode needs, for a task whose tokenizer is ``tok`` (``end_id``: the
    token that ends an assistant turn)."""
    env = environment(cfg)
    try:
        template = template_text(cfg.chat_template) if cfg.chat_template else None
        chat = ChatRenderer(tok, end_id, [t.schema() for t in env.tools], template)
    except ChatError as e:
        raise EnvError(str(e)) from None
    return EpisodeSetup(env, chat, cfg.max_turns, cfg.workers)
