"""A fixed sample of the fault-injection campaign (benchmarks/faults.py; the whole campaign and
its table are in benchmarks/RELIABILITY.md), and proof that the harness can fail: run against a
copy of k3patch whose file replacement is not atomic, it must report half-patched trees.

The campaign forks children that interpose on `os`, `open`, `fcntl` and ctypes, so it runs as
its own process, never inside the pytest worker."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ROOT / "benchmarks" / "faults.py"

pytestmark = [pytest.mark.wheel, pytest.mark.slow]


def campaign(
    tmp_path: Path, *args: str, k3patch: Path | None = None, env: dict[str, str] | None = None
) -> dict:
    out = tmp_path / "faults.json"
    cmd = [sys.executable, str(FAULTS), "--work", str(tmp_path / "work"), "--json", str(out)]
    cmd += [*args, *(["--k3patch", str(k3patch)] if k3patch else [])]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=1200,
        env={**os.environ, **(env or {})},
    )
    assert out.exists(), proc.stderr[-3000:]
    data = json.loads(out.read_text())
    data["log"] = proc.stderr
    return data


def failures(data: dict) -> dict[str, int]:
    total: dict[str, int] = {}
    for row in data["rows"]:
        for kind, count in row["failures"].items():
            total[kind] = total.get(kind, 0) + count
    return total


def runs(data: dict) -> int:
    return sum(sum(row["runs"].values()) for row in data["rows"])


# Every 97th call of each command under each fault (97 is prime to the 5-7 calls that open,
# read and close one file, so the sample walks across call kinds), and a kill before every
# replacement and removal: the moments a half-patched tree would come from.
SAMPLE = ["--every", "97", "--offset", "7"]


@pytest.mark.parametrize("command", ["apply", "revert", "recover-apply"])
def test_sample_of_every_fault_leaves_a_whole_tree(tmp_path, command):
    data = campaign(tmp_path, "--trees", "0.31.0", "--commands", command, *SAMPLE)
    row = data["rows"][0]
    assert row["calls"] > 100, "the recording saw the calls on the tree"
    assert all(row["runs"].get(kind, 0) > 0 for kind in ("ENOSPC", "EIO", "EACCES/EPERM", "kill"))
    assert row["mismatched"] == 0, "the failing call is the recorded one in every run"
    assert failures(data) == {}, data["log"][-4000:]


def test_kill_before_every_rename_and_unlink_of_a_fork_tree_apply(tmp_path):
    data = campaign(
        tmp_path,
        "--trees",
        "fork-a",
        "--commands",
        "apply",
        "--kinds",
        "kill",
        "--funcs",
        "os.replace",
        "os.rename",
        "libc.renameat2",
        "os.unlink",
    )
    assert runs(data) >= 8
    assert failures(data) == {}, data["log"][-4000:]


PLANTED = """

# Planted by tests/test_faults.py: a replacement that is not atomic (the old file is removed,
# then the new one renamed in; no exchange), which only a fault between the two can show.
import os as _real_os


class _NotAtomic:
    def __getattr__(self, name):
        return getattr(_real_os, name)

    def replace(self, src, dst, *, src_dir_fd=None, dst_dir_fd=None):
        try:
            _real_os.unlink(dst, dir_fd=dst_dir_fd)
        except FileNotFoundError:
            pass
        _real_os.rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)


os = _NotAtomic()


def exchange(dfd, a, b):
    return False
"""


def test_the_harness_reports_a_planted_non_atomic_write(tmp_path):
    """Without this the campaign could pass by checking nothing."""
    planted = tmp_path / "planted"
    shutil.copytree(ROOT / "k3patch", planted / "k3patch")
    shutil.copytree(ROOT / "patches", planted / "patches")
    replace = planted / "k3patch" / "replace.py"
    source = replace.read_text()
    assert "os.replace(" in source and "def exchange(" in source, "update the planted defect"
    replace.write_text(source + PLANTED)
    args = ["--trees", "0.31.0", "--commands", "apply", "--kinds", "kill"]
    data = campaign(tmp_path, *args, "--funcs", "os.rename", k3patch=planted)
    found = failures(data)
    assert found.get("half-patched", 0) > 0, data["log"][-4000:]
    assert found.get("unrecoverable journal", 0) > 0, data["log"][-4000:]


# The campaign memoizes the planning (classify, the libcst rewrite, its check) in the fork
# server, replaying the reads each computation made; it must change no call a run makes.
def test_the_memo_changes_no_call_a_run_makes(tmp_path):
    """Each row's recording with the memo warm and without it, and a sample of faulted runs
    (every 151st call, EIO and a disk that stays full) with and without it: the same calls
    (function, path, k3patch call site and callers), exit code, output and tree."""
    args = ["--trees", "0.31.0", "--commands", "apply", "recover-apply"]
    args += ["--kinds", "EIO", "disk full", "--every", "151", "--offset", "40", "--check-memo"]
    data = campaign(tmp_path, *args)
    assert data["memo"]["differences"] == [], data["memo"]["differences"]
    assert all(row["memo_checked"] for row in data["rows"])
    assert runs(data) >= 8
    hits = data["memo"]["hits"]
    assert hits.get("rewrite", 0) > 0 and hits.get("classify", 0) > 0, data["memo"]
    assert failures(data) == {}, data["log"][-4000:]


def test_the_memo_check_reports_a_memo_that_skips_calls(tmp_path):
    """Without this the comparison above could pass by comparing nothing: a planted memo of
    the files' hashes by name (a hit reads nothing) is reported."""
    args = ["--trees", "0.31.0", "--commands", "apply", "--kinds", "EIO", "--call", "1"]
    data = campaign(tmp_path, *args, "--check-memo", env={"K3FAULTS_PLANTED_MEMO": "1"})
    differences = data["memo"]["differences"]
    assert any("calls differ" in line for line in differences), differences
    assert not data["rows"][0]["memo_checked"]


def _module(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("first", ["faults", "reliability"])
def test_the_two_writers_of_reliability_md_keep_each_others_blocks(tmp_path, monkeypatch, first):
    """benchmarks/faults.py and benchmarks/reliability.py each replace only their own marked
    block of RELIABILITY.md: the other's block, the title and the history stay, and
    reliability.py reads its earlier rows from its own block only (the fault tables' rows look
    like its rows)."""
    faults, reliability = _module("faults"), _module("reliability")
    page = tmp_path / "RELIABILITY.md"
    monkeypatch.setattr(faults, "RESULTS", page)
    monkeypatch.setattr(reliability, "RESULTS", page)
    page.write_text(
        "# Title\n\n"
        f"{faults.BEGIN}\nold fault table\n| leftovers | apply 0.31.0 | EIO at os.close | 1 |\n"
        f"{faults.FINISH}\n\n## History\n\n| an old case | 7 | 0 |\n\n"
        f"{reliability.BEGIN}\n| case | runs | seen | failures |\n|---|---:|---|---:|\n"
        f"| kept case | 5 | 5 seen | 0 |\n{reliability.FINISH}\n\nThe end.\n"
    )
    writes = {
        "faults": lambda: faults.write_report("NEW FAULT TABLE"),
        "reliability": lambda: reliability.write_block(
            reliability.merge([("new case", 3, "3 seen", 0)], "Last run today.", "cmd")
        ),
    }
    for name in (first, *(n for n in writes if n != first)):
        writes[name]()
    text = page.read_text()
    assert text.startswith("# Title\n")
    assert "NEW FAULT TABLE" in text and "old fault table" not in text
    assert "## History\n\n| an old case | 7 | 0 |" in text and text.endswith("The end.\n")
    block = reliability.own_block(text)
    assert "| kept case | 5 | 5 seen | 0 |" in block and "| new case | 3 | 3 seen | 0 |" in block
    assert "leftovers" not in block and "an old case" not in block
    assert text.count(faults.BEGIN) == text.count(reliability.BEGIN) == 1
