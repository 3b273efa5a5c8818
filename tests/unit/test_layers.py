"""The package's import graph: no cycles, and every module in one declared layer.

The layers themselves are checked by ``lint-imports`` (``.importlinter``) in ``make lint``;
tests/multiproc/test_layers_contract.py shows that contract failing on an upward import.
"""

from __future__ import annotations

import ast
import configparser
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / ".importlinter"


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("rl", include_external_packages=False)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                    break
                if child in on:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    scc = []
                    while True:
                        m = stack.pop()
                        on.discard(m)
                        scc.append(m)
                        if m == node:
                            break
                    if len(scc) > 1:
                        out.append(sorted(scc))
    return out


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_package_modules(graph: grimp.ImportGraph) -> None:
    """Every import counts, including the ones inside functions: a lazy import that closes
    a loop is still two modules that each need the other."""
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _cycles(edges) == []


def _layers() -> list[list[str]]:
    cp = configparser.ConfigParser()
    cp.read(CONTRACT)
    raw = cp["importlinter:contract:layers"]["layers"]
    return [
        ["rl." + m.strip() for m in line.replace("|", ":").split(":")]
        for line in raw.strip().splitlines()
    ]


def test_every_module_sits_in_exactly_one_layer(graph: grimp.ImportGraph) -> None:
    """A new module that no layer names would escape the contract."""
    layers = [m for layer in _layers() for m in layer]
    for module in sorted(graph.modules - {"rl"}):
        package = (ROOT / module.replace(".", "/") / "__init__.py").exists()
        if package and module not in layers and not graph.find_modules_directly_imported_by(module):
            continue  # a package whose modules sit in different layers, importing nothing
        owners = [m for m in layers if module == m or module.startswith(m + ".")]
        assert len(owners) == 1, f"{module} is in layers {owners} of .importlinter"


def _pure_layers() -> list[list[str]]:
    """The layers below the transport (``dist | metrics``): pure logic."""
    layers = _layers()
    return layers[layers.index(["rl.runtime", "rl.checkpoints", "rl.metrics"]) + 1 :]


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def test_pure_logic_imports_no_torch_distributed() -> None:
    """Pure logic runs anywhere, with no process group (import-linter sees only top-level
    external packages, so torch.distributed is checked here)."""
    bad = []
    modules = [m for layer in _pure_layers() for m in layer]
    assert "rl.config" in modules and "rl.ddma.plan" in modules and len(modules) > 15
    for module in modules:
        base = ROOT / module.replace(".", "/")
        files = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
        for f in files:
            hits = {n for n in _imports(f) if n.split(".")[:2] == ["torch", "distributed"]}
            bad += [f"{f.relative_to(ROOT)}: {n}" for n in sorted(hits)]
    assert bad == []
