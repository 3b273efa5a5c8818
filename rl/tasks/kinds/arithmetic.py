"""Multi-digit addition with a character tokenizer: the embedded default's task.

Operands and sums are zero-padded to fixed width (``07+35=042``), so every prompt and every
answer of a task has the same length. That keeps batches free of padding: with RoPE and
no attention mask, left padding would shift positions and change the model's output.
A fixed, seeded held-out set is excluded from training so accuracy measures
generalisation, not memory. Pure logic: no torch.distributed, no Megatron.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from rl.config.schema import TaskConfig
from rl.tasks.common import Example, TaskContext, TaskError, TaskKind, resume_position

if TYPE_CHECKING:
    from rl.batch import TrainBatch

PAD, BOS, EOS = 0, 1, 2
_CHARS = "0123456789+="
_CHAR_TO_ID = {c: i + 3 for i, c in enumerate(_CHARS)}
_ID_TO_CHAR = {i: c for c, i in _CHAR_TO_ID.items()}
VOCAB_USED = 3 + len(_CHARS)


def encode(text: str) -> list[int]:
    try:
        return [_CHAR_TO_ID[c] for c in text]
    except KeyError as e:
        raise ValueError(f"character {e.args[0]!r} is not in the task vocabulary") from None


def decode(ids: list[int]) -> str:
    """Text of ``ids`` up to the first EOS; unknown ids render as '?'."""
    out = []
    for i in ids:
        if i == EOS:
            break
        out.append(_ID_TO_CHAR.get(i, "?"))
    return "".join(out)


def sequence_length(digits: int) -> int:
    """Tokens in prompt + answer: BOS, a, '+', b, '=' then the sum's digits+1 and EOS."""
    return (2 * digits + 3) + (digits + 2)


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    def prompt(self, digits: int) -> list[int]:
        if not (0 <= self.a < 10**digits and 0 <= self.b < 10**digits):
            raise ValueError(f"{self} does not fit {digits}-digit operands")
        return [BOS, *encode(f"{self.a:0{digits}d}+{self.b:0{digits}d}=")]

    def answer(self, digits: int) -> list[int]:
        return [*encode(f"{self.a + self.b:0{digits + 1}d}"), EOS]


class AdditionTask:
    def __init__(self, digits: int = 2, seed: int = 0, eval_size: int = 256):
        if digits < 1:
            raise ValueError(f"task.digits={digits} must be >= 1")
        self.digits = digits
        n = 10**digits
        if eval_size >= n * n // 2:
            raise ValueError(f"task.eval_size={eval_size} leaves too few training problems")
        rng = random.Random(seed)
        held: set[Problem] = set()
        while len(held) < eval_size:
            held.add(Problem(rng.randrange(n), rng.randrange(n)))
        self.eval_set = sorted(held, key=lambda p: (p.a, p.b))
        self._held = held
        self.seed = seed
        self._rng = random.Random(seed + 1)  # ArithmeticTask.train_stream() draws the same
        # Fresh training problems for decisions made during training (when to end the
        # warm-up), so the held-out set only ever measures.
        self.validation_set = self._draw(random.Random(seed + 2), eval_size)

    @staticmethod
    def answer_length(digits: int) -> int:
        return digits + 2  # digits+1 sum digits, then EOS

    @property
    def prompt_len(self) -> int:
        return 1 + 2 * self.digits + 2

    @property
    def answer_len(self) -> int:
        return self.answer_length(self.digits)

    # The reward executor scores text: the response up to EOS against the answer. With
    # generation stopping at EOS this is exactly ``reward``: a response scores 1 only if it
    # is the answer's digits followed by EOS.
    def answer_text(self, p: Problem) -> str:
        return decode(p.answer(self.digits))

    @staticmethod
    def response_text(ids: list[int]) -> str:
        text = decode(ids)
        return text if EOS in ids else text + "?"  # no EOS: never an exact answer

    def sample(self, count: int) -> list[Problem]:
        """Training problems drawn uniformly, never from the held-out set."""
        return self._draw(self._rng, count)

    def _draw(self, rng: random.Random, count: int) -> list[Problem]:
        n = 10**self.digits
        out: list[Problem] = []
        while len(out) < count:
            p = Problem(rng.randrange(n), rng.randrange(n))
            if p not in self._held:
                out.append(p)
        return out

    def reward(self, p: Problem, response: list[int]) -> float:
        """1.0 for the exact answer followed by EOS, else 0.0."""
        return float(list(response[: self.answer_len]) == p.answer(self.digits))

    def sft_batch(self, problems: list[Problem]) -> TrainBatch:
        """Prompt+answer sequences with the loss on the answer tokens only.

        ``loss_mask[:, t]`` weights the prediction of token ``t+1`` (the trainer's
        log-prob convention), so it is 1 from the last prompt position up to the one
        before EOS.
        """
        seqs = [p.prompt(self.digits) + p.answer(self.digits) for p in problems]
        import torch  # here: composing a config imports this module, and needs no torch

        from rl.batch import TrainBatch

        tokens = torch.tensor(seqs, dtype=torch.long)
        mask = torch.zeros_like(tokens, dtype=torch.float32)
        mask[:, self.prompt_len - 1 : self.prompt_len - 1 + self.answer_len] = 1.0
        return TrainBatch(tokens, mask)


@dataclass
class ArithmeticTaskConfig(TaskConfig):
    """n-digit addition with a character tokenizer (07+35=042), a seeded held-out set of
    ``eval_size`` problems, and the answer's text as the label (reward.fn=exact)."""

    name: str = "arithmetic"
    digits: int = 2  # operand digits


def check_config(task: TaskConfig, ctx: TaskContext) -> None:
    """The arithmetic task's fields against the model and the rollouts."""
    t = cast(ArithmeticTaskConfig, task)
    if not (isinstance(t.digits, int) and t.digits >= 1):
        raise TaskError(f"task.digits={t.digits!r} must be an integer >= 1")
    if t.eval_size < 1:
        raise TaskError(f"task.eval_size={t.eval_size} must be >= 1")
    if ctx.env.tools or ctx.env.cls:
        raise TaskError(
            "env.tools/env.cls: task=arithmetic has no chat template to write tools and "
            "observations into; multi-turn episodes need task=dataset with a chat tokenizer"
        )
    need, have = sequence_length(t.digits), ctx.max_position_embeddings
    if need > have:
        raise TaskError(
            f"task.digits={t.digits} needs {need} positions but model.max_position_embeddings"
            f"={have}"
        )
    answer, new = AdditionTask.answer_length(t.digits), ctx.max_new_tokens
    if ctx.rl_steps > 0 and new < answer:
        raise TaskError(
            f"rollout.sampling.max_new_tokens={new} is shorter than the task's answer "
            f"({answer} tokens for task.digits={t.digits})"
        )


class CharCodec:
    """The task's character tokenizer, as the loop sees it."""

    eos_ids = (EOS,)
    pad_id = PAD
    bos_id = BOS

    @staticmethod
    def response_text(ids: Sequence[int]) -> str:
        return AdditionTask.response_text(list(ids))


class ArithmeticTask:
    """:class:`AdditionTask` through the task protocol (rl/tasks/common.py): the label is
    the answer's text (``042``), scored by the ``exact`` reward function."""

    name = "arithmetic"
    codec = CharCodec()
    episodes = None  # its character tokenizer has no chat template to write tools into

    def __init__(self, digits: int = 2, seed: int = 0, eval_size: int = 256):
        self.problems = AdditionTask(digits, seed, eval_size)
        self.eval_sets = {"eval": [self.example(p) for p in self.problems.eval_set]}
        self.validation_set = [self.example(p) for p in self.problems.validation_set]

    def example(self, p: Problem) -> Example:
        d = self.problems.digits
        return Example(
            uid=f"{p.a}+{p.b}",
            prompt_ids=tuple(p.prompt(d)),
            prompt_text=f"{p.a:0{d}d}+{p.b:0{d}d}=",
            label=self.problems.answer_text(p),
            target_ids=tuple(p.answer(d)),
        )

    def train_stream(self, start: Mapping[str, Any] | None = None) -> ArithmeticStream:
        return ArithmeticStream(self, start)

    @property
    def answer_tokens(self) -> int:
        return self.problems.answer_len

    @property
    def max_prompt_len(self) -> int:
        return self.problems.prompt_len

    def describe(self) -> str:
        p = self.problems
        return (
            f"task arithmetic: {p.digits}-digit addition, {len(p.eval_set)} held-out problems "
            f"(seed {p.seed})"
        )


class ArithmeticStream:
    """Problems drawn one at a time from :meth:`AdditionTask.sample`'s stream (the same
    sequence as drawing a batch at once, so the warm-up is what it always was). Its
    position is the number drawn: a resumed stream replays that many draws of the seeded
    generator (about a microsecond each) and continues the same sequence."""

    def __init__(self, task: ArithmeticTask, start: Mapping[str, Any] | None = None):
        p = task.problems
        self.task, self._rng, self.drawn = task, random.Random(p.seed + 1), 0
        if start is not None:
            (drawn,) = resume_position(start, self._fixed(), ("drawn",))
            for _ in range(drawn):
                p._draw(self._rng, 1)
            self.drawn = drawn

    def _fixed(self) -> dict[str, Any]:
        p = self.task.problems
        return {"task": "arithmetic", "seed": p.seed, "digits": p.digits,
                "eval_size": len(p.eval_set)}  # fmt: skip

    def position(self) -> dict[str, Any]:
        return {**self._fixed(), "drawn": self.drawn}

    def __iter__(self) -> ArithmeticStream:
        return self

    def __next__(self) -> Example:
        self.drawn += 1
        return self.task.example(self.task.problems._draw(self._rng, 1)[0])


def build(task: TaskConfig, ctx: TaskContext) -> ArithmeticTask:
    t = cast(ArithmeticTaskConfig, task)
    try:
        return ArithmeticTask(t.digits, t.seed, t.eval_size)
    except ValueError as e:
        raise TaskError(str(e)) from None


TASK = TaskKind(ArithmeticTaskConfig, check_config, build)
