"""The house rules: everything under k3patch/ and patches/ passes ruff check and ruff format."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def ruff() -> str:
    found = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(found).exists():
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    return found


@pytest.mark.parametrize("args", [["check"], ["format", "--check"]])
def test_ruff(args):
    proc = subprocess.run([ruff(), *args, "k3patch", "patches"], cwd=ROOT, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
