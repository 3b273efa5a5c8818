"""How the code is entered: executors given only their own config, constructors called with
keywords, and the controller's threads named in one place. Read from the source (ast), so
these run in milliseconds and import nothing heavy."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXECUTORS = ("trainer", "generator", "reward", "companion")
# The one module per executor that reads the whole job's config: it splits off the
# executor's settings at the entry point, and builds what needs the task (the trainer's
# warm-up, the generator's start-up directory) or checks the executor's part before launch
# (each model executor's use: a critic, a reward model; the package picks the use's).
READS_ROOT_CONFIG = {
    "rl/trainer/startup.py", "rl/generator/startup.py", "rl/companion/__init__.py",
    "rl/companion/critic.py", "rl/companion/reward_model.py", "rl/companion/teacher.py",
    "rl/companion/settings.py",
}  # fmt: skip
MAX_POSITIONAL = 4


def _mentions(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    return any(
        (isinstance(n, ast.Name) and n.id == name)
        or (isinstance(n, ast.alias) and n.name == name)
        or (isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value == name)
        for n in ast.walk(tree)
    )


def test_only_the_documented_modules_of_the_executors_read_the_root_config():
    found = {
        str(p.relative_to(ROOT))
        for e in EXECUTORS
        for p in sorted((ROOT / "rl" / e).rglob("*.py"))
        if _mentions(p, "RootConfig")
    }
    assert found == READS_ROOT_CONFIG


def test_a_task_kind_sees_its_own_config_and_the_task_context_only():
    kinds = sorted((ROOT / "rl" / "tasks" / "kinds").glob("*.py"))
    assert kinds and [p.name for p in kinds if _mentions(p, "RootConfig")] == []


@pytest.mark.parametrize("executor", EXECUTORS)
def test_serve_takes_its_executors_settings(executor):
    tree = ast.parse((ROOT / "rl" / executor / "service.py").read_text())
    serve = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "serve")
    first = serve.args.args[0].annotation
    assert first is not None and ast.unparse(first) != "RootConfig"
    assert not any("RootConfig" in ast.unparse(a) for a in ast.walk(serve.args))


def _dataclass(c: ast.ClassDef) -> ast.expr | None:
    for d in c.decorator_list:
        f = d.func if isinstance(d, ast.Call) else d
        if (getattr(f, "id", None) or getattr(f, "attr", None)) == "dataclass":
            return d
    return None


def _positional_fields(c: ast.ClassDef, decorator: ast.expr) -> list[str]:
    """A dataclass's fields its ``__init__`` takes by position (up to ``_: KW_ONLY``)."""
    if isinstance(decorator, ast.Call) and any(k.arg == "kw_only" for k in decorator.keywords):
        return []
    out = []
    for s in c.body:
        if not (isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)):
            continue
        kind = ast.unparse(s.annotation)
        if kind == "KW_ONLY":
            break
        no_init = isinstance(s.value, ast.Call) and any(
            k.arg == "init" and getattr(k.value, "value", True) is False for k in s.value.keywords
        )
        if "ClassVar" not in kind and not no_init:
            out.append(s.target.id)
    return out


def crowded_constructors(source: str, where: str = "") -> list[str]:
    """Classes whose constructor takes more than MAX_POSITIONAL parameters by position: an
    ``__init__``, or a dataclass's fields (configs, which Hydra builds, aside)."""
    out = []
    for c in ast.walk(ast.parse(source)):
        if not isinstance(c, ast.ClassDef):
            continue
        for f in c.body:
            if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                positional = [*f.args.posonlyargs, *f.args.args][1:]  # self
                if len(positional) > MAX_POSITIONAL:
                    out.append(f"{where}:{f.lineno} {c.name}: {len(positional)} positional")
        decorator = _dataclass(c)
        if decorator is not None and not c.name.endswith("Config"):
            fields = _positional_fields(c, decorator)
            if len(fields) > MAX_POSITIONAL:
                out.append(f"{where}:{c.lineno} {c.name}: {len(fields)} positional fields")
    return out


def test_constructors_take_more_than_four_parameters_as_keywords():
    crowded = [
        hit
        for p in sorted((ROOT / "rl").rglob("*.py"))
        for hit in crowded_constructors(p.read_text(), str(p.relative_to(ROOT)))
    ]
    assert crowded == []


def test_a_crowded_constructor_is_found():
    bad = "class A:\n    def __init__(self, a, b, c, d, e=1):\n        pass\n"
    good = "class A:\n    def __init__(self, a, b, c, d, *, e=1):\n        pass\n"
    assert crowded_constructors(bad, "x.py") == ["x.py:2 A: 5 positional"]
    assert crowded_constructors(good) == []
    record = "@dataclass\nclass R:\n    a: int\n    b: int\n    c: int\n    d: int\n"
    assert crowded_constructors(record + "    e: int = 0\n", "r.py") == [
        "r.py:2 R: 5 positional fields"
    ]
    assert crowded_constructors(record + "    _: KW_ONLY\n    e: int = 0\n") == []


# The modules that run in the controller's process beside the steps.
CONTROLLER_PROCESS = [*sorted((ROOT / "rl" / "controller").glob("*.py")),
                      ROOT / "rl" / "generator" / "client.py",
                      ROOT / "rl" / "generator" / "ddma_target.py",
                      ROOT / "rl" / "reward" / "service.py",
                      ROOT / "rl" / "envs" / "tools.py"]  # fmt: skip
STARTERS = ("start_thread", "named_thread", "thread_pool", "Background")


def _threads_of(path: Path) -> tuple[set[str], list[str]]:
    """The thread names a module gives (literal, or an f-string's literal head, as a
    prefix ending in "*"), and each place that starts a thread not through rl.threads."""
    names, stray = set(), []
    for n in ast.walk(ast.parse(path.read_text())):
        if not isinstance(n, ast.Call):
            continue
        f = n.func
        called = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        if called in ("Thread", "ThreadPoolExecutor", "Timer"):
            stray.append(f"{path}:{n.lineno} {called}")
        if called in STARTERS and n.args:
            first = n.args[0]
            if isinstance(first, ast.Constant):
                names.add(first.value)
            elif isinstance(first, ast.JoinedStr) and isinstance(first.values[0], ast.Constant):
                names.add(first.values[0].value + "*")
    return names, stray


def test_every_thread_beside_the_steps_is_named_in_one_place():
    from rl.threads import THREADS

    found = [_threads_of(p) for p in CONTROLLER_PROCESS]
    assert [s for _, stray in found for s in stray] == []
    assert set().union(*(names for names, _ in found)) == set(THREADS)


def test_a_thread_not_in_the_table_is_refused_and_a_stray_one_found(tmp_path):
    from rl.threads import named_thread, registered, start_thread, thread_pool

    assert registered("tool-calculator") and not registered("tool-") and registered("env")
    for start in (named_thread, start_thread):
        with pytest.raises(ValueError, match=r"^thread 'mine' is not named in rl/threads\.py"):
            start("mine", print)
    with pytest.raises(ValueError, match="'pool' is not named"):
        thread_pool("pool", 1)
    src = tmp_path / "m.py"
    src.write_text("import threading\nthreading.Thread(target=print).start()\n"
                   "start_thread(f'tool-{x}', print)\n")  # fmt: skip
    names, stray = _threads_of(src)
    assert names == {"tool-*"} and len(stray) == 1
