"""Trees applied by an earlier k3patch (the operators' images) read applied with this one, and
revert restores them byte for byte. The earlier k3patch is main before issue 20 (0f1bcdf: the
record schema 1 this k3patch still reads, the lock on `.k3patch/`, the text-splicing rewrites),
taken from the checkout's git history and run from a temporary directory on a real 0.31.0 tree."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from conftest import run_cli, tree_hashes

pytestmark = pytest.mark.wheel
OLD = "0f1bcdf1689054323ada8304112ffa8c6ca87d4c"
ROOT = Path(__file__).resolve().parent.parent
GOOD = {"applied", "satisfied", "not applicable"}


@pytest.fixture(scope="module")
def old_k3patch(tmp_path_factory) -> Path:
    """The earlier k3patch laid out as installed (its patches inside it as k3patch.patches)."""
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", OLD, "k3patch", "patches"],
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip(f"needs the checkout's git history (commit {OLD[:7]})")
    lib = tmp_path_factory.mktemp("k3patch-old")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(lib, filter="data")
    shutil.move(lib / "patches", lib / "k3patch" / "patches")
    return lib


def run_old(lib: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "NO_COLOR": "1", "PYTHONPATH": str(lib)}
    code = (
        "import sys, k3patch.formats as f\n"
        "assert f.__file__.startswith(sys.argv[1]), f.__file__  # the old code, not the checkout\n"
        "sys.argv = ['k3patch', *sys.argv[2:]]\n"
        "from k3patch.__main__ import main\n"
        "main()"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(lib), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=lib,
    )


def sources(hashes: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in hashes.items() if "/.k3patch/" not in k}


def applied_by_the_old_k3patch(make_tree, lib: Path) -> tuple[Path, dict[str, str]]:
    site = make_tree("0.31.0")
    original = tree_hashes(site)
    old = run_old(lib, "apply", "--quiet", "--vllm", str(site))
    assert old.returncode == 0, old.stdout + old.stderr
    assert "k3patch: moriio-chunk-gate: applied" in old.stdout
    assert sources(tree_hashes(site)) != sources(original)
    record = json.loads((site / "vllm/.k3patch/state.json").read_text())
    assert record["schema_version"] == 1 and record["files"]
    return site, original


def test_an_old_apply_reads_applied_and_reverts_byte_for_byte(make_tree, old_k3patch):
    site, original = applied_by_the_old_k3patch(make_tree, old_k3patch)
    applied = tree_hashes(site)
    proc = run_cli("status", "--json", "--vllm", str(site))
    status = json.loads(proc.stdout)
    assert proc.returncode == 0 and status["exit_code"] == 0, proc.stdout
    assert {p["verdict"] for p in status["patches"]} <= GOOD
    assert "applied" in {p["verdict"] for p in status["patches"]}
    assert tree_hashes(site) == applied, "status wrote something"
    back = run_cli("revert", "--vllm", str(site))
    assert back.returncode == 0, back.stdout + back.stderr
    assert tree_hashes(site) == original  # every file and no .k3patch left


def test_an_old_apply_then_a_new_apply_still_reverts_byte_for_byte(make_tree, old_k3patch):
    """The new k3patch's apply on an old image has nothing to write: it records its own
    classification, keeping the old record's originals, and revert still puts them back."""
    site, original = applied_by_the_old_k3patch(make_tree, old_k3patch)
    applied = sources(tree_hashes(site))
    again = run_cli("apply", "--quiet", "--vllm", str(site))
    assert again.returncode == 0, again.stdout + again.stderr
    assert sources(tree_hashes(site)) == applied
    fast = run_cli("status", "--json", "--vllm", str(site))
    assert json.loads(fast.stdout)["from_record"] is True  # the record is this k3patch's now
    back = run_cli("revert", "--vllm", str(site))
    assert back.returncode == 0, back.stdout + back.stderr
    assert tree_hashes(site) == original
