"""README.md and docs/*.md: every relative link resolves and every command composes.

**Links.** Every markdown link and image, ``[text](target)`` and ``![alt](target)``,
outside code: a relative ``target`` exists relative to the file that holds it, and a
``#anchor`` (alone, or after the path) is the GitHub anchor of a heading in the target
(lowercased, spaces to ``-``, punctuation other than ``-`` and ``_`` dropped, ``-1``,
``-2`` for repeats) or an ``<a id=...>``/``<a name=...>`` there. ``http(s):`` and
``mailto:`` targets are skipped.

**Commands.** The lines of fenced code blocks, and inline code spans that begin with a
command, that run the main job or its two tools: ``python -m rl.train``,
``python -m rl.plan``, ``python -m rl.simulate`` (any interpreter path; under
``rl.runtime.torchrun`` too), and what runs ``rl.train`` with the overrides it is given:
``make run ARGS="..."``, ``launch/local.sh ...``, ``sbatch ... launch/slurm/train.sbatch
...``. A line is read as a shell reads it: ``\\`` continuations joined, ``$ `` prompts and
``#`` comments dropped, quotes removed, ``&&``/``;``/``|`` chains split, ``VAR=value``
prefixes skipped. Each command is checked by what its entry point runs before it starts
a process, in this process (no command is spawned):

- ``rl.train``: the overrides composed (``rl.compose.compose``, as ``check_overrides``),
  then ``rl.checks.check_job`` (the ``PrelaunchCheck`` callback: the model resolved, every
  value, the task's data read and rendered, the files the config names), then
  ``rl.checkpoints.resume.read`` of the run directory (``main``). ``run.output_dir`` is a
  temporary directory not made yet (a first launch) unless the command sets it;
  ``hydra.*`` overrides are left to Hydra, as ``check_overrides`` leaves them.
- ``rl.plan``: ``rl.checks.compose_resolved`` and ``plan_cluster(strict=False)``; the
  plan must fit (``--json``, ``--ranks-per-node``, ``--node-ranks`` change only the output).
- ``rl.simulate``: ``compose_resolved`` and ``simulate`` (``--json PATH`` is not written).

An inline span with no arguments (``python -m rl.simulate`` in a sentence) names a tool
and is not a command.

That is done only for a command whose config names nothing a user (or a tool, first)
must make: no placeholder (``<overrides>``, ``[overrides]``, ``...``, a value holding
``<...>`` or ``/path/to/``) and no input that is missing from this checkout (a string of
the composed config that names a path, ``path.py:fn`` or ``module:fn``, outside
``run.output_dir``: the user's model, data, reward file, or a model or dataset a tool in
tools/ writes). Such a command is checked by composition only: the placeholders dropped,
a missing ``model.hf_checkpoint`` replaced by a stand-in HF directory (the config.json of
Qwen2.5-1.5B-Instruct and a safetensors file of no tensor), and ``compose_resolved``
(every key exists and takes its value's type, every group choice exists, the model's
config.json is read).

**Documented failures.** In a fenced block, a command after a ``$ `` prompt whose output
lines (up to the next prompt) hold a ``config error: ...``, ``plan refused: ...`` or
``resume error: ...`` line must fail with exactly that line, as the entry point prints
it; any other command must pass.

The helpers take the text and its path, so the two tests at the end feed a broken link
and a renamed option through the same functions.
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from omegaconf import DictConfig

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# ---------------------------------------------------------------------------------------
# Markdown structure


FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*)`(?!`)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def split_fences(text: str) -> tuple[list[tuple[int, str]], list[list[tuple[int, str]]]]:
    """The lines outside fenced code blocks, and each block's lines, as (1-based line
    number, line)."""
    prose: list[tuple[int, str]] = []
    blocks: list[list[tuple[int, str]]] = []
    block: list[tuple[int, str]] | None = None
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            if block is None:
                block = []
            else:
                blocks.append(block)
                block = None
        elif block is not None:
            block.append((n, line))
        else:
            prose.append((n, line))
    if block is not None:
        blocks.append(block)
    return prose, blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").replace("*", "")
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page has: its headings' (outside code) and its HTML anchors."""
    prose, _ = split_fences(text)
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in prose:
        if m := HEADING.match(line):
            base = slug(m.group(2))
            k = seen.get(base, 0)
            seen[base] = k + 1
            out.add(base if k == 0 else f"{base}-{k}")
        out.update(HTML_ANCHOR.findall(line))
    return out


def prose_spans(text: str) -> list[tuple[int, str]]:
    """Paragraphs outside fenced blocks, each as (first line number, its text), so that an
    inline code span broken over two lines is one span."""
    prose, _ = split_fences(text)
    paras: list[tuple[int, str]] = []
    start, lines, last = 0, [], -1
    for n, line in prose:
        if not line.strip() or n != last + 1:
            if lines:
                paras.append((start, "\n".join(lines)))
            start, lines = n, []
        if line.strip():
            if not lines:
                start = n
            lines.append(line)
        last = n
    if lines:
        paras.append((start, "\n".join(lines)))
    return paras


# ---------------------------------------------------------------------------------------
# Links


@dataclass(frozen=True)
class Link:
    line: int
    target: str


def links(text: str) -> list[Link]:
    """Every link and image outside code."""
    out = []
    for start, para in prose_spans(text):
        masked = INLINE_CODE.sub(lambda m: "`" + "x" * len(m.group(1)) + "`", para)
        for m in LINK.finditer(masked):
            out.append(Link(start + masked.count("\n", 0, m.start()), m.group(1)))
    return out


def link_problems(path: Path, text: str | None = None) -> list[str]:
    """One line per link of ``path`` (its ``text``, if given) that does not resolve."""
    text = path.read_text() if text is None else text
    problems = []
    for link in links(text):
        target = link.target
        if re.match(r"(https?|mailto):", target):
            continue
        where = f"{path.name}:{link.line}: ({target})"
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{where}: {file_part} does not exist")
            continue
        if anchor:
            if dest.is_dir() or dest.suffix != ".md":
                problems.append(f"{where}: #{anchor} on {file_part}, which is not a page")
            elif anchor not in anchors(dest.read_text() if dest != path else text):
                problems.append(f"{where}: no heading of {dest.name} has the anchor #{anchor}")
    return problems


# ---------------------------------------------------------------------------------------
# Commands

ENTRY = ("rl.train", "rl.plan", "rl.simulate")
EXPECTED = re.compile(r"^(config error|plan refused|resume error): ")
PLACEHOLDER = re.compile(r"^(<[^>]*>|\[[^=\]]*\]|\.\.\.|…)$")
PLACEHOLDER_VALUE = re.compile(r"<[^>]*>|/path/to/|\.\.\.")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PLAN_FLAGS = ("--json", "--ranks-per-node", "--node-ranks")


@dataclass(frozen=True)
class Command:
    file: str
    line: int
    text: str  # the shell line as shown, continuations joined
    entry: str  # rl.train, rl.plan or rl.simulate
    args: tuple[str, ...]
    expected: str | None  # the error line the docs show it failing with

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def words(shell: str) -> list[list[str]]:
    """A shell line's commands (split at ``&&``, ``;``, ``|``), each its words, quotes
    removed, from a ``#`` comment on dropped."""
    lex = shlex.shlex(shell, posix=True, punctuation_chars="&;|")
    lex.whitespace_split = True
    lex.commenters = ""
    try:
        tokens = list(lex)
    except ValueError:  # unbalanced quotes: not a shell line
        return []
    out: list[list[str]] = [[]]
    for tok in tokens:
        if tok.startswith("#"):
            break
        if tok and set(tok) <= set("&;|"):
            out.append([])
        else:
            out[-1].append(tok)
    return [w for w in out if w]


def entry_point(argv: list[str]) -> tuple[str, list[str]] | None:
    """The entry point one command runs and its arguments, if it runs one of ours."""
    while argv and ASSIGNMENT.match(argv[0]):  # FOO=bar prefixes
        argv = argv[1:]
    if not argv:
        return None
    if re.search(r"(^|/)python3?(\.\d+)?$", argv[0]):
        for i in range(1, len(argv) - 1):
            if argv[i] == "-m" and argv[i + 1] in ENTRY:
                return argv[i + 1], argv[i + 2 :]
        return None
    if argv[0] == "make" and "run" in argv[1:]:
        make_args = [a.partition("=")[2] for a in argv[1:] if a.startswith("ARGS=")]
        return "rl.train", [a for v in make_args for a in shlex.split(v)]
    for i, word in enumerate(argv):
        if word.endswith(("launch/local.sh", "launch/slurm/train.sbatch")):
            return "rl.train", argv[i + 1 :]
    return None


def _commands_in(file: str, line: int, shell: str, expected: str | None) -> list[Command]:
    out = []
    for argv in words(shell):
        if (found := entry_point(argv)) is not None:
            entry, args = found
            out.append(Command(file, line, shell, entry, tuple(args), expected))
    return out


def commands(name: str, text: str) -> list[Command]:
    """Every command of ours in ``text``: fenced blocks' lines, and inline code spans that
    begin with a command."""
    out: list[Command] = []
    _, blocks = split_fences(text)
    for block in blocks:
        prompted = any(line.lstrip().startswith("$ ") for _, line in block)
        i = 0
        while i < len(block):
            n, line = block[i]
            shell = line.strip()
            while shell.endswith("\\") and i + 1 < len(block):
                i += 1
                shell = shell[:-1].rstrip() + " " + block[i][1].strip()
            i += 1
            if prompted and not shell.startswith("$ "):
                continue  # a line of output
            shell = shell.removeprefix("$ ")
            expected = None
            if prompted:  # its output: up to the next prompt
                j = i
                while j < len(block) and not block[j][1].lstrip().startswith("$ "):
                    if EXPECTED.match(block[j][1].strip()):
                        expected = block[j][1].strip()
                    j += 1
            out += _commands_in(name, n, shell, expected)
    for start, para in prose_spans(text):
        for m in INLINE_CODE.finditer(para):
            span = " ".join(m.group(1).split())
            if re.match(r"(\S*python3?\s+-m\s+rl\.|make\s+run\b|\S*launch/|sbatch\s)", span):
                line = start + para.count("\n", 0, m.start())
                out += [c for c in _commands_in(name, line, span, None) if c.args]
    return out


# What the stand-in for a user's model holds: Qwen2.5-1.5B-Instruct's config.json.
STANDIN_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


def _leaves(node: object, key: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _leaves(v, f"{key}[{i}]")
    else:
        yield key, node


def _missing(value: str) -> bool:
    """A config string that names an input (a path, ``path.py:fn``, ``module:fn``) that
    this checkout does not hold."""
    if "${" in value or "://" in value or " " in value:  # interpolations, URLs, prose
        return False
    path, sep, attr = value.rpartition(":")
    if sep and re.fullmatch(r"\w+", attr) and re.fullmatch(r"[\w.]+", path):
        try:
            return importlib.util.find_spec(path) is None
        except (ImportError, ValueError):
            return True
    if sep and path.endswith(".py"):
        value = path
    if "/" not in value and not re.search(r"\.(py|jsonl?|parquet|txt|jinja)$", value):
        return False
    p = Path(value).expanduser()
    p = p if p.is_absolute() else ROOT / p
    return not glob.glob(str(p))


def missing_inputs(cfg: DictConfig) -> list[str]:
    """The composed config's inputs missing here (``run.output_dir`` is an output)."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=False)
    return [
        f"{k}={v}"
        for k, v in _leaves(tree)
        if isinstance(v, str) and not k.startswith(("run.", "hydra.")) and _missing(v)
    ]


def _split_flags(cmd: Command) -> tuple[list[str], str | None]:
    """The overrides, and a one-line error for a flag the entry point refuses."""
    args = list(cmd.args)
    if cmd.entry == "rl.plan":
        args = [a for a in args if a not in PLAN_FLAGS]
    elif cmd.entry == "rl.simulate" and "--json" in args:
        i = args.index("--json")
        del args[i : i + 2]
    flags = [a for a in args if a.startswith("-")]
    if flags:
        return args, f"unknown option {flags[0]} for python -m {cmd.entry}"
    return args, None


def run_checks(cmd: Command, standin: Path, out_dir: Path) -> tuple[str, str | None]:
    """Check one command as the docstring says: (the kind of check it got, the one line
    the entry point prints for it, or None where it would start)."""
    args, flag_error = _split_flags(cmd)
    if flag_error:
        return "flags", flag_error
    return _checks(cmd.entry, tuple(args), standin, out_dir)


@functools.cache
def _checks(
    entry: str, argv: tuple[str, ...], standin: Path, out_dir: Path
) -> tuple[str, str | None]:
    """:func:`run_checks` after the flags, once per distinct command (a command shown on
    two pages is composed once)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from rl.checkpoints import resume
    from rl.checks import check_job, compose_resolved, resolve_model
    from rl.compose import compose
    from rl.config import ConfigError, composition_error

    held = [a for a in argv if PLACEHOLDER.match(a)]
    args = [a for a in argv if not PLACEHOLDER.match(a) and not a.startswith("hydra.")]
    held += [a for a in args if PLACEHOLDER_VALUE.search(a.partition("=")[2])]
    if entry == "rl.train" and not any(a.startswith("run.output_dir=") for a in args):
        args.append(f"run.output_dir={out_dir}")  # composes the same; checked writable
    try:  # rl.train's check_overrides; compose_resolved's first half for the tools
        cfg = compose(args)
    except (HydraException, OmegaConfBaseException) as e:
        return "compose", f"config error: {composition_error(e)}"
    if held or missing_inputs(cfg):
        hf = cfg.model.hf_checkpoint
        if hf and not (ROOT / str(hf)).exists():
            args.append(f"model.hf_checkpoint={standin}")
        try:
            compose_resolved(args)
        except ConfigError as e:
            return "compose", f"config error: {e}"
        return "compose", None
    if entry == "rl.train":
        try:
            check_job(cfg)
        except ConfigError as e:
            return "prelaunch", f"config error: {e}"
        try:
            if cfg.rl.steps > 0:
                resume.read(cfg.run.output_dir, cfg.rl.resume)
        except resume.ResumeError as e:
            return "prelaunch", f"resume error: {e}"
        return "prelaunch", None
    from rl.plan.cluster import plan_cluster
    from rl.plan.placement import PlanRefused
    from rl.simulate.simulation import simulate

    kind = entry.removeprefix("rl.")
    try:
        try:  # compose_resolved's second half
            resolve_model(cfg)
        except OmegaConfBaseException as e:
            raise ConfigError(str(e)) from None
        if entry == "rl.simulate":
            simulate(cfg)
            return kind, None
        plan = plan_cluster(cfg, strict=False)
    except PlanRefused as e:
        return kind, f"plan refused: {e}"
    except (ConfigError, OmegaConfBaseException) as e:
        return kind, f"config error: {e}"
    return kind, None if plan.fits else f"plan refused: {plan.problems[0]}"


def command_problem(cmd: Command, standin: Path, out_dir: Path) -> str | None:
    """One line saying what is wrong with a command as shown, or None."""
    kind, got = run_checks(cmd, standin, out_dir)
    if got == cmd.expected:
        return None
    where = f"{cmd.file}:{cmd.line}: {cmd.text}"
    if cmd.expected is None:
        return f"{where}\n  fails ({kind} check): {got}"
    return f"{where}\n  shown failing with: {cmd.expected}\n  but {kind} check gives: {got}"


def _all_commands() -> list[Command]:
    return [c for f in DOC_FILES for c in commands(str(f.relative_to(ROOT)), f.read_text())]


ALL_COMMANDS = _all_commands()


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("standin-model")
    (d / "config.json").write_text(json.dumps(STANDIN_CONFIG, indent=1))
    header = b"{}      "  # a safetensors file of no tensor: its header's length, then it
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    return d


# ---------------------------------------------------------------------------------------
# Tests


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    problems = link_problems(path)
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``run.output_dir`` of the rl.train commands: not there yet (checked writable, and
    no resume state in it), as for a first launch."""
    return tmp_path_factory.mktemp("docs-run") / "run"


@pytest.mark.parametrize("cmd", ALL_COMMANDS, ids=lambda c: c.id)
def test_every_command_passes_its_entry_points_checks(
    cmd: Command, standin: Path, out_dir: Path
) -> None:
    problem = command_problem(cmd, standin, out_dir)
    assert problem is None, problem


def test_the_docs_commands_are_found() -> None:
    """The parser sees the README's commands, its documented failure among them, and
    every page's index entry exists."""
    readme = [c for c in ALL_COMMANDS if c.file == "README.md"]
    assert any(c.entry == "rl.train" and c.expected for c in readme), readme
    assert {c.entry for c in ALL_COMMANDS} == set(ENTRY), ALL_COMMANDS
    index = (ROOT / "docs" / "README.md").read_text()
    for page in DOC_FILES[1:]:
        assert page.name == "README.md" or f"({page.name}" in index, page.name


def test_a_broken_link_is_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## LoRA's cost: 4.9x\n")
    (tmp_path / "pic.png").write_bytes(b"\x89PNG")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nGood: [x](other.md), [y](other.md#loras-cost-49x), ![p](pic.png), "
        "[z](#page), [w](https://example.com/none), `[code](nowhere.md)`.\n\n"
        "Bad: [a](missing.md) and\n![b](gone.png), [c](other.md#lora-cost).\n"
        "```\n[in a block](nowhere.md)\n```\n"
    )
    problems = link_problems(page)
    assert problems == [
        "page.md:5: (missing.md): missing.md does not exist",
        "page.md:6: (gone.png): gone.png does not exist",
        "page.md:6: (other.md#lora-cost): no heading of other.md has the anchor #lora-cost",
    ], problems


def test_a_renamed_option_is_reported(standin: Path, tmp_path: Path) -> None:
    text = (
        "Run\n\n```bash\nV=$(tools/setup_env.sh) && PYTHONPATH=. $V/bin/python -m rl.train \\\n"
        '  rl.stepz=3   # renamed\n```\n\n```\n$ make run ARGS="trainer.tp=4"\n'
        "config error: trainer.tp=3 does not divide model.num_attention_heads=6\n```\n\n"
        "and `python -m rl.plan experiment=llama3_8b_256gpu trainer.tpp=2`.\n"
    )
    cmds = commands("sample.md", text)
    assert [(c.line, c.entry, c.args) for c in cmds] == [
        (4, "rl.train", ("rl.stepz=3",)),
        (9, "rl.train", ("trainer.tp=4",)),
        (13, "rl.plan", ("experiment=llama3_8b_256gpu", "trainer.tpp=2")),
    ]
    problems = [command_problem(c, standin, tmp_path / "run") for c in cmds]
    assert all(problems), problems
    assert "Could not override 'rl.stepz'" in str(problems[0]), problems[0]
    assert "trainer.tp=4 does not divide model.num_attention_heads=6" in str(problems[1])
    assert "trainer.tpp" in str(problems[2]), problems[2]
