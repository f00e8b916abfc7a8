"""Trust nothing on disk (issue 13): tampered records and journals, planted symlinks, upgrades
and reinstalls, races, odd files and closed pipes never cost data, never make k3patch write
outside the tree, and never give an exit code that lies. One test (at least) per numbered
defect of the issue; each was seen to fail with its protection removed."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import crash_campaign
import pytest
from conftest import pristine_tree, run_cli, slow_after, tree_hashes

from k3patch import engine, lock, replace, scan
from k3patch.errors import ConcurrentChange
from k3patch.fastpath import try_fast
from k3patch.state import (
    STATE_FILE,
    registered_targets,
)
from k3patch.tree import TreeError, locate

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


def test_1_upgrade_then_revert_leaves_the_new_version(make_tree):
    site = make_tree("0.29.0")
    tree = locate(site)
    assert engine.apply(tree).written
    upgrade(site, "0.31.0")
    tree = locate(site)
    engine.apply(tree)
    outcome = engine.revert(tree)
    assert not outcome.conflicts
    new = pristine_tree("0.31.0") / "vllm"
    for rel in registered_targets():
        if (new / rel).exists():
            assert (site / "vllm" / rel).read_bytes() == (new / rel).read_bytes(), rel
    assert not (site / "vllm/.k3patch").exists()


def test_1_upgrade_without_new_apply_revert_names_both_hashes(make_tree):
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    upgrade(site, "0.33.0")
    changed = [rel for rel, fs in record(site)["files"].items()]
    outcome = engine.revert(locate(site))
    # Each file is 0.33.0's now: neither what k3patch wrote nor the recorded original.
    pristine = pristine_tree("0.33.0") / "vllm"
    differing = [r for r in changed if (site / "vllm" / r).read_bytes() != b""]
    assert outcome.conflicts and len(outcome.conflicts) <= len(differing)
    assert all("original" in c and "k3patch wrote" in c for c in outcome.conflicts)
    assert (site / "vllm" / AITER).read_bytes() == (pristine / AITER).read_bytes()


def test_1_force_reinstall_then_revert_is_clean(make_tree):
    site = make_tree("0.31.0")
    before = sources(site)
    engine.apply(locate(site))
    written = list(record(site)["files"])
    upgrade(site, "0.31.0")  # --force-reinstall: the originals are back
    outcome = engine.revert(locate(site))
    assert not outcome.conflicts and outcome.restored == sorted(written)
    assert sources(site) == before
    assert not (site / "vllm/.k3patch").exists()


def test_1_a_hand_edit_on_top_of_the_patch_keeps_the_original(make_tree):
    """Not an upgrade: the same install, k3patch's edit still there. The original stays
    recorded, so revert refuses (both hashes named) instead of forgetting the file."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    target = site / "vllm" / AITER
    target.write_bytes(target.read_bytes() + b"# a local note\n")
    engine.apply(locate(site))  # nothing pending: records the classification again
    assert AITER in record(site)["files"]
    edited = target.read_bytes()
    outcome = engine.revert(locate(site))
    assert any(AITER in c and "original" in c for c in outcome.conflicts), outcome
    assert target.read_bytes() == edited


def test_1_orphan_state_dir_after_uninstall_is_exit_3(make_tree):
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    for entry in (site / "vllm").iterdir():
        if entry.name != ".k3patch":
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    with pytest.raises(TreeError) as info:
        locate(site)
    assert not info.value.usage and "no longer installed" in str(info.value)
    assert run_cli("status", "--vllm", str(site)).returncode == 3


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


def test_11_deep_expressions_are_drift_not_a_traceback(make_tree):
    site = make_tree("0.31.0")
    target = site / "vllm" / AITER
    deep = "x = " + " + ".join(["1"] * 5000) + "\n"
    target.write_text(target.read_text() + deep)
    proc = run_cli("status", "--vllm", str(site), "--json")
    assert proc.returncode == 1, proc.stderr
    assert "too deeply" in proc.stdout and "internal error" not in proc.stdout + proc.stderr


# -- 9: a revert killed after its journal ----------------------------------------------------


def test_9_apply_after_a_killed_revert_is_exit_0(make_tree):
    site = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    killed = run_cli("revert", "--vllm", str(site), env={"K3PATCH_TEST_CRASH_AT": "blobs-written"})
    assert killed.returncode == 137
    proc = run_cli("apply", "--quiet", "--vllm", str(site))
    assert proc.returncode == 0, (proc.stdout, proc.stderr)


def test_9_a_revert_stopped_after_its_commit_finishes_on_the_next_run(make_tree):
    """Stopped between the commit and the clean-up (SIGINT there is what the campaign hit):
    the record must outlive the blobs, or the next revert sees saved originals without a
    record and has to refuse."""
    site = make_tree("0.31.0")
    original = sources(site)
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    env = {"K3PATCH_TEST_CRASH_AT": "journal-removed"}
    assert run_cli("revert", "--vllm", str(site), env=env).returncode == 137
    again = run_cli("revert", "--vllm", str(site))
    assert again.returncode == 0, again.stderr
    assert sources(site) == original and not (site / "vllm/.k3patch").exists()


def test_9_recovery_puts_every_file_back_before_a_bytecode_sync_can_fail(make_tree):
    """A killed apply's recovery whose bytecode sync fails (here `vllm/__pycache__` is a file)
    still leaves every source as it was before: the files first, then their bytecode. Synced
    file by file, the connector stayed patched behind an `_aiter_ops.py` that was put back."""
    site = make_tree("0.31.0")
    original = sources(site)
    env = {"K3PATCH_TEST_CRASH_AT": "replaced:.k3patch/state.json"}
    assert run_cli("apply", "--vllm", str(site), env=env).returncode == 137
    assert sources(site) != original  # both files written, the journal left
    cache = site / "vllm" / "__pycache__"
    if cache.exists():
        shutil.rmtree(cache)
    cache.write_text("not a directory\n")
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "__pycache__" in proc.stderr
    assert {k: v for k, v in sources(site).items() if "__pycache__" not in k} == {
        k: v for k, v in original.items() if "__pycache__" not in k
    }


# -- 7: concurrent apply and revert ------------------------------------------------------------


def test_7_the_lock_is_the_package_dir_and_leaves_nothing(make_tree):
    """The lock is an flock of the vllm package dir, which k3patch never creates or removes:
    taking and giving it back makes no `.k3patch`, and another process's hold on it is seen."""
    site = make_tree("0.31.0")
    package = site / "vllm"
    with lock.locked(package, 5):
        fd = os.open(package, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(BlockingIOError):  # flock: held per open file, so this fd waits
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    assert not (package / ".k3patch").exists()


def test_7_racing_applies_and_reverts_stay_whole(make_tree):
    site = make_tree("0.31.0")
    original = sources(site)
    reference = make_tree("0.31.0")
    engine.apply(locate(reference))
    patched = {k.replace(reference.name, site.name): v for k, v in sources(reference).items()}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "k3patch", op, "--vllm", str(site)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for op in ["apply", "revert"] * 6
    ]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, (p.args, out, err)
    assert sources(site) in (original, patched)


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


def test_8_an_edit_before_the_rename_is_kept_and_no_journal_blocks(make_tree, monkeypatch):
    site = make_tree("0.31.0")
    target = site / "vllm" / AITER
    theirs = target.read_bytes() + b"# theirs\n"
    after_the_temp_file(monkeypatch, lambda: target.write_bytes(theirs))
    with pytest.raises(ConcurrentChange):
        engine.apply(locate(site))
    assert target.read_bytes() == theirs
    assert not (site / "vllm/.k3patch/journal.json").exists()
    monkeypatch.undo()
    assert run_cli("status", "--vllm", str(site)).returncode in (0, 1)
    assert scan.scan(locate(site)).interrupted is None


def test_8_an_edit_during_blobs_does_not_leave_a_journal(make_tree):
    site = make_tree("0.31.0")
    target = site / "vllm" / AITER
    theirs = target.read_bytes() + b"# theirs\n"

    def hook(step: str) -> None:
        if step == "blobs-written":
            target.write_bytes(theirs)

    with pytest.raises(ConcurrentChange):
        engine.apply(locate(site), fault=hook)
    assert target.read_bytes() == theirs
    assert not (site / "vllm/.k3patch/journal.json").exists()
    assert scan.scan(locate(site)).interrupted is None


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "no exchange"])
def test_8_a_file_renamed_in_after_the_last_look_is_not_lost(make_tree, monkeypatch, exchange):
    """Another writer replaces the target by rename between k3patch's last look and its own
    rename. With an atomic exchange k3patch sees what it displaced and puts the other file
    back (exit 3, run again); without one (a filesystem that refuses it) it cannot, which is
    the residual window this test documents."""
    site = make_tree("0.31.0")
    target = site / "vllm" / AITER
    theirs = target.read_bytes() + b"# theirs, renamed in\n"
    if not exchange:
        monkeypatch.setattr(replace, "exchange", lambda dfd, a, b: False)

    def hook(step: str) -> None:
        if step == f"renaming:{AITER}":
            other = target.with_name("their-temp")
            other.write_bytes(theirs)
            os.replace(other, target)

    if exchange:
        with pytest.raises(ConcurrentChange):
            engine.apply(locate(site), fault=hook)
        assert target.read_bytes() == theirs
        assert not (site / "vllm/.k3patch/journal.json").exists()
        assert not [p for p in site.rglob("*") if ".k3patch-tmp." in p.name]
        assert scan.scan(locate(site)).interrupted is None
    else:
        engine.apply(locate(site), fault=hook)
        assert target.read_bytes() != theirs  # overwritten: why the exchange is used


def test_8_an_edit_in_place_after_the_last_look_is_put_back(make_tree, monkeypatch):
    """Without an exchange, another writer's in-place edit that lands between k3patch's last
    look and its rename is seen on the old file afterwards and put back (exit 3, run again)."""
    site = make_tree("0.31.0")
    target = site / "vllm" / AITER
    theirs = target.read_bytes() + b"# theirs, written in place\n"
    monkeypatch.setattr(replace, "exchange", lambda dfd, a, b: False)

    def hook(step: str) -> None:
        if step == f"renaming:{AITER}":
            with open(target, "r+b") as f:  # the same inode k3patch read
                f.write(theirs)

    with pytest.raises(ConcurrentChange, match="edit was put back"):
        engine.apply(locate(site), fault=hook)
    assert target.read_bytes() == theirs
    assert not (site / "vllm/.k3patch/journal.json").exists()


def test_8_without_exchange_a_file_renamed_in_before_the_last_look_is_kept(make_tree, monkeypatch):
    """Where the filesystem has no exchange, the last look before the rename is what keeps a
    file another writer renamed in while k3patch wrote its temp file."""
    site = make_tree("0.31.0")
    target = site / "vllm" / AITER
    theirs = target.read_bytes() + b"# theirs, renamed in\n"
    monkeypatch.setattr(replace, "exchange", lambda dfd, a, b: False)

    def rename_in() -> None:
        other = target.with_name("their-temp")
        other.write_bytes(theirs)
        os.replace(other, target)

    after_the_temp_file(monkeypatch, rename_in)
    with pytest.raises(ConcurrentChange):
        engine.apply(locate(site))
    assert target.read_bytes() == theirs
    assert not (site / "vllm/.k3patch/journal.json").exists()


# -- 13: one finite lock timeout; a live apply is not an interrupted one --------------------


def test_13_lock_timeout_must_be_finite(make_tree):
    site = make_tree("0.31.0")
    for bad in ("nan", "inf", "-1"):
        proc = run_cli("apply", "--vllm", str(site), "--lock-timeout", bad)
        assert proc.returncode == 2 and "lock-timeout" in proc.stderr, (bad, proc.stderr)


def test_13_fast_path_and_full_path_share_one_timeout(make_tree, monkeypatch):
    site = make_tree("0.31.0")
    fd = os.open(site / "vllm", os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a stopped lock holder
    clock = [0.0]
    monkeypatch.setattr(lock.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(lock.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    try:
        code = try_fast(["apply", "--quiet", "--lock-timeout", "7", "--vllm", str(site)])
    finally:
        os.close(fd)
    assert code == 3
    assert 7 <= clock[0] < 8, clock[0]


@pytest.mark.parametrize("as_json", slow_after([True, False]))
def test_13_a_lock_timeout_reads_the_same_on_the_no_op_path_and_the_full_path(
    make_tree, tmp_path, as_json
):
    """The no-op path times out waiting for a lock holder itself (one timeout, not two): what
    it prints must be what the full path prints, the error line on stderr under --json too,
    and one line with the newline in the tree's path escaped."""
    site = tmp_path / "odd\nname" / "site"
    site.parent.mkdir()
    shutil.move(make_tree("0.31.0"), site)
    fd = os.open(site / "vllm", os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a stopped lock holder
    args = ["apply", "--lock-timeout", "0", "--vllm", str(site), *(["--json"] if as_json else [])]
    try:
        fast = run_cli(*args)
        full = run_cli(*args, env={"K3PATCH_NO_FASTPATH": "1"})
    finally:
        os.close(fd)
    assert fast.returncode == full.returncode == 3, (fast.stderr, full.stderr)
    assert (fast.stdout, fast.stderr) == (full.stdout, full.stderr)
    assert fast.stderr.startswith("k3patch: error: ") and fast.stderr.count("\n") == 1


def test_13_status_waits_for_a_live_apply_instead_of_saying_interrupted(make_tree):
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    state = site / "vllm/.k3patch"
    journal = state / "journal.json"
    journal.write_text(json.dumps({"op": "apply", "files": []}))
    fd = os.open(site / "vllm", os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    proc = subprocess.Popen(
        [sys.executable, "-m", "k3patch", "status", "--json", "--vllm", str(site)],
        stdout=subprocess.PIPE,
        text=True,
    )
    time.sleep(1.0)  # let it see the journal and the held lock
    journal.unlink()  # the live run finishes its commit ...
    os.close(fd)  # ... and lets go
    out, _ = proc.communicate(timeout=120)
    data = json.loads(out)
    assert data["interrupted"] is None and data["exit_code"] == 0


# -- 14: owner, setuid/setgid, xattrs, hard links -------------------------------------------


@ROOT_ONLY
def test_14_owner_special_bits_and_xattrs_survive_apply_and_revert(make_tree):
    site = make_tree("0.31.0")
    target = site / "vllm" / AITER
    os.chown(target, 1234, 5678)
    os.chmod(target, 0o6751)
    try:
        os.setxattr(target, "user.k3patch-test", b"kept")
        xattrs = True
    except OSError:
        xattrs = False
    for step in (engine.apply, engine.revert):
        step(locate(site))
        st = os.stat(target)
        assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1234, 5678, 0o6751), step
        if xattrs:
            assert os.getxattr(target, "user.k3patch-test") == b"kept"


def test_14_every_file_written_and_its_directory_are_fsynced(make_tree, monkeypatch):
    """A rename survives a power cut only once the new file and its directory are on disk:
    apply must never leave an empty or old file under a target's name."""
    site = make_tree("0.31.0")
    synced = set()
    real = os.fsync

    def spy(fd: int) -> None:
        st = os.fstat(fd)
        synced.add((st.st_dev, st.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    written = engine.apply(locate(site)).written
    for rel in [*written, f".k3patch/{STATE_FILE}"]:
        for path in (site / "vllm" / rel, (site / "vllm" / rel).parent):
            st = os.stat(path)
            assert (st.st_dev, st.st_ino) in synced, path


def test_14_a_split_hard_link_is_reported(make_tree, tmp_path):
    site = make_tree("0.31.0")
    target = site / "vllm" / AITER
    os.link(target, tmp_path / "other-name.py")
    outcome = engine.apply(locate(site))
    assert any("hard links" in line for line in outcome.pycache), outcome.pycache


# -- What to build: the pycache directory, and a thread racing the lock ----------------------


# -- issue 21: the plugin names a damaged record, and never blocks on a FIFO ------------------
