"""The house's imports run one way: no cycle among k3patch's modules (function-local imports
counted, type-only imports not), the bottom modules import nothing above them, and the no-op
path (`status`, `apply --quiet`/`--json` on an applied tree) loads only the bottom of the house:
no libcst, typer, rich, pydantic or click, and no patch module."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

PACKAGE = Path(__file__).resolve().parent.parent / "k3patch"

# What every layer may import: errors, formats and the other standard-library leaves.
BOTTOM = {"errors", "formats", "shapes", "plaintext", "lock"}
# The no-op path: the bottom, the tree finder, exit codes and the fast path itself.
NO_OP = {
    "k3patch",
    "k3patch.errors",
    "k3patch.exitcodes",
    "k3patch.fastpath",
    "k3patch.formats",
    "k3patch.lock",
    "k3patch.patches",  # the package's own 4-line __init__, to find the patch sources
    "k3patch.plaintext",
    "k3patch.tree",
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
import atexit, runpy, sys
atexit.register(lambda: sys.stderr.write("MODULES " + " ".join(sorted(sys.modules)) + "\\n"))
sys.argv = ["k3patch", *sys.argv[1:]]
runpy.run_module("k3patch", run_name="__main__", alter_sys=True)
"""


@pytest.mark.wheel
@pytest.mark.parametrize(
    "command",
    [["status"], ["status", "--quiet"], ["status", "--json"], ["apply", "--quiet"], ["apply"]],
)
def test_the_no_op_path_loads_only_the_bottom(make_tree, command):
    site = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    proc = subprocess.run(
        [sys.executable, "-c", LOADED, *command, "--vllm", str(site)],
        capture_output=True,
        text=True,
        env={"NO_COLOR": "1", "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stderr.splitlines() if x.startswith("MODULES "))
    loaded = set(line.split()[1:])
    ours = {m for m in loaded if m == "k3patch" or m.startswith("k3patch.")}
    assert ours <= NO_OP, sorted(ours - NO_OP)
    assert not [m for m in loaded if m.split(".")[0] in HEAVY]


# Called as the `k3patch` script does (k3patch/bin/k3patch), not through runpy, which imports
# contextlib and importlib.util itself.
AS_SCRIPT = """
import atexit, sys
atexit.register(lambda: sys.stderr.write("MODULES " + " ".join(sorted(sys.modules)) + "\\n"))
sys.argv = ["k3patch", *sys.argv[1:]]
from k3patch.__main__ import main
main()
"""
# What a rank waiting on another's apply must not pay for before it sleeps, and what the no-op
# path must not pay for at all (OpenSSL's hashlib, where the interpreter has its own sha256).
NOT_WHILE_WAITING = {"json", "re", "enum", "hashlib", "_hashlib", "pathlib", "contextlib"}


@pytest.fixture(scope="module")
def bare_lib(tmp_path_factory) -> Path:
    """k3patch laid out as installed (patches inside), for an interpreter started with -S: no
    site, so no editable finder or .pth file imports pathlib or contextlib before we look."""
    import shutil

    lib = tmp_path_factory.mktemp("bare-lib")
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(PACKAGE, lib / "k3patch", ignore=skip)
    shutil.copytree(PACKAGE.parent / "patches", lib / "k3patch" / "patches", ignore=skip)
    return lib


def _run_bare(lib: Path, code: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"NO_COLOR": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(lib)}
    return subprocess.run(
        [sys.executable, "-S", "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=lib,  # `-c` puts the working directory first on sys.path: not the checkout's k3patch
    )


def _loaded(lib: Path, args: list[str]) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    proc = _run_bare(lib, AS_SCRIPT, *args)
    line = next(x for x in proc.stderr.splitlines() if x.startswith("MODULES "))
    at_start = set(_run_bare(lib, "import sys; print(' '.join(sys.modules))").stdout.split())
    return proc, set(line.split()[1:]) - at_start


@pytest.mark.wheel
def test_a_rank_that_waits_for_another_apply_loads_almost_nothing(make_tree, bare_lib):
    """32 ranks start on one fresh tree: 31 of them wait for the one that holds the lock. Each
    must reach its sleep having imported next to nothing (no json, no hashlib, no pathlib), so
    that their start-up does not steal the CPU the holder needs."""
    import fcntl
    import os

    site = make_tree("0.31.0")
    state = site / "vllm" / ".k3patch"
    state.mkdir()
    fd = os.open(state, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        args = ["apply", "--quiet", "--lock-timeout", "0", "--vllm", str(site)]
        proc, loaded = _loaded(bare_lib, args)
    finally:
        os.close(fd)
    assert proc.returncode == 3 and "holds the lock" in proc.stderr, proc.stderr
    assert not loaded & NOT_WHILE_WAITING, sorted(loaded & NOT_WHILE_WAITING)


@pytest.mark.wheel
@pytest.mark.parametrize(
    "command", [["apply", "--quiet"], ["apply", "--json"], ["status", "--json"], ["status"]]
)
def test_the_no_op_path_hashes_without_openssl(make_tree, bare_lib, command):
    site = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    proc, loaded = _loaded(bare_lib, [*command, "--vllm", str(site)])
    assert proc.returncode == 0 and "moriio-chunk-gate" in proc.stdout, proc.stderr[-800:]
    builtin = _run_bare(bare_lib, "import _sha2") if sys.version_info >= (3, 12) else None
    if builtin is None:
        builtin = _run_bare(bare_lib, "import _sha256")
    if builtin.returncode == 0:  # this interpreter has its own sha256: OpenSSL is not needed
        assert "_hashlib" not in loaded
    assert {"json", "re", "enum", "pathlib", "contextlib"}.isdisjoint(loaded), sorted(loaded)


def test_the_k3patch_script_is_the_one_the_import_tests_run(bare_lib):
    """The tests above run `from k3patch.__main__ import main` as k3patch/bin/k3patch does; a
    script that imported more (pip's generated one imports `re`) would make them moot."""
    script = (PACKAGE / "bin" / "k3patch").read_text()
    code = [line for line in script.splitlines() if line and not line.startswith("#")]
    assert code == ["import sys", "from k3patch.__main__ import main", "sys.exit(main())"]
    assert script.startswith("#!python\n")  # rewritten to the target interpreter by pip/uv
