"""Another process at work on the same tree: a racing run, a writer during the commit, a lock
holder, a run killed part way. The tree stays whole, the other writer's bytes are kept, a live
run is waited for (one finite timeout, the same on the no-op and the full path), and the next run
finishes what a killed one left."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SLOW, run_cli, sha, slow_after
from disk_setups import (
    AITER,
    AITER_FILE,
    CONNECTOR_FILE,
    STRACE,
    k3patch_argv,
    needs_strace,
    source_hashes,
)

from k3patch import engine, lock, replace, scan
from k3patch.errors import ConcurrentChange
from k3patch.fastpath import try_fast
from k3patch.tree import locate

pytestmark = pytest.mark.wheel


def test_the_lock_is_the_package_dir_and_leaves_nothing(make_tree):
    """Issue 13 item 7: concurrent apply and revert.

    The lock is an flock of the vllm package dir, which k3patch never creates or removes:
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


def test_racing_applies_and_reverts_leave_the_tree_whole(make_tree):
    """Issue 13 item 7: concurrent apply and revert."""
    site = make_tree("0.31.0")
    original = source_hashes(site)
    reference = make_tree("0.31.0")
    engine.apply(locate(reference))
    patched = {k.replace(reference.name, site.name): v for k, v in source_hashes(reference).items()}
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
    assert source_hashes(site) in (original, patched)


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


def test_an_edit_before_the_rename_is_kept_and_no_journal_blocks(make_tree, monkeypatch):
    """Issue 13 item 8: another writer during the commit."""
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


def test_an_edit_during_blobs_does_not_leave_a_journal(make_tree):
    """Issue 13 item 8: another writer during the commit."""
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
def test_a_file_renamed_in_after_the_last_look_is_not_lost(make_tree, monkeypatch, exchange):
    """Issue 13 item 8: another writer during the commit.

    Another writer replaces the target by rename between k3patch's last look and its own
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


def test_an_edit_in_place_after_the_last_look_is_put_back(make_tree, monkeypatch):
    """Issue 13 item 8: another writer during the commit.

    Without an exchange, another writer's in-place edit that lands between k3patch's last
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


def test_without_exchange_a_file_renamed_in_before_the_last_look_is_kept(make_tree, monkeypatch):
    """Issue 13 item 8: another writer during the commit.

    Where the filesystem has no exchange, the last look before the rename is what keeps a
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


def test_the_lock_timeout_must_be_finite(make_tree):
    """Issue 13 item 13: one finite lock timeout."""
    site = make_tree("0.31.0")
    for bad in ("nan", "inf", "-1"):
        proc = run_cli("apply", "--vllm", str(site), "--lock-timeout", bad)
        assert proc.returncode == 2 and "lock-timeout" in proc.stderr, (bad, proc.stderr)


def test_the_no_op_path_and_the_full_path_share_one_lock_timeout(make_tree, monkeypatch):
    """Issue 13 item 13: one finite lock timeout."""
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
def test_a_lock_timeout_reads_the_same_on_the_no_op_path_and_the_full_path(
    make_tree, tmp_path, as_json
):
    """Issue 13 item 13: one finite lock timeout.

    The no-op path times out waiting for a lock holder itself (one timeout, not two): what
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


def test_status_waits_for_a_live_apply_instead_of_saying_interrupted(make_tree):
    """Issue 13 item 13: a live apply is not an interrupted one."""
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


def test_apply_after_a_killed_revert_is_exit_0(make_tree):
    """Issue 13 item 9: a revert killed after its journal."""
    site = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    killed = run_cli("revert", "--vllm", str(site), env={"K3PATCH_TEST_CRASH_AT": "blobs-written"})
    assert killed.returncode == 137
    proc = run_cli("apply", "--quiet", "--vllm", str(site))
    assert proc.returncode == 0, (proc.stdout, proc.stderr)


def test_a_revert_stopped_after_its_commit_finishes_on_the_next_run(make_tree):
    """Issue 13 item 9: a revert killed after its journal.

    Stopped between the commit and the clean-up (SIGINT there is what the campaign hit):
    the record must outlive the blobs, or the next revert sees saved originals without a
    record and has to refuse."""
    site = make_tree("0.31.0")
    original = source_hashes(site)
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    env = {"K3PATCH_TEST_CRASH_AT": "journal-removed"}
    assert run_cli("revert", "--vllm", str(site), env=env).returncode == 137
    again = run_cli("revert", "--vllm", str(site))
    assert again.returncode == 0, again.stderr
    assert source_hashes(site) == original and not (site / "vllm/.k3patch").exists()


def test_recovery_puts_every_file_back_before_a_bytecode_sync_can_fail(make_tree):
    """A killed apply's recovery whose bytecode sync fails (here `vllm/__pycache__` is a file)
    still leaves every source as it was before: the files first, then their bytecode. Synced
    file by file, the connector stayed patched behind an `_aiter_ops.py` that was put back."""
    site = make_tree("0.31.0")
    original = source_hashes(site)
    env = {"K3PATCH_TEST_CRASH_AT": "replaced:.k3patch/state.json"}
    assert run_cli("apply", "--vllm", str(site), env=env).returncode == 137
    assert source_hashes(site) != original  # both files written, the journal left
    cache = site / "vllm" / "__pycache__"
    if cache.exists():
        shutil.rmtree(cache)
    cache.write_text("not a directory\n")
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "__pycache__" in proc.stderr
    assert {k: v for k, v in source_hashes(site).items() if "__pycache__" not in k} == {
        k: v for k, v in original.items() if "__pycache__" not in k
    }


@SLOW
@needs_strace
def test_status_behind_a_paused_commit_never_reports_half_a_commit(make_tree, tmp_path):
    """Promise (docs/how-apply-keeps-a-tree-whole.md, locking): "`status` takes the lock shared
    before it reads anything, so it waits for a live run and reports what that run left, never
    files read half way through a commit"; README: status never reports a state no run
    committed; docs/exit-codes.md: a lock timeout is exit 3.

    An apply is paused (as Slurm's `scontrol suspend` or a cgroup freezer stops a job) right
    after its first atomic exchange: `_aiter_ops.py` is replaced, `moriio_connector.py` not yet.
    A `status` started then waits for the lock and, when its wait ends, must not report that
    mix (aiter-mla-gfx942 applied, moriio-chunk-gate pending): no run committed it, and the
    paused run, once resumed, leaves both applied. It exits 3 (the lock timed out), never 1
    with that mix and an "interrupted" apply's journal."""
    site = make_tree("0.31.0")
    before = sha(site / AITER_FILE)
    moriio_before = sha(site / CONNECTOR_FILE)
    # The apply stops for 400 s right after its first renameat2 (RENAME_EXCHANGE) returns.
    writer = subprocess.Popen(
        [
            STRACE,
            "-f",
            "-o",
            str(tmp_path / "strace.out"),
            "-e",
            "trace=renameat2",
            "-e",
            "inject=renameat2:delay_exit=400000000:when=1",
            *k3patch_argv("apply", "--vllm", str(site)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while sha(site / AITER_FILE) == before:
            assert writer.poll() is None, "the apply ended before its first exchange"
            assert time.monotonic() < deadline, "the apply never reached its first exchange"
            time.sleep(0.2)
        assert sha(site / CONNECTOR_FILE) == moriio_before, "the pause is not between the two files"
        # status waits its --lock-timeout (default 120 s; 5 here) for the stopped run, then
        # gives up: exit 3, never the mix.
        proc = run_cli("status", "--vllm", str(site), "--json", "--lock-timeout", "5")
        verdicts = {p["id"]: p["verdict"] for p in json.loads(proc.stdout).get("patches", [])}
        half = (
            verdicts.get("aiter-mla-gfx942") == "applied"
            and verdicts.get("moriio-chunk-gate") == "pending"
        )
        assert not half, (proc.returncode, verdicts, proc.stderr)
        assert proc.returncode == 3, (proc.returncode, verdicts, proc.stderr)
    finally:
        # The paused apply (strace's child) is killed, then strace; the tree is a scratch copy.
        children = Path(f"/proc/{writer.pid}/task/{writer.pid}/children")
        for pid in children.read_text().split() if children.exists() else []:
            os.kill(int(pid), signal.SIGKILL)
        writer.kill()
        writer.wait(timeout=60)
