"""The package's import graph: no cycles, and the pipeline runs one way.

Every import counts (module level and inside functions), except those under ``if TYPE_CHECKING:``,
which never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"fsdpdoctor": REPO / "fsdpdoctor", "fsdpdoctor.rules": REPO / "rules"}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, root in PACKAGES.items():
        for p in root.rglob("*.py"):
            rel = p.relative_to(root).with_suffix("")
            parts = [x for x in rel.parts if x != "__init__"]
            out[".".join([pkg, *parts])] = p
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()

    def resolve(mod: str) -> str | None:
        while mod and mod not in known:
            mod = mod.rsplit(".", 1)[0] if "." in mod else ""
        return mod or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for n in node.orelse:
                visit(n)
            return
        if isinstance(node, ast.Import):
            for a in node.names:
                if (m := resolve(a.name)) is not None:
                    found.add(m)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                m = resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in known else resolve(base)
                if m is not None:
                    found.add(m)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found |= {p for m in found for p in _parents(m, name, known)}
    found.discard(name)
    return found


def _parents(mod: str, importer: str, known: set[str]) -> set[str]:
    """The packages whose ``__init__`` importing ``mod`` runs first: its parents, less those
    above the importer itself (they ran before it)."""
    parts, mine = mod.split("."), importer.split(".")
    above = {".".join(mine[:i]) for i in range(1, len(mine) + 1)}
    return {p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in known and p not in above}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    return {m: _imports(m, p, known) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_a_cycle_through_a_package_init_is_seen():
    """Importing a submodule runs its package's ``__init__``: a module importing
    ``pkg.helper`` while ``pkg/__init__`` imports that module is a cycle (it broke
    ``import fsdpdoctor.analysis.compute`` as a first import)."""
    known = {"p", "p.pkg", "p.pkg.helper", "p.user"}
    graph = {"p.pkg": {"p.user"}, "p.pkg.helper": set(), "p.user": {"p.pkg.helper"}}
    graph = {k: v | {x for m in v for x in _parents(m, k, known)} for k, v in graph.items()}
    assert _cycles(graph) == [["p.pkg", "p.user"]]


def test_the_pipeline_runs_one_way():
    """ingest never imports analysis, rules or report; analysis never imports rules or report; rules
    read RunFacts only (no ingest, no analysis)."""
    g = _graph()
    for m, deps in g.items():
        if m.startswith("fsdpdoctor.ingest"):
            assert not {
                d
                for d in deps
                if d.startswith(("fsdpdoctor.analysis", "fsdpdoctor.rules", "fsdpdoctor.report", "fsdpdoctor.api"))
            }, m
        if m.startswith("fsdpdoctor.analysis"):
            assert not {
                d
                for d in deps
                if d.startswith(("fsdpdoctor.rules", "fsdpdoctor.report", "fsdpdoctor.api", "fsdpdoctor.cli"))
            }, m
        if m.startswith("fsdpdoctor.rules"):
            assert not {
                d
                for d in deps
                if d.startswith(
                    (
                        "fsdpdoctor.report",
                        "fsdpdoctor.api",
                        "fsdpdoctor.cli",
                        "fsdpdoctor.ingest",
                        "fsdpdoctor.analysis",
                    )
                )
            }, m


def test_the_graph_sees_imports():
    """The checker itself: it finds a known edge of each kind (absolute, relative, lazy)."""
    g = _graph()
    assert "fsdpdoctor.facts" in g["fsdpdoctor.engine"]  # from .facts import RunFacts
    assert "fsdpdoctor.facts" in g["fsdpdoctor.rules._util"]  # absolute
    assert "fsdpdoctor.api" in g["fsdpdoctor.cli"]  # inside a function
    assert "fsdpdoctor.api" not in g["fsdpdoctor.report.markdown"]  # only under TYPE_CHECKING


def test_the_layout_shows_the_architecture():
    """Families are packages: the package root keeps the public API and entry points (at most 14
    modules), analysis/ at most 20 flat modules, no module past 800 lines (#44)."""
    root = sorted(p.name for p in (REPO / "fsdpdoctor").glob("*.py"))
    assert len(root) <= 14, root
    flat = sorted(p.name for p in (REPO / "fsdpdoctor" / "analysis").glob("*.py"))
    assert len(flat) <= 20, flat
    for pkg in ("cli", "facts", "capture", "savings"):
        assert (REPO / "fsdpdoctor" / pkg / "__init__.py").is_file(), pkg
    for fam in ("compare", "hang", "efficiency", "timeline", "ranks"):
        assert (REPO / "fsdpdoctor" / "analysis" / fam / "__init__.py").is_file(), fam
    # a family by file-name prefix is a package waiting to happen
    for prefix in ("cli_", "facts_", "capture_"):
        assert not list((REPO / "fsdpdoctor").glob(prefix + "*.py")), prefix
    for prefix in ("compare_", "hang_", "efficiency_", "timeline_", "rank_"):
        assert not list((REPO / "fsdpdoctor" / "analysis").glob(prefix + "*.py")), prefix
    long = {
        str(p.relative_to(REPO)): n
        for root_dir in PACKAGES.values()
        for p in root_dir.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 800
    }
    assert not long, long
