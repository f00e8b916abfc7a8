"""Stale bytecode, wherever this interpreter looks for it: apply and revert remove every pyc of a
changed file before the source changes (an unlink needs no space; Python compiles the new
source), so an unchecked-hash pyc can never keep the old code running; `status` never calls a site
good while an unchecked-hash pyc this interpreter would load holds other code."""

from __future__ import annotations

import importlib.util
import json
import os
import py_compile
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import run_cli, slow_after, tree_hashes
from disk_setups import CONNECTOR, ROOT_ONLY, preflight_fail, run_as_nobody, shared_site

pytestmark = pytest.mark.wheel
MODES = {
    "timestamp": py_compile.PycInvalidationMode.TIMESTAMP,
    "checked-hash": py_compile.PycInvalidationMode.CHECKED_HASH,
    "unchecked-hash": py_compile.PycInvalidationMode.UNCHECKED_HASH,
}
AITER = "_aiter_ops.py"


def compile_pyc(source: Path, mode: str = "unchecked-hash", optimize: int = 0) -> Path:
    """The pyc this interpreter would load for `source` (sys.pycache_prefix included)."""
    pyc = importlib.util.cache_from_source(str(source), optimization=optimize or "")
    py_compile.compile(str(source), cfile=pyc, optimize=optimize, invalidation_mode=MODES[mode])
    return Path(pyc)


def with_prefix(prefix: Path | None) -> dict[str, str]:
    return {"PYTHONPYCACHEPREFIX": str(prefix)} if prefix else {}


@pytest.mark.parametrize("mode", slow_after(list(MODES)))
@pytest.mark.parametrize("optimize", slow_after([0, 1]))
def test_pycs_are_removed_by_apply_and_revert_in_every_mode(make_tree, mode, optimize):
    site = make_tree("0.31.0")
    pyc = compile_pyc(site / "vllm" / AITER, mode, optimize)
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    assert not pyc.exists(), "apply left the old bytecode"
    compile_pyc(site / "vllm" / AITER, mode, optimize)  # the patched code, compiled
    assert run_cli("revert", "--vllm", str(site)).returncode == 0
    assert not pyc.exists(), "revert left the patched bytecode"


def test_foreign_interpreter_pyc_is_removed(make_tree):
    site = make_tree("0.31.0")
    cache = site / "vllm" / "__pycache__"
    cache.mkdir()
    other_tag = "cpython-399" if sys.implementation.cache_tag != "cpython-399" else "cpython-398"
    foreign = cache / f"_aiter_ops.{other_tag}.pyc"
    foreign.write_bytes(b"\x00\x00\r\n" + b"\x01\x00\x00\x00" + b"\x00" * 8 + b"stale")
    unrelated = cache / f"envs.{sys.implementation.cache_tag}.pyc"
    unrelated.write_bytes(b"untouched")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    assert not foreign.exists()
    assert unrelated.read_bytes() == b"untouched"


def test_apply_removes_the_pyc_under_pycacheprefix(make_tree, tmp_path, monkeypatch):
    """PYTHONPYCACHEPREFIX set for k3patch and vLLM alike: Python reads the bytecode under the
    prefix (never `__pycache__`); an unchecked-hash pyc there must go with the apply."""
    site = make_tree("0.31.0")
    prefix = tmp_path / "prefix"
    monkeypatch.setattr(sys, "pycache_prefix", str(prefix))
    pyc = compile_pyc(site / "vllm" / AITER)
    assert str(pyc).startswith(str(prefix))
    proc = run_cli("apply", "--vllm", str(site), env=with_prefix(prefix))
    assert proc.returncode == 0, proc.stderr
    assert not pyc.exists(), "the unchecked-hash pyc under the prefix keeps the old code"
    assert str(pyc) in proc.stdout, proc.stdout  # the bytecode line names what it removed


@pytest.mark.parametrize("where", slow_after(["prefix", "__pycache__"]))
def test_status_never_says_applied_while_python_runs_other_bytecode(
    make_tree, tmp_path, monkeypatch, where
):
    """An unchecked-hash pyc of the original code that this interpreter would load (under the
    prefix after an apply run without it; or compiled back into `__pycache__` from the wheel's
    file): status reads pending (exit 1) and names it, on the no-op path too; the digest
    differs; apply removes it and nothing else; then status reads applied again."""
    site = make_tree("0.31.0")
    prefix = tmp_path / "prefix" if where == "prefix" else None
    original = site.parent / "original.py"
    shutil.copy2(site / "vllm" / AITER, original)
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    clean = json.loads(run_cli("status", "--json", "--vllm", str(site)).stdout)["digest"]
    # The original code's bytecode where this interpreter looks for the patched file's.
    monkeypatch.setattr(sys, "pycache_prefix", str(prefix) if prefix else None)
    pyc = Path(importlib.util.cache_from_source(str(site / "vllm" / AITER)))
    pyc.parent.mkdir(parents=True, exist_ok=True)
    py_compile.compile(str(original), cfile=str(pyc), invalidation_mode=MODES["unchecked-hash"])
    env = with_prefix(prefix)
    quiet = run_cli("status", "--quiet", "--vllm", str(site), env=env)
    assert quiet.returncode == 1, quiet.stdout
    assert "aiter-mla-gfx942: pending" in quiet.stdout
    full = json.loads(run_cli("status", "--json", "--vllm", str(site), env=env).stdout)
    assert full["exit_code"] == 1 and full["digest"] != clean
    detail = full["patches"][0]["sites"][0]["detail"]
    assert str(pyc) in detail and "unchecked-hash" in detail, detail
    before = tree_hashes(site)
    fixed = run_cli("apply", "--vllm", str(site), env=env)
    assert fixed.returncode == 0, (fixed.stdout, fixed.stderr)
    assert not pyc.exists()
    assert tree_hashes(site) == {k: v for k, v in before.items() if "__pycache__" not in k}
    again = json.loads(run_cli("status", "--json", "--vllm", str(site), env=env).stdout)
    assert again["exit_code"] == 0 and again["digest"] == clean


# -- A `__pycache__` the tree's owner cannot write ----------------------------------------------


def nobodys(site: Path) -> None:
    for path in [site, *site.rglob("*")]:
        os.chown(path, 65534, 65534, follow_symlinks=False)


@ROOT_ONLY
def test_roots_pycache_does_not_stop_the_owner(make_tree):
    """Root ran `python -c 'import vllm'` once in the owner's tree: `__pycache__` and its
    timestamp pycs are root's. The owner's apply and revert succeed (the pycs are left, noted:
    Python sees they are stale), no journal is left, and every later run works."""
    with shared_site(make_tree) as site:
        nobodys(site)
        pyc = compile_pyc(site / "vllm" / AITER, "timestamp")  # root's, in root's directory
        assert pyc.parent.stat().st_uid == 0
        for args in (["apply"], ["revert"], ["apply"], ["revert"]):
            code, stdout, stderr = run_as_nobody([*args, "--vllm", str(site)])
            assert code == 0, (args, stdout, stderr)
            assert not (site / "vllm/.k3patch/journal.json").exists()
        assert pyc.exists() and "left" in stdout and pyc.name in stdout


@ROOT_ONLY
def test_an_unchecked_hash_pyc_the_owner_cannot_remove_is_refused_before_any_write(make_tree):
    with shared_site(make_tree) as site:
        nobodys(site)
        pyc = compile_pyc(site / "vllm" / AITER, "unchecked-hash")
        before = tree_hashes(site)
        code, stdout, stderr = run_as_nobody(["apply", "--vllm", str(site)])
        assert code == 3, (stdout, stderr)
        assert len(stderr.splitlines()) == 1 and "unchecked-hash" in stderr, stderr
        assert str(pyc) in stderr
        assert tree_hashes(site) == before
        assert not (site / "vllm/.k3patch").exists()


def test_a_temp_file_left_in_pycache_by_a_killed_run_is_removed(make_tree):
    """A run killed while it wrote bytecode (k3patch before this design wrote pycs through a
    temp file) left `.NAME.pyc.k3patch-tmp.HEX` in `__pycache__`: the next run's recovery
    removes it."""
    site = make_tree("0.31.0")
    env = {"K3PATCH_TEST_CRASH_AT": f"replaced:{AITER}"}
    assert run_cli("apply", "--vllm", str(site), env=env).returncode == 137
    cache = site / "vllm" / "__pycache__"
    cache.mkdir(exist_ok=True)
    litter = (
        cache / f".{AITER[:-3]}.{sys.implementation.cache_tag}.pyc.k3patch-tmp.0123456789abcdef"
    )
    litter.write_bytes(b"half a pyc")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    assert not litter.exists()


KILL_IN_PYCACHE = """
import os, sys
real_open = os.open
def open_then_die(path, flags, mode=0o777, *, dir_fd=None):
    fd = real_open(path, flags, mode, dir_fd=dir_fd)
    if ".k3patch-tmp." in str(path) and dir_fd is not None:
        if os.readlink(f"/proc/self/fd/{dir_fd}").endswith("__pycache__"):
            os._exit(137)  # kill -9 while a pyc is being written
    return fd
os.open = open_then_die
sys.argv = ["k3patch", *sys.argv[1:]]
from k3patch.__main__ import main
main()
"""


@pytest.mark.parametrize("command", slow_after(["apply", "revert"]))
def test_no_run_writes_a_temp_file_into_pycache(make_tree, command):
    """Killed the instant a temp file appears in `__pycache__`: no run ever makes one (the
    bytecode is removed, never written), so none can be left."""
    site = make_tree("0.31.0")
    if command == "revert":
        assert run_cli("apply", "--vllm", str(site)).returncode == 0
    compile_pyc(site / "vllm" / AITER)
    proc = subprocess.run(
        [sys.executable, "-c", KILL_IN_PYCACHE, command, "--vllm", str(site)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr)
    assert not [p for p in site.rglob("*") if ".k3patch-tmp." in p.name]


# -- The code import runs, judged as import judges it -------------------------------------------
# SourceFileLoader.get_code() finds and validates the pyc exactly as an import would
# (PYTHONPYCACHEPREFIX included); its code object is compared with compile() of the .py on disk.

TARGETS = [AITER, CONNECTOR]

RUNS_CURRENT = textwrap.dedent(
    """
    import sys, os, importlib.machinery as m
    def key(co):
        return (co.co_code, co.co_names, co.co_varnames, co.co_freevars, co.co_cellvars,
                tuple(key(c) if hasattr(c, 'co_code') else (type(c).__name__, repr(c))
                      for c in co.co_consts))
    pkg = sys.argv[1]; stale = []
    for rel in sys.argv[2:]:
        path = os.path.abspath(os.path.join(pkg, rel))
        loader = m.SourceFileLoader(rel[:-3].replace('/', '.'), path)
        code = loader.get_code(loader.name)
        fresh = compile(open(path, 'rb').read(), path, 'exec', dont_inherit=True,
                        optimize=sys.flags.optimize)
        if key(code) != key(fresh):
            stale.append(rel)
    print(' '.join(stale))
    """
)


def _stale(pkg: Path, env: dict[str, str]) -> list[str]:
    """The targets whose import would run other code than their .py on disk now."""
    proc = subprocess.run(
        [sys.executable, "-c", RUNS_CURRENT, str(pkg), *TARGETS],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=True,
    )
    return proc.stdout.split()


def _compile_unchecked(files: list[Path], env: dict[str, str]) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "compileall",
            "-q",
            "--invalidation-mode",
            "unchecked-hash",
            *map(str, files),
        ],
        env={**os.environ, **env},
        check=True,
    )


@pytest.fixture
def prefix_tree(make_tree, tmp_path) -> tuple[Path, dict[str, str]]:
    """A 0.31.0 package dir whose targets have unchecked-hash pycs of their original code under
    PYTHONPYCACHEPREFIX, and the environment that sets that prefix (for k3patch too)."""
    pkg = make_tree("0.31.0") / "vllm"
    env = {"PYTHONPYCACHEPREFIX": str(tmp_path / "pycache-prefix")}
    _compile_unchecked([pkg / rel for rel in TARGETS], env)
    return pkg, env


def test_status_never_says_applied_while_a_pycache_prefix_pyc_holds_the_old_code(prefix_tree):
    """With PYTHONPYCACHEPREFIX (set for k3patch too) holding unchecked-hash pycs of the
    original code, apply and status never leave "applied" standing while the interpreter
    would run those pycs."""
    pkg, env = prefix_tree
    site = pkg.parent
    applied = run_cli("apply", "--quiet", "--vllm", str(site), env=env)
    status = run_cli("status", "--quiet", "--vllm", str(site), env=env)
    stale = _stale(pkg, env)
    says_applied = status.returncode == 0 and "aiter-mla-gfx942: applied" in status.stdout
    assert not (says_applied and stale), (
        f"apply rc={applied.returncode}, status rc={status.returncode} says applied, but import "
        f"runs the old code of {stale} (pycs under PYTHONPYCACHEPREFIX)"
    )


def test_the_plugin_refuses_a_tree_whose_pycache_prefix_holds_the_old_code(prefix_tree, tmp_path):
    """K3PATCH_PREFLIGHT=fail never lets vLLM start on the old code of a pycache prefix. apply
    removes the prefix's pycs, so they are put back after it, as an image layer or a restored
    build cache would: the unchecked-hash pycs of the original code under the prefix."""
    pkg, env = prefix_tree
    site = pkg.parent
    prefix = Path(env["PYTHONPYCACHEPREFIX"])
    saved = tmp_path / "saved-prefix"
    shutil.copytree(prefix, saved)
    assert run_cli("apply", "--quiet", "--vllm", str(site), env=env).returncode == 0
    shutil.copytree(saved, prefix, dirs_exist_ok=True)  # the old pycs come back after apply
    stale = _stale(pkg, env)
    assert stale, "precondition: the prefix pycs are stale"
    proc = preflight_fail(pkg, env)
    assert proc.returncode != 0, f"preflight passed while {stale} run old code"


def test_no_command_says_applied_while_an_in_tree_unchecked_pyc_holds_the_old_code(
    make_tree, tmp_path
):
    """An unchecked-hash pyc of the original code in the tree's own __pycache__ after the
    apply: import runs the old code, so status (both paths), a no-op apply and the plugin must
    not say applied."""
    site = make_tree("0.31.0")
    pkg = site / "vllm"
    orig = tmp_path / "orig"
    orig.mkdir()
    (orig / "_aiter_ops.py").write_bytes((pkg / AITER).read_bytes())
    _compile_unchecked([orig / "_aiter_ops.py"], {})
    assert run_cli("apply", "--quiet", "--vllm", str(site)).returncode == 0
    (pkg / "__pycache__").mkdir(exist_ok=True)
    for pyc in (orig / "__pycache__").iterdir():
        (pkg / "__pycache__" / pyc.name).write_bytes(pyc.read_bytes())
    stale = _stale(pkg, {})
    assert stale == [AITER], "precondition: the old pyc is what import runs"

    status = run_cli("status", "--quiet", "--vllm", str(site))
    slow = run_cli("status", "--quiet", "--vllm", str(site), env={"K3PATCH_NO_FASTPATH": "1"})
    plugin = preflight_fail(pkg, {})  # before the apply below, which removes the pyc
    again = run_cli("apply", "--quiet", "--vllm", str(site))
    problems = [
        name
        for name, proc in [("status", status), ("status (no fast path)", slow)]
        if proc.returncode == 0 and "aiter-mla-gfx942: applied" in proc.stdout
    ]
    if again.returncode == 0 and _stale(pkg, {}):
        problems.append("apply exit 0 leaving the old code running")
    if plugin.returncode == 0:
        problems.append("plugin (fail) passed")
    assert not problems, f"old code of {stale} runs, yet: {problems}"


def test_recovery_leaves_no_bytecode_that_runs_other_code_than_the_source(make_tree):
    """An apply killed after its renames, then an unchecked-hash compile of the patched files
    (a `compileall --invalidation-mode unchecked-hash` image step, before anything ran k3patch
    again), then `revert`: recovery rolls the sources back to the originals and must remove
    that pyc too, which Python loads without looking at the source; left, the reverted tree
    runs the patched code."""
    site = make_tree("0.31.0")
    proc = run_cli(
        "apply", "--vllm", str(site), "-q", env={"K3PATCH_TEST_CRASH_AT": "kept-removed"}
    )
    assert proc.returncode == 137
    source = site / "vllm/_aiter_ops.py"
    pyc = Path(
        py_compile.compile(
            str(source), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH
        )
    )
    proc = run_cli("revert", "--vllm", str(site))
    assert proc.returncode == 0, proc.stderr
    if pyc.exists():
        data = pyc.read_bytes()
        unchecked = int.from_bytes(data[4:8], "little") == 1
        same = data[8:16] == importlib.util.source_hash(source.read_bytes())
        assert not unchecked or same, "an unchecked-hash pyc of the patched code outlived revert"
