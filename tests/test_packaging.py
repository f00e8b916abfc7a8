"""The wheel carries every patch, with no list to keep: setuptools' find, through the symlink
`k3patch/patches -> ../patches`, finds each folder under patches/ at build time (as
`k3patch.patches.<folder>`), and the built wheel holds every .py
file of k3patch/ and patches/ and each patch's files.txt. A fifth folder, end to end:
tests/test_fifth_patch.py."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import setuptools
import tomllib

ROOT = Path(__file__).resolve().parent.parent


def folders() -> set[str]:
    return {
        f"k3patch.patches.{p.name}"
        for p in (ROOT / "patches").iterdir()
        if p.is_dir() and (p / "__init__.py").exists()
    }


def test_the_build_finds_every_patch_folder():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert list(config["packages"]) == ["find"] and "package-dir" not in config, "a list to keep"
    link = ROOT / "k3patch" / "patches"
    assert link.is_symlink() and link.resolve() == (ROOT / "patches").resolve()
    found = setuptools.find_packages(str(ROOT), **config["packages"]["find"])
    assert folders() and {"k3patch", "k3patch.patches", *folders()} == set(found)


@pytest.mark.slow
def test_the_wheel_holds_every_module(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", str(ROOT), "-w", tmp_path],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("k3patch-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {
        f"k3patch/{p.relative_to(ROOT / 'k3patch')}" for p in (ROOT / "k3patch").rglob("*.py")
    }
    wanted |= {
        f"k3patch/patches/{p.relative_to(ROOT / 'patches')}"
        for pattern in ("*.py", "files.txt")
        for p in (ROOT / "patches").rglob(pattern)
    }
    wanted = {w for w in wanted if "__pycache__" not in w}
    assert any(w.endswith("/files.txt") for w in wanted)
    assert wanted <= names, sorted(wanted - names)
