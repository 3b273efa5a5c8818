"""Key-value retrieval over a long list: the long-context task.

A prompt lists ``pairs`` entries ``key=value+`` (3-digit keys, distinct within the list;
1-digit values) and ends with one of its keys, ``key=``; the answer is that key's value
and EOS. With the default 340 pairs a prompt is 2,045 tokens, a response 2: rows are
long, answers short, as in agentic RL over long observations. Every prompt of a task has
the same length (see rl/tasks/kinds/arithmetic.py on why the character tasks avoid left
padding). Each problem is drawn from its own seeded generator, so a problem is a pair
(stream, index); the held-out problems come from a stream of their own. It shares the
arithmetic task's character tokenizer (digits, ``+`` and ``=``). Pure logic.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from rl.config.schema import TaskConfig
from rl.tasks.common import Example, TaskContext, TaskError, TaskKind, resume_position
from rl.tasks.kinds.arithmetic import BOS, EOS, CharCodec, encode

KEYS = 1000  # 3-digit keys


def prompt_length(pairs: int) -> int:
    """BOS, ``pairs`` entries of 6 characters, the query key and ``=``."""
    return 1 + 6 * pairs + 4


@dataclass(frozen=True)
class Lookup:
    """One problem: the list and the queried key."""

    keys: tuple[int, ...]
    values: tuple[int, ...]
    query: int  # an index into keys

    @classmethod
    def draw(cls, pairs: int, seed: int, stream: int, index: int) -> Lookup:
        rng = random.Random(f"{seed}:{stream}:{index}")
        keys = tuple(rng.sample(range(KEYS), pairs))
        values = tuple(rng.randrange(10) for _ in keys)
        return cls(keys, values, rng.randrange(pairs))

    def text(self) -> str:
        entries = "".join(f"{k:03d}={v}+" for k, v in zip(self.keys, self.values, strict=True))
        return f"{entries}{self.keys[self.query]:03d}="

    def answer(self) -> str:
        return str(self.values[self.query])


@dataclass
class RetrievalTaskConfig(TaskConfig):
    """Key-value retrieval over a list of ``pairs`` entries (a 2,045-token prompt at 340),
    the value's digit as the label (reward.fn=exact)."""

    name: str = "retrieval"
    pairs: int = 340


def check_config(task: TaskConfig, ctx: TaskContext) -> None:
    t = cast(RetrievalTaskConfig, task)
    if not (isinstance(t.pairs, int) and 1 <= t.pairs <= KEYS):
        raise TaskError(f"task.pairs={t.pairs!r} must be an integer in [1, {KEYS}]")
    if ctx.env.tools or ctx.env.cls:
        raise TaskError("env.tools/env.cls: task=retrieval has no chat template for tools")
    need, have = prompt_length(t.pairs) + 2, ctx.max_position_embeddings
    if need > have:
        raise TaskError(
            f"task.pairs={t.pairs} needs {need} positions but model.max_position_embeddings={have}"
        )
    if ctx.rl_steps > 0 and ctx.max_new_tokens < 2:
        raise TaskError(
            f"rollout.sampling.max_new_tokens={ctx.max_new_tokens} is shorter than the "
            "task's answer (2 tokens: the digit and EOS)"
        )


class RetrievalTask:
    """Lookups through the task protocol (rl/tasks/common.py)."""

    name = "retrieval"
    codec = CharCodec()
    episodes = None

    def __init__(self, pairs: int = 340, seed: int = 0, eval_size: int = 256):
        self.pairs, self.seed = pairs, seed
        self.eval_sets = {"eval": [self.example(0, i) for i in range(eval_size)]}
        self.validation_set = [self.example(1, i) for i in range(eval_size)]

    def example(self, stream: int, index: int) -> Example:
        p = Lookup.draw(self.pairs, self.seed, stream, index)
        text = p.text()
        return Example(
            uid=f"{stream}:{index}",
            prompt_ids=(BOS, *encode(text)),
            prompt_text=text,
            label=p.answer(),
            target_ids=(*encode(p.answer()), EOS),
        )

    def train_stream(self, start: Mapping[str, Any] | None = None) -> RetrievalStream:
        return RetrievalStream(self, start)

    @property
    def answer_tokens(self) -> int:
        return 2

    @property
    def max_prompt_len(self) -> int:
        return prompt_length(self.pairs)

    def describe(self) -> str:
        return (
            f"task retrieval: {self.pairs} key-value pairs ({self.max_prompt_len}-token "
            f"prompts), {len(self.eval_sets['eval'])} held-out lookups (seed {self.seed})"
        )


class RetrievalStream:
    """Training lookups 0, 1, 2, ... of stream 2; its position is the count drawn."""

    def __init__(self, task: RetrievalTask, start: Mapping[str, Any] | None = None):
        self.task, self.drawn = task, 0
        if start is not None:
            (self.drawn,) = resume_position(start, self._fixed(), ("drawn",))

    def _fixed(self) -> dict[str, Any]:
        t = self.task
        return {"task": "retrieval", "seed": t.seed, "pairs": t.pairs}

    def position(self) -> dict[str, Any]:
        return {**self._fixed(), "drawn": self.drawn}

    def __iter__(self) -> RetrievalStream:
        return self

    def __next__(self) -> Example:
        self.drawn += 1
        return self.task.example(2, self.drawn - 1)


def build(task: TaskConfig, ctx: TaskContext) -> RetrievalTask:
    t = cast(RetrievalTaskConfig, task)
    return RetrievalTask(t.pairs, t.seed, t.eval_size)


TASK = TaskKind(RetrievalTaskConfig, check_config, build)
