"""A fifth patch is one folder (and its tests): a copy of this project gets
`patches/aiter_mla_gfx942_copy/`, the template under a new id that reads its own file
(`vllm/_aiter_ops_copy.py`, which the test tree gets as a copy of `_aiter_ops.py`), plus its
mutation rows and its test file, and nothing else. The wheel built from that copy, installed in
a fresh venv, lists it, classifies it, applies, verifies and reverts it; the mutation harness
finds its rows; README's patches table is the one other place, and a test says so.

The dependencies are installed from a wheelhouse cached in ~/.cache/k3patch/wheelhouse (filled
from PyPI by `pip download` when it lacks one); everything else is built in the run.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CACHE, export_source, tree_hashes

pytestmark = [pytest.mark.slow, pytest.mark.wheel, pytest.mark.verify]

WHEELHOUSE = CACHE.parent / "wheelhouse"
NEW_ID, FOLDER, NEW_FILE = "aiter-mla-gfx942-copy", "aiter_mla_gfx942_copy", "_aiter_ops_copy.py"
TEMPLATE = "aiter_mla_gfx942"
# The template's names that would collide, and the copy's: each must occur exactly once.
RENAMES = {
    "__init__.py": [
        ('FILE = "_aiter_ops.py"', f'FILE = "{NEW_FILE}"'),
        ('id = "aiter-mla-gfx942"', f'id = "{NEW_ID}"'),
        ('modules = ("vllm._aiter_ops",)', 'modules = ("vllm._aiter_ops_copy",)'),
    ],
    "probe.py": [
        ("from vllm._aiter_ops import", "from vllm._aiter_ops_copy import"),
    ],
    "files.txt": [("\n_aiter_ops.py\n", f"\n{NEW_FILE}\n")],
}
ROWS = f'''"""{NEW_ID}'s wrong fixes (tests/test_fifth_patch.py writes this file)."""

from .common import Sub, Variant

DECL = "{FOLDER}/__init__.py"
VARIANTS = (
    Variant(
        "copy-gfx942-inverted",
        "{NEW_ID}",
        "`return not on_gfx942()` -> `return on_gfx942()`",
        (Sub(DECL, "    return not on_gfx942()", "    return on_gfx942()"),),
        ("0.31.0",),
    ),
    Variant(
        "copy-flags-or",
        "{NEW_ID}",
        "`_AITER_ENABLED and _MLA_ENABLED` -> `or`",
        (Sub(DECL, "(cls._AITER_ENABLED and cls", "(cls._AITER_ENABLED or cls"),),
        ("0.31.0",),
    ),
)
'''
TESTS = f'''from k3patch.registry import select


def test_it_is_registered():
    (patch,) = select(only=["{NEW_ID}"])
    assert patch.files == ("{NEW_FILE}", "platforms/rocm.py")
'''
README_ROW = (
    f"| `{NEW_ID}` | the template, under a new id | pending wherever aiter-mla-gfx942 is |\n"
)


def add_fifth_patch(project: Path) -> None:
    """The folder, its mutation rows, its test file: all a new patch brings."""
    folder = project / "patches" / FOLDER
    shutil.copytree(project / "patches" / TEMPLATE, folder)
    for name, renames in RENAMES.items():
        text = (folder / name).read_text(encoding="utf-8")
        for old, new in renames:
            assert text.count(old) == 1, f"the template's {name} changed: {old!r}"
            text = text.replace(old, new)
        (folder / name).write_text(text, encoding="utf-8")
    (project / "tests" / "mutation_rows" / f"{FOLDER}.py").write_text(ROWS)
    (project / "tests" / f"test_{FOLDER}.py").write_text(TESTS)


def wheel_of(project: Path, out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(project)],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("k3patch-*.whl")
    return wheel


def fresh_venv(where: Path, wheel: Path) -> Path:
    """A new venv holding the wheel and its dependencies (from the cached wheelhouse)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python"]
    install = [*pip, str(where / "bin" / "python"), "install", "-q"]
    offline = [*install, "--no-index", "--find-links", str(WHEELHOUSE), str(wheel)]
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    with open(WHEELHOUSE.parent / "wheelhouse.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if subprocess.run(offline, capture_output=True).returncode != 0:
            download = [sys.executable, "-m", "pip", "download", "-q", "-d", str(WHEELHOUSE)]
            subprocess.run([*download, str(wheel)], check=True, capture_output=True)
            for stale in WHEELHOUSE.glob("k3patch-*"):
                stale.unlink()
            proc = subprocess.run(offline, capture_output=True, text=True)
            assert proc.returncode == 0, proc.stderr[-2000:]
    return where


def k3patch(venv: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env["NO_COLOR"] = "1"
    return subprocess.run(
        [str(venv / "bin" / "k3patch"), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=venv.parent,
    )


def verdicts(venv: Path, site: Path) -> dict[str, str]:
    proc = k3patch(venv, "status", "--json", "--vllm", str(site))
    return {p["id"]: p["verdict"] for p in json.loads(proc.stdout)["patches"]}


def test_a_fifth_patch_folder_works_end_to_end(tmp_path, make_tree, verify_python):
    project = export_source(tmp_path / "project")
    add_fifth_patch(project)

    venv = fresh_venv(tmp_path / "venv", wheel_of(project, tmp_path / "dist"))
    (site_packages,) = (venv / "lib").glob("python*/site-packages")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # The copy's tests with pytest from here and the installed copy of k3patch: PYTHONPATH
    # comes before this venv's editable finder of the checkout.
    env["PYTHONPATH"] = f"{site_packages}:{project / 'tests'}"

    listed = k3patch(venv, "list")
    assert listed.returncode == 0 and NEW_ID in listed.stdout, listed.stdout + listed.stderr
    assert f"files (under vllm/): {NEW_FILE}, platforms/rocm.py" in listed.stdout

    site = make_tree("0.31.0", full=True)
    shutil.copy2(site / "vllm" / "_aiter_ops.py", site / "vllm" / NEW_FILE)
    pristine = tree_hashes(site)
    assert verdicts(venv, site)[NEW_ID] == "pending"

    applied = k3patch(venv, "apply", "--vllm", str(site))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert verdicts(venv, site)[NEW_ID] == "applied"
    changed = (site / "vllm" / NEW_FILE).read_text(encoding="utf-8")
    assert "return not on_gfx942()" in changed
    # The no-op path hashes the new file too: a byte changed there is not served from the record.
    assert k3patch(venv, "apply", "--quiet", "--vllm", str(site)).returncode == 0
    (site / "vllm" / NEW_FILE).write_text(changed.replace("return not on", "return on"))
    proc = k3patch(venv, "status", "--quiet", "--vllm", str(site))
    assert proc.returncode == 1 and f"{NEW_ID}: drifted" in proc.stdout, proc.stdout
    (site / "vllm" / NEW_FILE).write_text(changed)

    verify = k3patch(
        venv, "verify", "--json", "--vllm", str(site), "--python", verify_python, "--only", NEW_ID
    )
    report = json.loads(verify.stdout)["verify"]
    (mine,) = report["patches"]
    assert verify.returncode == 0 and mine["id"] == NEW_ID, verify.stdout[-2000:]
    assert mine["probe"]["ran"] and mine["probe"]["ok"], mine["probe"]
    assert [m["module"] for m in mine["modules"]] == ["vllm._aiter_ops_copy"]

    back = k3patch(venv, "revert", "--vllm", str(site))
    assert back.returncode == 0, back.stdout + back.stderr
    assert tree_hashes(site) == pristine, "revert is not byte-identical"

    # The mutation harness finds its rows, its test file and the probes it runs with.
    harness = (
        "import json, sys, mutants\n"
        "from pathlib import Path\n"
        f"rows = mutants.TABLES['{NEW_ID}']\n"
        "print(json.dumps([[v.id for v in rows], mutants.TESTS.get('{NEW_ID}'),\n"
        "    mutants.VERIFY_WITH.get('{NEW_ID}'),\n"
        "    mutants.table_errors(Path('../patches'), rows)]))\n"
    ).replace("{NEW_ID}", NEW_ID)
    proc = subprocess.run(
        [str(venv / "bin" / "python"), "-c", harness],
        cwd=project / "benchmarks",
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": ""},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    ids, tests, probes, errors = json.loads(proc.stdout)
    assert ids == ["copy-gfx942-inverted", "copy-flags-or"]
    assert tests == [f"tests/test_{FOLDER}.py"] and (project / tests[0]).is_file()
    # It reads platforms/rocm.py, as the template does: their probes run together.
    assert sorted(probes) == ["aiter-mla-gfx942", NEW_ID] and errors == {}

    # README's patches table is checked against the patches found: the test names the row.
    check = [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", ""]
    check += ["tests/test_patch_folders.py", f"tests/test_{FOLDER}.py"]
    proc = subprocess.run(check, cwd=project, capture_output=True, text=True, env=env)
    assert proc.returncode == 1 and "1 failed" in proc.stdout, proc.stdout[-3000:]
    assert f"add a row for ['{NEW_ID}']" in proc.stdout
    readme = project / "README.md"
    lines = readme.read_text(encoding="utf-8").splitlines(keepends=True)
    at = lines.index("## The patches\n")
    while not lines[at].startswith("| `"):
        at += 1
    while lines[at].startswith("| `"):
        at += 1
    readme.write_text("".join([*lines[:at], README_ROW, *lines[at:]]), encoding="utf-8")

    # With its README row, the copy's own checks pass.
    proc = subprocess.run(check, cwd=project, capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
