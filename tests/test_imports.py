"""The package's import graph has no cycle, counting imports inside functions too:
a cycle hidden in a function is still a cycle (start-up order, double work)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

PACKAGE = "mps_exporter"
ROOT = Path(__file__).resolve().parents[1] / "exporter"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PACKAGE, *parts])


def imports(path: Path, known: Set[str]) -> Set[str]:
    """The package's own modules `path` imports, anywhere in the file."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: Set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name.replace("exporter", PACKAGE, 1) if alias.name.startswith("exporter") else alias.name
                       for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            # `from . import x` names a module where x is one.
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def graph() -> Dict[str, Set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    edges = {name: imports(path, set(files)) for name, path in files.items()}
    # The source registry imports every module of its package by listing it.
    registry = f"{PACKAGE}.sources.registry"
    edges[registry] |= {n for n in files if n.startswith(f"{PACKAGE}.sources.") and n != registry}
    return edges


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    found: List[List[str]] = []
    state: Dict[str, int] = {}  # 1: on the current path, 2: done
    path: List[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node)
    return found


def test_the_detector_finds_a_cycle_through_a_function_level_import(tmp_path):
    (tmp_path / "a.py").write_text("from . import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from .a import x\n    return x\n")
    known = {f"{PACKAGE}.a", f"{PACKAGE}.b"}
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        edges = {m: imports(tmp_path / (m.rsplit(".", 1)[1] + ".py"), known) for m in known}
    finally:
        ROOT = saved
    assert cycles(edges) == [[f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.a"]]


def test_no_import_cycle_in_the_package():
    edges = graph()
    assert f"{PACKAGE}.cli" in edges and edges[f"{PACKAGE}.cli"], "the graph is empty: the detector is broken"
    assert cycles(edges) == []


# Modules that read a library, a program, /proc or files: the sources and the log pipeline.
IO_MODULES = {f"{PACKAGE}.logs.{m}" for m in ("follower", "pipeline", "statefile", "liveness")}


def io_module(name: str) -> bool:
    return name.startswith(f"{PACKAGE}.sources.") or name in IO_MODULES


def reached(edges: Dict[str, Set[str]], start: str) -> Set[str]:
    """Every module importing `start` runs: what it imports, anywhere, and the packages above each."""
    seen: Set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parents = [name.rsplit(".", i)[0] for i in range(1, name.count("."))]
        todo.extend([*edges.get(name, ()), *(p for p in parents if p in edges)])
    return seen


def test_the_pure_join_reaches_no_source_and_no_log_io():
    edges = graph()
    assert any(io_module(n) for n in reached(edges, f"{PACKAGE}.collector")), "the check is broken"
    for pure in ("render", "model", "logs.render", "families", "contract"):
        assert sorted(n for n in reached(edges, f"{PACKAGE}.{pure}") if io_module(n)) == [], pure


def test_the_plain_data_does_not_import_the_log_state_machine():
    assert f"{PACKAGE}.logs.state" not in reached(graph(), f"{PACKAGE}.model")


def test_importing_render_loads_no_source_and_no_log_io():
    # The same at run time, package __init__ files and all.
    import subprocess
    import sys

    code = "import sys, mps_exporter.render; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                            check=True).stdout.split()
    assert f"{PACKAGE}.render" in loaded
    assert [n for n in loaded if io_module(n)] == []
    assert "pynvml" not in loaded


def test_the_http_package_imports_nothing_of_the_collector():
    """The HTTP stack knows the collector only as a registry that encodes itself
    (httpd.web.SelfEncoding), not by importing it, at any depth (issue 39)."""
    edges = graph()
    reached: Set[str] = set()
    todo = [n for n in edges if n.startswith(f"{PACKAGE}.httpd")]
    while todo:
        node = todo.pop()
        for nxt in edges[node] - reached:
            reached.add(nxt)
            todo.append(nxt)
    assert f"{PACKAGE}.collector" not in reached
    assert not {n for n in reached if n.startswith((f"{PACKAGE}.render", f"{PACKAGE}.join", f"{PACKAGE}.sources"))}
