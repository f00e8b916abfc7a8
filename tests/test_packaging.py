"""The wheel carries every patch: each folder under patches/ is a package pyproject.toml lists
(as `k3patch.patches.<folder>`), and the built wheel holds every .py file of k3patch/ and
patches/."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent


def listed() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(config["tool"]["setuptools"]["packages"])


def test_every_patch_folder_is_a_listed_package():
    folders = {
        f"k3patch.patches.{p.name}"
        for p in (ROOT / "patches").iterdir()
        if p.is_dir() and (p / "__init__.py").exists()
    }
    assert folders, "no patch folder found"
    assert folders <= listed(), f"add to pyproject.toml packages: {sorted(folders - listed())}"
    assert {"k3patch", "k3patch.patches"} <= listed()


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
        for p in (ROOT / "patches").rglob("*.py")
    }
    wanted = {w for w in wanted if "__pycache__" not in w}
    assert wanted <= names, sorted(wanted - names)
