"""The package's shape, as DESIGN.md's layer rules ask: checked on the source, so a change that breaks them fails here.

- no import cycle between modules, imports made only for type checking included (a cycle
  means two modules that cannot be understood, or tested, one without the other);
- the engine's modules stay small enough to read at once;
- the HTTP and cluster layers reach the engine only through its public face: never its
  runner, scheduler, output stage or the tokenizer behind the front door.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "llorch"
LINE_LIMITS = {"engine": 300, "api": 350}
# What api/ and replicas/ must not reach through an engine: its parts rather than its face.
ENGINE_PARTS = re.compile(r"engine\.(runner|scheduler|core|output|blocks|grammars)\b|\.front\.tokenizer\b")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        graph[name] = {other for other in found if other in modules and other != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_back_through_others() -> None:
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("layer", sorted(LINE_LIMITS))
def test_no_module_of_a_layer_outgrows_its_limit(layer: str) -> None:
    limit = LINE_LIMITS[layer]
    long = {path.name: n for path in (PACKAGE / layer).rglob("*.py")
            if (n := len(path.read_text().splitlines())) > limit}
    assert long == {}, f"modules of {layer}/ over {limit} lines"


@pytest.mark.parametrize("layer", ["api", "replicas"])
def test_the_http_and_cluster_layers_use_only_the_engine_s_face(layer: str) -> None:
    reaches = [f"{path.name}:{number}: {line.strip()}" for path in sorted((PACKAGE / layer).rglob("*.py"))
               for number, line in enumerate(path.read_text().splitlines(), 1) if ENGINE_PARTS.search(line)]
    assert reaches == []


def test_the_worker_programs_import_without_torch() -> None:
    """The CPU worker serves GGUF files on the C step without torch (whose import is about a second of
    start-up and 190 MB): the programs, the HTTP layer and the engine import it only where a path uses it."""
    code = ("import sys\nimport llorch.workers, llorch.api.app, llorch.engine.factory, llorch.engine.core\n"
            "sys.exit(sorted(m for m in sys.modules if m == 'torch') or 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr or result.stdout
