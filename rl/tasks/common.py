"""What the RL loop needs from a task, whatever the task is.

A task is a stream of training prompts (token ids, the rendered text, a label and
metadata for the reward function), one or more evaluation sets, a validation set for
decisions taken during training (when to end a warm-up), and, where labels allow, the
supervised target of each prompt for a warm-up. The reward is *not* a method of the
task: one reward function (``reward.fn``, rl/tasks/scoring.py) scores training rollouts and
evaluation alike, so there is exactly one scoring path.

Pure logic: no torch.distributed, no Megatron. torch is imported only to build a batch,
so the reward executor's worker processes, which import rl.tasks.scoring, start without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rl.batch import TrainBatch
    from rl.config.schema import EnvConfig, RootConfig, TaskConfig, VisionConfig
    from rl.envs.setup import EpisodeSetup


class TaskError(ValueError):
    """A task config or data file that cannot work; one line naming the field or file."""


@dataclass(frozen=True)
class Example:
    """One prompt of a task."""

    uid: str  # stable and unique within the task (file:line for datasets)
    prompt_ids: tuple[int, ...]
    prompt_text: str  # what the reward function sees as the prompt
    label: Any = None  # handed to the reward function as is (JSON-like)
    _: KW_ONLY
    metadata: Mapping[str, Any] = field(default_factory=dict)
    # The supervised response (ending in the stop token) for a warm-up; None: no target.
    target_ids: tuple[int, ...] | None = None
    # A multi-turn task's: the conversation ``prompt_ids`` renders (an episode's start).
    messages: tuple[Mapping[str, Any], ...] = ()
    # Per target token, whether it is trained on (a demonstration's tool results are not);
    # None: all of them.
    target_mask: tuple[bool, ...] | None = None
    # A vision-language prompt's images (rl/models/vision/images.py references), in the
    # order of its image tokens, each token already expanded to its image's count.
    images: tuple[str, ...] = ()


class Codec(Protocol):
    """The tokenizer as the loop sees it: responses are token ids until the reward.
    Read-only members, so a class attribute or a property satisfies them as well."""

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """Every id that ends a response."""
        ...

    @property
    def pad_id(self) -> int: ...

    def response_text(self, ids: Sequence[int]) -> str:
        """The text the reward function scores: ``ids`` up to the first EOS."""
        ...


class PromptStream(Protocol):
    """A task's training prompts, one at a time, and where the next one comes from."""

    def __iter__(self) -> Iterator[Example]: ...

    def __next__(self) -> Example: ...

    def position(self) -> dict[str, Any]:
        """JSON-like: the task's identity (seed, size...) and the stream's counters, so
        ``task.train_stream(position)`` yields exactly what this stream yields next."""
        ...


def resume_position(
    start: Mapping[str, Any], fixed: Mapping[str, Any], counters: Sequence[str]
) -> list[int]:
    """The ``counters`` of a saved stream position, after checking it was taken from the
    same stream (``fixed``: what must match, e.g. the task and its seed); one-line
    :class:`TaskError` otherwise."""
    for key, want in fixed.items():
        if start.get(key) != want:
            raise TaskError(
                f"the saved prompt stream has {key}={start.get(key)!r} but this task has "
                f"{want!r}: resume with the task config the run started with"
            )
    out = []
    for key in counters:
        v = start.get(key)
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            raise TaskError(f"the saved prompt stream's {key}={v!r} is not a count >= 0")
        out.append(v)
    return out


class Task(Protocol):
    """What the loop reads of a task. The members are read-only (the loop never sets
    them), so a task may hold them as attributes or compute them as properties."""

    @property
    def name(self) -> str: ...

    @property
    def codec(self) -> Codec: ...

    @property
    def eval_sets(self) -> dict[str, list[Example]]:
        """Name -> examples; the first is the main one."""
        ...

    @property
    def validation_set(self) -> list[Example]:
        """Drawn from training data, never from an eval set."""
        ...

    @property
    def answer_tokens(self) -> int | None:
        """The most tokens a right answer takes (the warm-up's greedy decoding budget);
        None: as many as rollouts get (rollout.sampling.max_new_tokens)."""
        ...

    @property
    def max_prompt_len(self) -> int:
        """The longest prompt of any split, in tokens."""
        ...

    @property
    def episodes(self) -> EpisodeSetup | None:
        """Multi-turn: the environment, its tools and the chat renderer the prompts were
        rendered with (``env`` config); None: one response per prompt."""
        ...

    def train_stream(self, start: Mapping[str, Any] | None = None) -> PromptStream:
        """Training prompts in order, from the beginning or from ``start`` (a position
        an earlier stream of the same task reported): a resumed job continues the very
        sequence its lost attempt drew from, so no prompt is used twice or skipped."""
        ...

    def describe(self) -> str:
        """One line for the job's log: rows read, filtered and held out."""
        ...


@dataclass(frozen=True, kw_only=True)
class TaskContext:
    """What a task may read of the job beyond its own fields: the policy's checkpoint (for
    its tokenizer) and length, the rollouts' length, whether there is an RL stage, and the
    environment of multi-turn episodes."""

    hf_checkpoint: str | None
    max_position_embeddings: int
    max_new_tokens: int
    rl_steps: int
    env: EnvConfig
    vision: VisionConfig | None = None  # the policy's image side (a vision-language model)
    max_pixels: int | None = None

    @classmethod
    def of(cls, cfg: RootConfig) -> TaskContext:
        return cls(
            hf_checkpoint=cfg.model.hf_checkpoint,
            max_position_embeddings=cfg.model.max_position_embeddings,
            max_new_tokens=cfg.rollout.sampling.max_new_tokens, rl_steps=cfg.rl.steps,
            env=cfg.env, vision=cfg.model.vision, max_pixels=cfg.model.max_pixels,
        )  # fmt: skip


@dataclass(frozen=True)
class TaskKind:
    """A task as ``task=<name>`` names it (one module of rl/tasks/kinds/): its config (a
    :class:`~rl.config.schema.TaskConfig` subclass whose ``name`` default is the task's
    name, with the task's own fields); ``check`` its fields against the model and the
    rollouts, reading no data; ``build`` it (reads its data). Both take the task's config
    and the :class:`TaskContext`, and raise :class:`TaskError` in one line."""

    config: type[TaskConfig]
    check: Callable[[TaskConfig, TaskContext], None]
    build: Callable[[TaskConfig, TaskContext], Task]

    @property
    def name(self) -> str:
        return str(self.config.name)


def sft_batch(examples: Sequence[Example], pad_id: int) -> TrainBatch:
    """Prompt+target sequences, right-padded, with the loss on the target tokens only.

    ``loss_mask[:, t]`` weights the prediction of token ``t+1`` (the trainer's log-prob
    convention), so a row with a P-token prompt and a T-token target is 1 on
    ``[P-1, P-1+T)``. Right padding never moves a real position under causal attention."""
    import torch

    from rl.batch import TrainBatch

    missing = [e.uid for e in examples if not e.target_ids]
    if missing:
        raise TaskError(f"example {missing[0]} has no supervised target (no label)")
    rows = [list(e.prompt_ids) + list(e.target_ids or ()) for e in examples]
    seq = max(len(r) for r in rows)
    tokens = torch.full((len(rows), seq), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), seq, dtype=torch.float32)
    for i, (e, r) in enumerate(zip(examples, rows, strict=True)):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        p, n = len(e.prompt_ids), len(e.target_ids or ())
        trained = e.target_mask if e.target_mask is not None else (True,) * n
        mask[i, p - 1 : p - 1 + n] = torch.tensor(trained, dtype=torch.float32)
    return TrainBatch(tokens, mask)


def take(stream: Iterator[Example], count: int) -> list[Example]:
    return [next(stream) for _ in range(count)]
