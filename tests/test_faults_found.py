"""Defects the whole fault-injection campaign (benchmarks/faults.py, issue 26; the table is in
benchmarks/RELIABILITY.md) found, each held here in the small: one filesystem call made to fail
the way the campaign failed it, and the promise that broke (no k3patch temp file outlives a
failed run; the file is whole).

FAULTS-1: `replace_checked` wrote its temp file, then took the last look at the target
(`os.stat`) outside the block that removes its own temp files on failure; and after an
exchange, the look at what it swapped out, and the rename of that to the kept name, failed
with the old file left under a temp name. Seen: recover-apply on fork tree a, ENOSPC/EIO/EACCES
at `os.stat` in `_look` (the recovery has no litter sweep after it, the commit's rollback did).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from k3patch import replace
from k3patch.errors import EnvironmentProblem

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
    failing(monkeypatch, "stat", lambda a, k: a[0] == "a.py" and "dir_fd" in k)
    with pytest.raises(EnvironmentProblem):
        replace.replace_checked(root, "a.py", OLD, NEW)
    assert temps(root) == []
    assert (root / "a.py").read_bytes() == OLD


@pytest.mark.parametrize("kept", [None, []], ids=["removed", "kept"])
def test_a_failed_look_at_the_swapped_out_file_leaves_no_temp_file(root, monkeypatch, kept):
    if replace._renameat2() is None:
        pytest.skip("no renameat2 here: the exchange branch is not taken")
    failing(monkeypatch, "stat", lambda a, k: str(a[0]).startswith(".a.py.k3patch-tmp."))
    with pytest.raises(EnvironmentProblem):
        replace.replace_checked(root, "a.py", OLD, NEW, kept=kept)
    assert temps(root) == []
    assert (root / "a.py").read_bytes() == OLD, "swapped back: the file as it stood"
    assert not kept


def test_a_failed_rename_to_the_kept_name_leaves_no_temp_file(root, monkeypatch):
    if replace._renameat2() is None:
        pytest.skip("no renameat2 here: the exchange branch is not taken")
    failing(monkeypatch, "rename", lambda a, k: str(a[0]).startswith(".a.py.k3patch-tmp."))
    kept: list[str] = []
    with pytest.raises(EnvironmentProblem):
        replace.replace_checked(root, "a.py", OLD, NEW, kept=kept)
    assert temps(root) == []
    assert kept == [], "nothing kept: a rollback writes the saved copy"


# FAULTS-2: revert began with `os.path.lexists(.k3patch)`, which reads any failure as "absent":
# an EIO or EACCES on that one look made revert report "nothing recorded" and exit 0 on an
# applied tree (recover-revert on fork tree a, ENOSPC/EIO/EACCES at call 14, os.lstat).
@pytest.mark.wheel
def test_revert_that_cannot_look_for_the_record_is_an_environment_error(make_tree, monkeypatch):
    from k3patch import engine
    from k3patch.tree import locate

    site = make_tree("0.31.0")
    engine.apply(locate(site))
    tree = locate(site)
    state = str(tree.state_dir)
    failing(monkeypatch, "lstat", lambda a, k: str(a[0]) == state)
    with pytest.raises(EnvironmentProblem, match=r"cannot look at .*\.k3patch: Input/output"):
        engine.revert(tree)
    monkeypatch.undo()
    assert (site / "vllm/.k3patch/state.json").is_file(), "nothing removed"


# FAULTS-3: the recovery removed the litter beside the targets best effort and then the journal:
# a removal that failed (EIO, ENOSPC on NFS, EACCES) left a killed run's temp file, and, the
# journal and then `.k3patch` gone, no later run looked for it again (revert of a tree with no
# `.k3patch` does nothing), so it stayed for good. Seen: recover-revert on fork tree a, a fault
# at the open of `vllm` or the unlink in `remove_litter`.
@pytest.mark.wheel
def test_a_recovery_that_cannot_remove_the_litter_keeps_its_journal(make_tree, monkeypatch):
    from conftest import run_cli

    from k3patch import engine
    from k3patch.tree import locate

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
    from k3patch import engine
    from k3patch.tree import locate

    monkeypatch.undo()
    engine.apply(locate(site))  # the fault lifted
    assert _hashes(site) != original
    engine.revert(locate(site))
    assert _hashes(site) == original, "the originals were saved: revert puts them back"


# FAULTS-4: a sync that failed after the journal was removed (the commit done) was taken for a
# failed commit: `_commit` found no journal, read that as "rolled back", and removed the record
# and every saved original of a tree now fully patched; nothing could revert it. Seen: apply on
# 0.31.0, ENOSPC/EIO/EACCES at the fsync or close after the journal's unlink (calls 603, 604).
@pytest.mark.wheel
def test_a_failed_sync_after_the_commit_keeps_the_saved_originals(make_tree, monkeypatch):
    from k3patch import engine
    from k3patch.tree import locate

    site = make_tree("0.31.0")
    original = _hashes(site)
    _fail_after(monkeypatch, lambda p: p.endswith("journal.json"), persistent=False)
    with pytest.raises(EnvironmentProblem):
        engine.apply(locate(site))
    assert (site / "vllm/.k3patch/state.json").is_file()
    _lift_and_check(site, original, monkeypatch)


# FAULTS-5: a disk that fills up at the sync after a kept old file's removal (the last step
# before the journal goes) and stays full: the commit rolled back, and the file whose kept copy
# was already gone needed space to be written back, so the run ended with one patch applied and
# one rolled back (apply on 0.31.0, disk full at call 583, fsync of `vllm/`).
@pytest.mark.wheel
def test_a_full_disk_at_the_removal_of_a_kept_copy_leaves_a_whole_tree(make_tree, monkeypatch):
    from k3patch import engine
    from k3patch.tree import locate

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


# FAULTS-6: revert removed `.k3patch` best effort: any failure of the last removals (opening a
# directory, the rmdir of `blobs/` or `.k3patch`, the sync after) was silenced, so revert said
# done, exit 0, and left an empty `.k3patch`. Only "not empty" (what is left is not k3patch's)
# is to be left quietly. Seen: revert on 0.31.0, ENOSPC/EIO/EACCES at calls 555-562.
@pytest.mark.wheel
def test_a_revert_that_cannot_remove_k3patch_says_so(make_tree, monkeypatch):
    from k3patch import engine
    from k3patch.tree import locate

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
