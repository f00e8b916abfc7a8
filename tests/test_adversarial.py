"""Trust nothing on disk (issue 13): tampered records and journals, planted symlinks, upgrades
and reinstalls, races, odd files and closed pipes never cost data, never make k3patch write
outside the tree, and never give an exit code that lies. One test (at least) per numbered
defect of the issue; each was seen to fail with its protection removed."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import crash_campaign
import pytest
from conftest import pristine_tree, run_cli, slow_after, tree_hashes

from k3patch import engine, replace
from k3patch.state import (
    STATE_FILE,
    registered_targets,
)
from k3patch.tree import locate

pytestmark = pytest.mark.wheel
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown")
AITER = "_aiter_ops.py"
ROCM = "platforms/rocm.py"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sources(site: Path) -> dict[str, str]:
    return {k: v for k, v in tree_hashes(site).items() if "/.k3patch/" not in k}


def record(site: Path) -> dict:
    return json.loads((site / "vllm/.k3patch" / STATE_FILE).read_text())


def write_record(site: Path, data: dict) -> None:
    (site / "vllm/.k3patch" / STATE_FILE).write_text(json.dumps(data))


def upgrade(site: Path, version: str) -> None:
    crash_campaign.upgrade(site, pristine_tree(version), sorted(registered_targets()))


# -- 1: upgrade / reinstall, then revert ---------------------------------------------------


# -- 2: paths in the record and the journal are confined ------------------------------------


# -- 12: the fast path and the plugin check the registry's targets ---------------------------


# -- 5: absent, damaged, of another schema -------------------------------------------------


# -- 3, 4, 6: no symlink followed where k3patch writes or deletes ---------------------------


def stat_mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o7777


# -- 16: verify never passes vacuously -------------------------------------------------------


def test_16_verify_with_an_interpreter_lacking_torch_is_exit_3(make_tree):
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    proc = run_cli("verify", "--vllm", str(site))  # k3patch's own interpreter: no torch
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "nothing was verified" in proc.stderr and sys.executable in proc.stderr
    assert "verified" not in proc.stdout


# -- 15: exit codes that do not lie ----------------------------------------------------------


def shell(command: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True)


@pytest.mark.parametrize("path", slow_after(["fast", "full"]))
def test_15_closed_pipe_and_full_stdout_after_a_commit_keep_its_code(make_tree, path):
    k3 = f"{sys.executable} -m k3patch"
    if path == "full":
        k3 = f"K3PATCH_NO_FASTPATH=1 {k3}"
    site, other = make_tree("0.31.0"), make_tree("0.31.0")
    piped = shell(f"{k3} apply --vllm {site} | head -c 1 >/dev/null; exit ${{PIPESTATUS[0]}}")
    assert piped.returncode == 0, piped.stderr
    assert "Traceback" not in piped.stderr and "internal error" not in piped.stderr
    full = shell(f"{k3} apply --vllm {other} > /dev/full")
    assert full.returncode == 0, full.stderr
    assert "nothing was written" not in full.stderr and "could not write" in full.stderr
    for tree in (site, other):
        assert run_cli("status", "--vllm", str(tree)).returncode == 0
    status = shell(f"{k3} status --vllm {site} | head -c 1 >/dev/null; exit ${{PIPESTATUS[0]}}")
    assert status.returncode == 0, status.stderr


def test_15_non_executable_python_is_exit_3(make_tree, tmp_path):
    site = make_tree("0.31.0")
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n")
    proc = run_cli("verify", "--vllm", str(site), "--python", str(fake))
    assert proc.returncode == 3, (proc.stdout, proc.stderr)


# -- 10, 11: the plugin never raises or hangs; FIFOs; deep expressions ---------------------


class FakeVllm:
    def __init__(self, site: Path) -> None:
        self.__file__ = str(site / "vllm" / "__init__.py")


# -- 9: a revert killed after its journal ----------------------------------------------------


# -- 7: concurrent apply and revert ------------------------------------------------------------


# -- 8: another writer during the commit ------------------------------------------------------


def after_the_temp_file(monkeypatch, act) -> None:
    """`act` runs once k3patch has written its temp file for _aiter_ops.py: after the content
    check, before the last look and the rename."""
    real = replace.write_temp

    def racing(dfd: int, name: str, data: bytes, like_fd: int | None, *notes: list[str]) -> str:
        tmp = real(dfd, name, data, like_fd, *notes)
        if name == AITER:
            act()
        return tmp

    monkeypatch.setattr(replace, "write_temp", racing)


# -- 13: one finite lock timeout; a live apply is not an interrupted one --------------------


# -- 14: owner, setuid/setgid, xattrs, hard links -------------------------------------------


# -- What to build: the pycache directory, and a thread racing the lock ----------------------


# -- issue 21: the plugin names a damaged record, and never blocks on a FIFO ------------------
