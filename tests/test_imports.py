"""The house's imports run one way: no cycle among k3patch's modules (function-local imports
counted, type-only imports not), the bottom modules import nothing above them, and the no-op
path (`status`, `apply --quiet`/`--json`/in a log on an applied tree, and a rank waiting for
another's apply) loads only the bottom of the house: the standard library as it likes, but no
libcst, typer, rich, pydantic or click, no patch module, and nothing of the engine that
classifies (model, shapes, engine, registry, transaction)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, slow_after

PACKAGE = Path(__file__).resolve().parent.parent / "k3patch"

# What every layer may import: errors, the formats, the verdicts and the other leaves.
BOTTOM = {
    "errors",
    "formats",
    "verdicts",
    "shapes",
    "astkit",
    "plaintext",
    "safefs",
    "lock",
    "version",
}
# The no-op path: the bottom, the record, the tree finder, exit codes and the fast path itself.
NO_OP = {
    "k3patch",
    "k3patch.__main__",
    "k3patch.errors",
    "k3patch.exitcodes",
    "k3patch.fastpath",
    "k3patch.formats",
    "k3patch.lock",
    "k3patch.patches",  # the package's own __init__: the TARGETS table, no patch
    "k3patch.plaintext",
    "k3patch.pycache",  # finds an unchecked-hash pyc that Python would run instead of a target
    "k3patch.safefs",
    "k3patch.state",
    "k3patch.tree",
    "k3patch.version",
    "k3patch.verdicts",
}
HEAVY = ("libcst", "typer", "rich", "pydantic", "click")


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return getattr(test, "id", None) == "TYPE_CHECKING" or getattr(test, "attr", None) == (
        "TYPE_CHECKING"
    )


def imports_of(path: Path) -> set[str]:
    """The k3patch modules `path` imports anywhere (functions included), type-only ones not."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.ImportFrom) and child.module:
                if child.module == "k3patch":
                    found.update(a.name for a in child.names)
                elif child.module.startswith("k3patch."):
                    found.add(child.module.split(".")[1])
            elif isinstance(child, ast.Import):
                found.update(
                    a.name.split(".")[1] for a in child.names if a.name.startswith("k3patch.")
                )
            visit(child)

    visit(ast.parse(path.read_text()))
    modules = {p.stem for p in PACKAGE.glob("*.py")}
    return (found & modules) - {path.stem}


def import_graph() -> dict[str, set[str]]:
    return {p.stem: imports_of(p) for p in PACKAGE.glob("*.py")}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_among_k3patch_modules():
    assert cycles(import_graph()) == []


def test_the_bottom_imports_nothing_above_it():
    graph = import_graph()
    for module in sorted(BOTTOM):
        assert graph[module] <= BOTTOM, (module, graph[module] - BOTTOM)


LOADED = """
import atexit, sys
atexit.register(lambda: sys.stderr.write("MODULES " + " ".join(sorted(sys.modules)) + "\\n"))
sys.argv = ["k3patch", *sys.argv[1:]]
from k3patch.__main__ import main
main()
"""


def loaded_by(*args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run k3patch as its console script does (`k3patch.__main__:main`) and name every module
    the process had loaded at exit."""
    proc = subprocess.run(
        [sys.executable, "-c", LOADED, *args],
        capture_output=True,
        text=True,
        env={"NO_COLOR": "1", "PATH": "/usr/bin:/bin"},
    )
    line = next(x for x in proc.stderr.splitlines() if x.startswith("MODULES "))
    return proc, set(line.split()[1:])


def assert_only_the_bottom(loaded: set[str]) -> None:
    ours = {m for m in loaded if m == "k3patch" or m.startswith("k3patch.")}
    assert ours <= NO_OP, sorted(ours - NO_OP)
    assert not [m for m in loaded if m.split(".")[0] in HEAVY]


@pytest.mark.wheel
@pytest.mark.parametrize(
    "command",
    slow_after(
        [
            ["status"],
            ["status", "--quiet"],
            ["status", "--json"],
            ["status", "--digest"],
            ["apply", "--quiet"],
            ["apply", "--json"],
            ["apply"],
        ]
    ),
)
def test_the_no_op_path_loads_only_the_bottom(make_tree, command):
    site = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    proc, loaded = loaded_by(*command, "--vllm", str(site))
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-800:]
    assert_only_the_bottom(loaded)


@pytest.mark.wheel
def test_a_rank_that_waits_for_another_apply_loads_only_the_bottom(make_tree):
    """32 ranks start on one fresh tree: 31 of them wait for the one that holds the lock. Each
    reaches its sleep (here: its timeout) without typer, rich, libcst or a patch module, so
    that their start-up does not steal the CPU the holder needs."""
    import fcntl
    import os

    site = make_tree("0.31.0")
    fd = os.open(site / "vllm", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        proc, loaded = loaded_by("apply", "--quiet", "--lock-timeout", "0", "--vllm", str(site))
    finally:
        os.close(fd)
    assert proc.returncode == 3 and "holds the lock" in proc.stderr, proc.stderr
    assert_only_the_bottom(loaded)
