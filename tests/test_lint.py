"""The house rules: everything under k3patch/ and patches/ passes ruff check, ruff format and
mypy."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def ruff() -> str:
    found = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(found).exists():
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    return found


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]])
def test_ruff(args):
    proc = subprocess.run(
        [ruff(), *args, "k3patch", "patches"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def mypy() -> str:
    # The dev venv's own mypy first: another one on PATH would check against other packages.
    found = str(Path(sys.executable).parent / "mypy")
    if not Path(found).exists():
        found = shutil.which("mypy") or found
    if not Path(found).exists():
        pytest.fail("mypy is not installed: pip install -e '.[test]'")
    return found


def test_mypy():
    # Settings come from [tool.mypy] in pyproject.toml; the paths are named so that a stale
    # `files` there cannot shrink what is checked.
    proc = subprocess.run([mypy(), "k3patch", "patches"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
