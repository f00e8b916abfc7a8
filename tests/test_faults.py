"""A fixed sample of the fault-injection campaign (benchmarks/faults.py; the whole campaign and
its table are in benchmarks/RELIABILITY.md), and proof that the harness can fail: run against a
copy of k3patch whose file replacement is not atomic, it must report half-patched trees.

The campaign forks children that interpose on `os`, `open`, `fcntl` and ctypes, so it runs as
its own process, never inside the pytest worker. What it found is held here in the small: one
filesystem call made to fail the way the campaign failed it, in this process, and the promise
that broke (no k3patch temp file outlives a failed run; a file and a tree stay whole; a failure
is never read as "absent" or "done")."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

from k3patch import engine, replace
from k3patch.errors import EnvironmentProblem
from k3patch.tree import locate

ROOT = Path(__file__).resolve().parent.parent
FAULTS = ROOT / "benchmarks" / "faults.py"

# The campaign's runs take minutes: each is marked slow (and wheel) on its own, since the
# defects it found, held in the small at the end of this file, run in a plain pytest.


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


@pytest.mark.wheel
@pytest.mark.slow
@pytest.mark.parametrize("command", ["apply", "revert", "recover-apply"])
def test_sample_of_every_fault_leaves_a_whole_tree(tmp_path, command):
    data = campaign(tmp_path, "--trees", "0.31.0", "--commands", command, *SAMPLE)
    row = data["rows"][0]
    assert row["calls"] > 100, "the recording saw the calls on the tree"
    assert all(row["runs"].get(kind, 0) > 0 for kind in ("ENOSPC", "EIO", "EACCES/EPERM", "kill"))
    assert row["mismatched"] == 0, "the failing call is the recorded one in every run"
    assert failures(data) == {}, data["log"][-4000:]


@pytest.mark.wheel
@pytest.mark.slow
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


@pytest.mark.wheel
@pytest.mark.slow
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
@pytest.mark.wheel
@pytest.mark.slow
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


@pytest.mark.wheel
@pytest.mark.slow
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


@pytest.mark.wheel
@pytest.mark.slow
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


# -- What the campaign found, each held in the small ---------------------------------------------
# One filesystem call of this process's own k3patch made to fail the way the campaign failed it
# (EIO, or ENOSPC for a full disk); every other call is real.

OLD, NEW = b"old = 1\n", b"new = 2\n"


def failing(monkeypatch, name: str, when) -> None:
    """os.NAME raises EIO on the call `when(args, kwargs)` picks; every other call is real."""
    real = getattr(os, name)

    def fake(*args, **kwargs):
        if when(args, kwargs):
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(args[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(os, name, fake)


def temps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if replace.LITTER.match(p.name))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "a.py").write_bytes(OLD)
    return tmp_path


def test_a_failed_last_look_removes_the_temp_file(root, monkeypatch):
    """`replace_checked`'s last look at the target, after its temp file is written, failing:
    the temp file is removed and the target left as it was."""
    failing(monkeypatch, "stat", lambda a, k: a[0] == "a.py" and "dir_fd" in k)
    with pytest.raises(EnvironmentProblem):
        replace.replace_checked(root, "a.py", OLD, NEW)
    assert temps(root) == []
    assert (root / "a.py").read_bytes() == OLD


@pytest.mark.parametrize("kept", [None, []], ids=["removed", "kept"])
def test_a_failed_look_at_the_swapped_out_file_leaves_no_temp_file(root, monkeypatch, kept):
    """After an exchange, the look at what was swapped out failing: swapped back, the old file
    never left under a temp name."""
    if replace._renameat2() is None:
        pytest.skip("no renameat2 here: the exchange branch is not taken")
    failing(monkeypatch, "stat", lambda a, k: str(a[0]).startswith(".a.py.k3patch-tmp."))
    with pytest.raises(EnvironmentProblem):
        replace.replace_checked(root, "a.py", OLD, NEW, kept=kept)
    assert temps(root) == []
    assert (root / "a.py").read_bytes() == OLD, "swapped back: the file as it stood"
    assert not kept


def test_a_failed_rename_to_the_kept_name_leaves_no_temp_file(root, monkeypatch):
    """After an exchange, the rename of the swapped-out file to its kept name failing: no temp
    file left, nothing kept (a rollback writes the saved copy)."""
    if replace._renameat2() is None:
        pytest.skip("no renameat2 here: the exchange branch is not taken")
    failing(monkeypatch, "rename", lambda a, k: str(a[0]).startswith(".a.py.k3patch-tmp."))
    kept: list[str] = []
    with pytest.raises(EnvironmentProblem):
        replace.replace_checked(root, "a.py", OLD, NEW, kept=kept)
    assert temps(root) == []
    assert kept == [], "nothing kept: a rollback writes the saved copy"


@pytest.mark.wheel
def test_revert_that_cannot_look_for_the_record_is_an_environment_error(make_tree, monkeypatch):
    """An EIO or EACCES on revert's look for `.k3patch` is an environment problem (exit 3),
    never read as "absent" (exit 0, "nothing recorded") on an applied tree."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    tree = locate(site)
    state = str(tree.state_dir)
    failing(monkeypatch, "lstat", lambda a, k: str(a[0]) == state)
    with pytest.raises(EnvironmentProblem, match=r"cannot look at .*\.k3patch: Input/output"):
        engine.revert(tree)
    monkeypatch.undo()
    assert (site / "vllm/.k3patch/state.json").is_file(), "nothing removed"


@pytest.mark.wheel
def test_a_recovery_that_cannot_remove_the_litter_keeps_its_journal(make_tree, monkeypatch):
    """A recovery that cannot remove a killed run's temp file beside a target (EIO, ENOSPC on
    NFS, EACCES) keeps its journal, so the next run looks again: removed best effort, the
    journal and then `.k3patch` gone, no later run would look for it, and it stays for good."""
    site = make_tree("0.31.0")
    original = (site / "vllm/_aiter_ops.py").read_bytes()
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    env = {"K3PATCH_TEST_CRASH_AT": "blobs-written"}
    assert run_cli("revert", "--vllm", str(site), env=env).returncode == 137
    litter = "._aiter_ops.py.k3patch-tmp.0123456789abcdef"  # as a killed write leaves it
    (site / "vllm" / litter).write_bytes(b"a killed run's copy\n")
    failing(monkeypatch, "unlink", lambda a, k: a[0] == litter)
    try:
        engine.revert(locate(site))
    except EnvironmentProblem:
        assert (site / "vllm/.k3patch/journal.json").exists(), "the next run must look again"
    monkeypatch.undo()
    engine.revert(locate(site))  # the fault lifted
    assert temps(site / "vllm") == []
    assert (site / "vllm/_aiter_ops.py").read_bytes() == original
    assert not (site / "vllm/.k3patch").exists()


def _hashes(site: Path) -> dict[str, bytes]:
    return {
        p.relative_to(site).as_posix(): p.read_bytes()
        for p in sorted((site / "vllm").rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def _fail_after(monkeypatch, trigger, persistent: bool) -> None:
    """os.fsync fails (ENOSPC) right after an os.unlink that `trigger` picks; `persistent`:
    every later fsync and file creation too (a disk that filled up there and stays full)."""
    real_unlink, real_fsync, real_open = os.unlink, os.fsync, os.open
    armed = {"on": False, "spent": False}

    def unlink(path, *a, **k):
        real_unlink(path, *a, **k)
        if trigger(str(path)) and not armed["spent"]:
            armed["on"] = True

    def fsync(fd):
        if armed["on"]:
            armed["on"] = persistent
            armed["spent"] = True
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    def open_(path, flags, *a, **k):
        if persistent and armed["spent"] and flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "unlink", unlink)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "open", open_)


def _lift_and_check(site: Path, original: dict[str, bytes], monkeypatch) -> None:
    monkeypatch.undo()
    engine.apply(locate(site))  # the fault lifted
    assert _hashes(site) != original
    engine.revert(locate(site))
    assert _hashes(site) == original, "the originals were saved: revert puts them back"


@pytest.mark.wheel
def test_a_failed_sync_after_the_commit_keeps_the_saved_originals(make_tree, monkeypatch):
    """A sync that fails after the journal was removed (the commit done) is not a failed
    commit: the record and every saved original of the fully patched tree stay, so revert can
    put the originals back."""
    site = make_tree("0.31.0")
    original = _hashes(site)
    _fail_after(monkeypatch, lambda p: p.endswith("journal.json"), persistent=False)
    with pytest.raises(EnvironmentProblem):
        engine.apply(locate(site))
    assert (site / "vllm/.k3patch/state.json").is_file()
    _lift_and_check(site, original, monkeypatch)


@pytest.mark.wheel
def test_a_full_disk_at_the_removal_of_a_kept_copy_leaves_a_whole_tree(make_tree, monkeypatch):
    """A disk that fills up at the sync after a kept old file's removal (the last step before
    the journal goes) and stays full: the tree ends whole (every patch applied, or none), never
    one patch applied and one rolled back because a file needed space to be written back."""
    site = make_tree("0.31.0")
    original = _hashes(site)
    _fail_after(monkeypatch, lambda p: ".k3patch-tmp." in p, persistent=True)
    try:
        engine.apply(locate(site))
    except EnvironmentProblem:
        pass
    monkeypatch.undo()
    now = _hashes(site)
    changed = [rel for rel in original if now[rel] != original[rel]]
    assert len(changed) in (0, 2), f"one patch applied, one not: {changed}"
    _lift_and_check(site, original, monkeypatch)


@pytest.mark.wheel
def test_a_revert_that_cannot_remove_k3patch_says_so(make_tree, monkeypatch):
    """A revert whose last removals fail (opening a directory, the rmdir of `blobs/` or
    `.k3patch`, the sync after) says so (exit 3; the next revert removes it), never done with
    an empty `.k3patch` left. Only a `.k3patch` that is not empty (what is left is not
    k3patch's) is left quietly."""
    site = make_tree("0.31.0")
    original = _hashes(site)
    engine.apply(locate(site))
    failing(monkeypatch, "rmdir", lambda a, k: a[0] == "blobs")
    with pytest.raises(EnvironmentProblem, match="blobs"):
        engine.revert(locate(site))
    monkeypatch.undo()
    assert _hashes(site) == original
    engine.revert(locate(site))  # the fault lifted
    assert not (site / "vllm/.k3patch").exists()
    (site / "vllm/.k3patch/blobs").mkdir(parents=True)
    (site / "vllm/.k3patch/notes.txt").write_text("the operator's\n")
    engine.revert(locate(site))  # not k3patch's: left where it is, quietly
    assert (site / "vllm/.k3patch/notes.txt").exists()
