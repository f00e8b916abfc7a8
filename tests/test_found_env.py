"""Defects found by the attack-env review (FOUND.md): promises about the environment k3patch runs
in that the code breaks. Each test fails on the code as reviewed (0b96e9e).

"The code that runs" is proven as import does it: SourceFileLoader.get_code() finds and validates
the pyc exactly as an import would (PYTHONPYCACHEPREFIX included), and its code object is compared
with compile() of the .py on disk now.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import run_cli

AITER = "_aiter_ops.py"
MORIIO = "distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"
TARGETS = [AITER, MORIIO]

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

PREFLIGHT = textwrap.dedent(
    """
    import sys, types
    pkg = sys.argv[1]
    m = types.ModuleType('vllm'); m.__file__ = pkg + '/__init__.py'; m.__path__ = [pkg]
    sys.modules['vllm'] = m
    from k3patch.plugin import preflight
    preflight()
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


def _preflight_fail(pkg: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PREFLIGHT, str(pkg)],
        capture_output=True,
        text=True,
        env={**os.environ, **env, "K3PATCH_PREFLIGHT": "fail"},
    )


@pytest.fixture
def prefix_tree(make_tree, tmp_path) -> tuple[Path, dict[str, str]]:
    """A 0.31.0 package dir whose targets have unchecked-hash pycs of their original code under
    PYTHONPYCACHEPREFIX, and the environment that sets that prefix (for k3patch too)."""
    pkg = make_tree("0.31.0") / "vllm"
    env = {"PYTHONPYCACHEPREFIX": str(tmp_path / "pycache-prefix")}
    _compile_unchecked([pkg / rel for rel in TARGETS], env)
    return pkg, env


FINDER = (
    "import importlib.machinery as m, sys\n"
    "f = m.FileFinder(sys.argv[1], (m.ExtensionFileLoader, m.EXTENSION_SUFFIXES),"
    " (m.SourceFileLoader, m.SOURCE_SUFFIXES), (m.SourcelessFileLoader, m.BYTECODE_SUFFIXES))\n"
    "s = f.find_spec(sys.argv[2])\n"
    "print(type(s.loader).__name__, s.origin)\n"
)


def import_would_load(pkg: Path, module: str) -> tuple[str, str]:
    """The loader (its class name) and the file that import finds for `module` in `pkg`, as
    the path finder chooses them (by name, before it opens a file)."""
    out = subprocess.run(
        [sys.executable, "-c", FINDER, str(pkg), module], capture_output=True, text=True, check=True
    ).stdout.split(maxsplit=1)
    return out[0], out[1].strip()


@pytest.mark.wheel
def test_pycache_prefix_unchecked_hash_pyc_keeps_old_code(prefix_tree):
    """D1: with PYTHONPYCACHEPREFIX (set for k3patch too), apply exits 0 and status says applied
    while the interpreter runs the unchecked-hash pycs of the original code from the prefix."""
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


@pytest.mark.wheel
def test_plugin_passes_with_pycache_prefix_old_code(prefix_tree, tmp_path):
    """D1, the plugin: K3PATCH_PREFLIGHT=fail lets vLLM start on the old code of D1's tree.
    apply removes the prefix's pycs, so they are put back after it, as an image layer or a
    restored build cache would: the unchecked-hash pycs of the original code under the prefix."""
    pkg, env = prefix_tree
    site = pkg.parent
    prefix = Path(env["PYTHONPYCACHEPREFIX"])
    saved = tmp_path / "saved-prefix"
    shutil.copytree(prefix, saved)
    assert run_cli("apply", "--quiet", "--vllm", str(site), env=env).returncode == 0
    shutil.copytree(saved, prefix, dirs_exist_ok=True)  # the old pycs come back after apply
    stale = _stale(pkg, env)
    assert stale, "precondition: the prefix pycs are stale"
    proc = _preflight_fail(pkg, env)
    assert proc.returncode != 0, f"preflight passed while {stale} run old code"


@pytest.mark.wheel
def test_status_applied_with_stale_unchecked_pyc_in_tree(make_tree, tmp_path):
    """D3: an unchecked-hash pyc of the original code in the tree's own __pycache__ after the
    apply: status, a no-op apply and the plugin all say applied; import runs the old code."""
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
    plugin = _preflight_fail(pkg, {})  # before the apply below, which removes the pyc
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


@pytest.mark.wheel
@pytest.mark.parametrize("value", ["\uff15", "\u0665"])  # FULLWIDTH FIVE, ARABIC-INDIC FIVE
def test_fastpath_lock_timeout_unicode_digit_agrees_with_cli(make_tree, value):
    """D4: the no-op path accepts a --lock-timeout the CLI refuses (exit 0 vs exit 2)."""
    site = make_tree("0.31.0")
    assert run_cli("apply", "--quiet", "--vllm", str(site)).returncode == 0
    args = ("apply", "--quiet", "--vllm", str(site), "--lock-timeout", value)
    fast = run_cli(*args)
    slow = run_cli(*args, env={"K3PATCH_NO_FASTPATH": "1"})
    assert (fast.returncode, slow.returncode) == (slow.returncode, 2), (fast.stderr, slow.stderr)


@pytest.mark.slow
def test_help_on_lowest_typer_with_newest_click(tmp_path):
    """D2: `typer>=0.15.1` let pip install typer 0.15.1 with the newest click; then every
    `COMMAND --help` but list's was an internal error (exit 2). Now: the lowest typer
    pyproject.toml allows."""
    root = Path(__file__).resolve().parents[1]
    from test_environments import lower_bounds

    lowest = lower_bounds()["typer"]  # was 0.15.1
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(root)],
        check=True,
    )
    (wheel,) = dist.glob("k3patch-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", str(wheel), f"typer=={lowest}", "click>=8.2"],
        check=True,
    )
    bad = {}
    for command in ("status", "apply", "revert", "verify"):
        proc = subprocess.run(
            [str(venv / "bin" / "k3patch"), command, "--help"], capture_output=True, text=True
        )
        if proc.returncode != 0 or "--vllm" not in proc.stdout:
            bad[command] = (proc.returncode, proc.stderr.strip())
    assert not bad, bad


@pytest.mark.wheel
def test_sourceless_tree_is_not_not_applicable(make_tree):
    """D5: a pyc-only tree (compileall -b, .py removed) imports the unpatched bytecode; k3patch
    calls every patch "not applicable" and exits 0 on status and apply."""
    site = make_tree("0.31.0")
    pkg = site / "vllm"
    listed = run_cli("list", "--json")
    files = sorted({f for p in json.loads(listed.stdout)["patches"] for f in p["files"]})
    stripped = []
    for rel in files:
        path = pkg / rel
        if path.is_file():
            subprocess.run([sys.executable, "-m", "compileall", "-q", "-b", str(path)], check=True)
            path.unlink()
            stripped.append(rel)
    assert AITER in stripped and MORIIO in stripped
    loader, _ = import_would_load(pkg, "vllm._aiter_ops")
    assert loader == "SourcelessFileLoader", "precondition: import loads the unpatched .pyc"

    status = run_cli("status", "--quiet", "--vllm", str(site))
    apply = run_cli("apply", "--quiet", "--vllm", str(site))
    assert status.returncode != 0 and apply.returncode != 0, (
        f"status rc={status.returncode}: {status.stdout!r}; apply rc={apply.returncode}"
    )
    # The verdict: drifted, saying why, in status and apply alike; the plugin refuses too.
    for proc in (status, apply):
        assert proc.returncode == 1, proc.stderr
        assert "aiter-mla-gfx942: drifted" in proc.stdout, proc.stdout
        text = " ".join(proc.stdout.split())  # the report wraps long lines
        assert "_aiter_ops.py: present only as bytecode (_aiter_ops.pyc" in text, text
    assert _preflight_fail(pkg, {}).returncode != 0


@pytest.mark.wheel
@pytest.mark.parametrize("when", ["after apply", "before apply"])
def test_extension_module_beside_target_is_not_applied(make_tree, when):
    """D6: an extension module named like a target (a Cython/mypyc/Nuitka build that kept the
    .py) is what import loads, so the patched .py never runs; status must not say applied. An
    empty file is enough to show k3patch reads it: the path finder picks ExtensionFileLoader by
    the name's suffix before it opens the file (proven below with FileFinder), so the name alone
    decides which file import would run; what is inside only decides whether it then loads."""
    import importlib.machinery

    site = make_tree("0.31.0")
    pkg = site / "vllm"
    original = (pkg / AITER).read_bytes()
    ext = pkg / ("_aiter_ops" + importlib.machinery.EXTENSION_SUFFIXES[0])
    if when == "after apply":
        assert run_cli("apply", "--quiet", "--vllm", str(site)).returncode == 0
    patched = (pkg / AITER).read_bytes()
    ext.write_bytes(b"")
    _, origin = import_would_load(pkg, "vllm._aiter_ops")
    assert origin == str(ext), "precondition: import would load the extension, not the .py"

    status = run_cli("status", "--quiet", "--vllm", str(site))
    slow = run_cli("status", "--quiet", "--vllm", str(site), env={"K3PATCH_NO_FASTPATH": "1"})
    plugin = _preflight_fail(pkg, {})
    apply = run_cli("apply", "--quiet", "--vllm", str(site))
    for proc in (status, slow, apply):
        assert proc.returncode == 1, (proc.args, proc.stdout, proc.stderr)
        assert "aiter-mla-gfx942: drifted" in proc.stdout, proc.stdout
        assert f"compiled extension {ext.name}" in " ".join(proc.stdout.split()), proc.stdout
    assert plugin.returncode != 0, plugin.stderr
    if when == "after apply":  # before it there is no record, which the plugin says first
        assert ext.name in plugin.stderr, plugin.stderr
    # apply refuses that patch: the .py is as it was (never patched over the extension).
    assert (pkg / AITER).read_bytes() == (patched if when == "after apply" else original)
