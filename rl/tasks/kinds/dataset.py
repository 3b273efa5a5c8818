"""Prompt files of the user's (JSONL, JSON, Parquet) as a task.

Each row holds a prompt under ``task.prompt_key`` (a string, or a chat ``messages`` list of
``{role, content}``, or a string of JSON that spells such a list, as parquet files often
store a conversation column: it is used as that list), a label under ``task.label_key``
and optional metadata keys; the label and metadata go to the reward function untouched,
and the label's text is the warm-up's supervised target. Prompts are rendered once, at
construction, through the model's tokenizer (chat template with the assistant turn
opened, optional system prompt), so everything wrong with the data is found before any
rank starts: a missing file, a row without the prompt key (file and line named), an
empty dataset, every prompt too long.

Pure logic: no torch.distributed, no Megatron.
"""

from __future__ import annotations

import glob
import json
import os
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from rl.config.schema import TaskConfig
from rl.envs import setup as episode_setup
from rl.envs.setup import EpisodeSetup
from rl.tasks.common import Example, TaskContext, TaskError, TaskKind, resume_position
from rl.tasks.tokenizer import HFCodec
from rl.tasks.vision import ImagePrompts, SkippedRow

if TYPE_CHECKING:
    from rl.envs.chat import ChatTokenizer

SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass
class DatasetTaskConfig(TaskConfig):
    """Prompt files of the user's: JSONL, JSON (a list of objects) or Parquet, as paths or
    globs. Rows carry the prompt (a string or a chat messages list) under ``prompt_key`` and
    the label under ``label_key``; the label and ``metadata_keys`` go to the reward
    function. The tokenizer (and its chat template) is model.hf_checkpoint's unless
    ``tokenizer`` names another directory. ``eval_size``: rows held out of train_files for
    evaluation when eval_files is empty (0: none), or the cap on rows read from
    eval_files."""

    name: str = "dataset"
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"  # a string, or a chat ``messages`` list of {role, content}
    label_key: str = "label"  # handed to the reward function; the warm-up's target text
    metadata_keys: list[str] = field(default_factory=list)  # handed to the reward function
    # Multi-turn (env): a key holding a demonstration, the messages that follow the prompt
    # (assistant turns and the tool results answering them); the warm-up's target instead
    # of the label's text, trained on the assistant turns only.
    demo_key: str | None = None
    system_prompt: str | None = None
    apply_chat_template: bool = True  # render with the tokenizer's chat template
    max_prompt_tokens: int | None = None  # longer prompts are dropped (and counted)
    shuffle: bool = True
    epochs: int | None = None  # passes over train_files; null: as many as the run needs
    tokenizer: str | None = None  # an HF directory; null: model.hf_checkpoint
    # A vision-language policy's images: a key holding one image or a list of them (paths
    # relative to the file's directory or absolute, data URIs, bytes), placed before the
    # first user message's text. Null: text prompts.
    image_key: str | None = None


VALIDATION_MAX = 64  # rows for warm-up decisions: enough to see a trend, cheap to decode


def expand(patterns: list[str], field: str) -> list[Path]:
    """Files matching ``patterns`` (paths or globs), each pattern matching at least one."""
    files: list[Path] = []
    for pat in patterns:
        found = sorted(glob.glob(os.path.expanduser(pat), recursive=True))
        if not found:
            raise TaskError(f"{field}: no file matches {pat!r}")
        for f in map(Path, found):
            if f.suffix not in SUFFIXES:
                raise TaskError(f"{field}: {str(f)!r} is not one of {', '.join(SUFFIXES)}")
            files.append(f)
    return files


def read_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` for every row of one file; ``where`` names the file and line/row."""
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TaskError(f"{path} line {n}: not valid JSON ({e.msg})") from None
                yield f"{path} line {n}", _object(row, f"{path} line {n}")
        return
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise TaskError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(data, list):
            raise TaskError(f"{path}: a .json dataset must be a list of objects")
        for n, row in enumerate(data):
            yield f"{path} row {n}", _object(row, f"{path} row {n}")
        return
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow's errors carry the reason in the message
        raise TaskError(f"{path}: not a readable Parquet file ({e})") from None
    for n, row in enumerate(rows):
        yield f"{path} row {n}", row


def _object(row: object, where: str) -> dict[str, Any]:
    if not isinstance(row, dict):
        raise TaskError(f"{where}: a row must be a JSON object, not {type(row).__name__}")
    return row


def _decoded(value: object) -> object:
    """A string that holds a JSON list of messages (``[{"role": ...}, ...]``, as parquet
    files often store a conversation column) is that list; any other string is the text."""
    if isinstance(value, str) and value.lstrip().startswith("[{"):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        if isinstance(parsed, list) and all(isinstance(m, dict) and "role" in m for m in parsed):
            return parsed  # checked as any messages list is: a malformed one is refused
    return value


def _messages(value: Any, where: str, key: str) -> list[dict[str, str]]:  # a JSON value
    value = _decoded(value)
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    ok = (
        isinstance(value, list)
        and value
        and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
    )
    if not ok:
        raise TaskError(
            f"{where}: {key!r} must be a string or a non-empty list of {{role, content}} "
            f"messages, not {str(value)[:60]!r}"
        )
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _demo(value: Any, where: str, key: str) -> list[dict[str, Any]]:  # a JSON value
    """A demonstration: a list of messages, each with a role and a string content (a
    tool's may carry its name)."""
    value = _decoded(value)
    ok = isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in value
    )
    if not ok or not value:
        raise TaskError(
            f"{where}: {key!r} (task.demo_key) must be a non-empty list of {{role, content}} "
            f"messages, not {str(value)[:60]!r}"
        )
    return [dict(m) for m in value]


class DatasetTask:
    name = "dataset"
    answer_tokens = None

    def __init__(
        self,
        cfg: DatasetTaskConfig,
        codec: HFCodec,
        episodes: EpisodeSetup | None = None,
        images: ImagePrompts | None = None,
    ):
        """``episodes``: multi-turn; prompts are rendered with its environment's tools.
        ``images``: the rows' images under ``task.image_key``."""
        self.cfg, self.codec, self.episodes, self.images = cfg, codec, episodes, images
        if cfg.image_key and (episodes is not None or not cfg.apply_chat_template):
            raise TaskError(
                f"task.image_key={cfg.image_key!r} needs task.apply_chat_template=true (the "
                "template places the images) and no env.tools/env.cls"
            )
        if episodes is not None and not cfg.apply_chat_template:
            raise TaskError("env.tools/env.cls need task.apply_chat_template=true")
        if cfg.demo_key and episodes is None:
            raise TaskError(
                f"task.demo_key={cfg.demo_key!r} needs env.tools or env.cls (a demonstration is "
                "rendered as an episode's turns)"
            )
        if cfg.apply_chat_template and not codec.has_chat_template and episodes is None:
            raise TaskError(
                "task.apply_chat_template=true but the tokenizer has no chat template "
                "(set task.apply_chat_template=false)"
            )
        limit = cfg.max_prompt_tokens
        if limit is not None and limit < 1:
            raise TaskError(f"task.max_prompt_tokens={limit} must be >= 1 or null")
        if cfg.epochs is not None and cfg.epochs < 1:
            raise TaskError(f"task.epochs={cfg.epochs} must be >= 1 or null")
        if cfg.eval_size < 0:
            raise TaskError(f"task.eval_size={cfg.eval_size} must be >= 0")
        if not cfg.train_files:
            raise TaskError("task.train_files is empty: give the prompt files (paths or globs)")
        self.files = expand(list(cfg.train_files), "task.train_files")
        train, self.dropped = self._load(self.files, "task.train_files")
        if cfg.eval_files:
            eval_files = expand(list(cfg.eval_files), "task.eval_files")
            evals, self.eval_dropped = self._load(eval_files, "task.eval_files")
            if cfg.eval_size:
                evals = evals[: cfg.eval_size]
        else:
            self.eval_dropped = 0
            if cfg.eval_size >= len(train):
                raise TaskError(
                    f"task.eval_size={cfg.eval_size} holds out every one of the {len(train)} "
                    "training prompts (lower it, or give task.eval_files)"
                )
            order = list(range(len(train)))
            random.Random(f"{cfg.seed}/eval").shuffle(order)
            held = set(order[: cfg.eval_size])
            evals = [e for i, e in enumerate(train) if i in held]
            train = [e for i, e in enumerate(train) if i not in held]
        self.train = train
        self.eval_sets = {"eval": evals} if evals else {}
        pick = random.Random(f"{cfg.seed}/validation").sample(
            range(len(train)), min(VALIDATION_MAX, cfg.eval_size or VALIDATION_MAX, len(train))
        )
        self.validation_set = [train[i] for i in sorted(pick)]
        self.max_prompt_len = max(len(e.prompt_ids) for e in [*train, *evals])

    def _load(self, files: list[Path], field: str) -> tuple[list[Example], int]:
        c, out, dropped, shortest = self.cfg, [], 0, None
        for f in files:
            for where, row in read_rows(f):
                if c.prompt_key not in row:
                    raise TaskError(
                        f"{where}: no key {c.prompt_key!r} (task.prompt_key; the row has "
                        f"{', '.join(sorted(map(str, row))) or 'no keys'})"
                    )
                missing = [k for k in c.metadata_keys if k not in row]
                if missing:
                    raise TaskError(f"{where}: no key {missing[0]!r} (task.metadata_keys)")
                try:
                    ex = self._example(where, row, f.parent)
                except SkippedRow as e:
                    assert self.images is not None
                    self.images.skip(where, e)
                    continue
                n = len(ex.prompt_ids)
                if c.max_prompt_tokens is not None and n > c.max_prompt_tokens:
                    dropped += 1
                    shortest = n if shortest is None else min(shortest, n)
                    continue
                out.append(ex)
        if not out and self.images is not None and self.images.skipped:
            raise TaskError(f"{field}: every row was skipped for its images: "
                            f"{self.images.describe()}")  # fmt: skip
        if not out and dropped:
            raise TaskError(
                f"task.max_prompt_tokens={c.max_prompt_tokens} drops every prompt of {field} "
                f"({dropped} of {dropped}; the shortest has {shortest} tokens)"
            )
        if not out:
            raise TaskError(f"{field}: no rows in {', '.join(map(str, files))}")
        return out, dropped

    def _example(self, where: str, row: dict[str, Any], base: Path) -> Example:
        c = self.cfg
        messages: list[dict[str, Any]] = _messages(row[c.prompt_key], where, c.prompt_key)
        if c.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": c.system_prompt}, *messages]
        refs: tuple[str, ...] = ()
        if self.images is not None and c.image_key:
            if row.get(c.image_key) is None:
                raise TaskError(f"{where}: no key {c.image_key!r} (task.image_key)")
            refs = self.images.refs(row[c.image_key], base)
            messages = self.images.with_images(messages, len(refs))
        if not c.apply_chat_template and len(messages) > 1 and not c.system_prompt:
            raise TaskError(f"{where}: a messages list needs task.apply_chat_template=true")
        start: list[dict[str, Any]] = []
        if self.episodes is None:
            ids, text = self.codec.render(messages, c.apply_chat_template)
            if self.images is not None:
                ids = self.images.expand(ids, refs)
        else:  # the environment starts the episode from the row and the task's messages
            try:
                start = self.episodes.env.reset({**row, "messages": messages})
                text = self.episodes.chat.text(start, opened=True)
            except Exception as e:  # a user's environment: name the row it failed on
                raise TaskError(f"{where}: the environment's reset failed: "
                                f"{type(e).__name__}: {e}") from None  # fmt: skip
            ids = self.episodes.chat.encode(text)
        label = row.get(c.label_key)
        target, mask = None, None
        if c.demo_key and self.episodes is not None:  # a row without one has no target
            if row.get(c.demo_key) is not None:
                demo = _demo(row[c.demo_key], where, c.demo_key)
                target, mask = self._demonstration(where, start, demo)
        elif label is not None:
            target = (*self.codec.encode(str(label)), self.codec.end_id)
        return Example(
            uid=where,
            prompt_ids=tuple(ids),
            prompt_text=text,
            label=label,
            metadata={k: row[k] for k in c.metadata_keys},
            target_ids=target,
            messages=tuple(start),
            target_mask=mask,
            images=refs,
        )

    def _demonstration(
        self, where: str, start: list[dict[str, Any]], demo: list[dict[str, Any]]
    ) -> tuple[tuple[int, ...], tuple[bool, ...]]:
        """The warm-up's target and its loss mask: ``demo`` as an episode would hold it."""
        assert self.episodes is not None
        try:
            ids, trained = self.episodes.chat.demonstration(start, demo)
        except ValueError as e:  # ChatError: the demonstration's shape
            raise TaskError(f"{where}: {self.cfg.demo_key!r} (task.demo_key): {e}") from None
        return tuple(ids), tuple(trained)

    def train_stream(self, start: Mapping[str, Any] | None = None) -> DatasetStream:
        return DatasetStream(self, start)

    def describe(self) -> str:
        c = self.cfg
        cut = f", {self.dropped} longer than task.max_prompt_tokens={c.max_prompt_tokens}"
        evals = sum(len(v) for v in self.eval_sets.values())
        skipped = f"; {self.images.describe()}" if self.images and self.images.skipped else ""
        return (
            f"task dataset: {len(self.train)} training prompts from {len(self.files)} file(s)"
            f"{cut if self.dropped else ''}{skipped}; {evals} eval prompts"
            f"{' (held out of the training files)' if not c.eval_files else ''}; prompts up "
            f"to {self.max_prompt_len} tokens"
        )


class DatasetStream:
    """The training prompts epoch after epoch, each epoch in its own order (seeded by
    ``task.seed`` and the epoch): every prompt once per epoch. Its position is the epoch
    and the offset within it, so a resumed job continues the same epoch's order."""

    def __init__(self, task: DatasetTask, start: Mapping[str, Any] | None = None):
        self.task = task
        self.epoch = self.offset = 0
        if start is not None:
            self.epoch, self.offset = resume_position(start, self._fixed(), ("epoch", "offset"))
            if self.offset > len(task.train):
                raise TaskError(
                    f"the saved prompt stream's offset={self.offset} is past the epoch's "
                    f"{len(task.train)} prompts"
                )
        self._order: list[int] | None = None

    def _fixed(self) -> dict[str, Any]:
        c = self.task.cfg
        return {"task": "dataset", "seed": c.seed, "shuffle": c.shuffle,
                "size": len(self.task.train)}  # fmt: skip

    def position(self) -> dict[str, Any]:
        return {**self._fixed(), "epoch": self.epoch, "offset": self.offset}

    def __iter__(self) -> DatasetStream:
        return self

    def __next__(self) -> Example:
        c, n = self.task.cfg, len(self.task.train)
        if self.offset == n:
            self.epoch, self.offset, self._order = self.epoch + 1, 0, None
        if c.epochs is not None and self.epoch >= c.epochs:
            raise TaskError(f"task.epochs={c.epochs}: the training prompts ran out ({n} per pass)")
        if self._order is None:
            self._order = list(range(n))
            if c.shuffle:  # "/0/": the orders runs have always had
                random.Random(f"{c.seed}/0/{self.epoch}").shuffle(self._order)
        self.offset += 1
        return self.task.train[self._order[self.offset - 1]]


def check_config(task: TaskConfig, ctx: TaskContext) -> None:
    t = cast(DatasetTaskConfig, task)
    if not (t.prompt_key and t.label_key):
        raise TaskError(f"task.prompt_key={t.prompt_key!r} and task.label_key must be named")


def build(task: TaskConfig, ctx: TaskContext) -> DatasetTask:
    t = cast(DatasetTaskConfig, task)
    path, field = (t.tokenizer, "task.tokenizer") if t.tokenizer else (
        ctx.hf_checkpoint, "model.hf_checkpoint")  # fmt: skip
    if not path:
        raise TaskError("task=dataset needs a tokenizer: set model.hf_checkpoint or task.tokenizer")
    codec = HFCodec(path, field)
    episodes = None
    if episode_setup.enabled(ctx.env):
        try:
            # transformers' tokenizer, whose signatures are wider than the protocol's
            tok = cast("ChatTokenizer", codec.tok)
            episodes = episode_setup.build(ctx.env, tok, codec.end_id)
        except episode_setup.EnvError as e:
            raise TaskError(str(e)) from None
    # A vision-language policy's prompts are checked for image tokens even without images.
    images = None
    if t.image_key or ctx.vision is not None:
        images = ImagePrompts(path, ctx.vision, ctx.max_pixels, t.image_key)
    return DatasetTask(t, codec, episodes, images)


TASK = TaskKind(DatasetTaskConfig, check_config, build)
