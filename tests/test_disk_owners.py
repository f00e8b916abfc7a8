"""Other users, owners and a disk that refuses: a file keeps its owner, group, special bits,
xattrs and links, and reaches the disk (fsync) before it counts; a record is readable by every
reader, and one a user cannot read is named, never "never applied"; a user who may not write
is told so in one line (exit 3) and may still read; a full or read-only disk leaves not one
byte changed."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import run_cli, slow_after, tree_hashes
from disk_setups import (
    AITER,
    ROOT_ONLY,
    as_nobody,
    everything,
    one_line,
    run_as_nobody,
    shared_site,
)

from k3patch import engine, plugin, scan, state
from k3patch.errors import EnvironmentProblem
from k3patch.state import (
    STATE_FILE,
)
from k3patch.tree import locate

pytestmark = pytest.mark.wheel


@ROOT_ONLY
def test_owner_special_bits_and_xattrs_survive_apply_and_revert(make_tree):
    """Issue 13 item 14: owner, setuid/setgid, xattrs, hard links."""
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


def test_every_file_written_and_its_directory_are_fsynced(make_tree, monkeypatch):
    """Issue 13 item 14: owner, setuid/setgid, xattrs, hard links.

    A rename survives a power cut only once the new file and its directory are on disk:
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


def test_a_split_hard_link_is_reported(make_tree, tmp_path):
    """Issue 13 item 14: owner, setuid/setgid, xattrs, hard links."""
    site = make_tree("0.31.0")
    target = site / "vllm" / AITER
    os.link(target, tmp_path / "other-name.py")
    outcome = engine.apply(locate(site))
    assert any("hard links" in line for line in outcome.pycache), outcome.pycache


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def status_of(site: Path) -> Callable[[], Any]:
    def run() -> Any:
        report = scan.scan(locate(site))
        verdicts = {k: v.value for k, v in report.verdicts().items()}
        return [report.state_problem, report.from_record, verdicts]

    return run


@ROOT_ONLY
def test_an_apply_under_umask_077_leaves_a_record_every_reader_can_read(make_tree):
    """Issue 21 part B class 5: the same verdict for every user."""
    with shared_site(make_tree) as site:
        with umask(0o077):
            engine.apply(locate(site))
        state_dir = site / "vllm" / ".k3patch"
        for path in [state_dir, *state_dir.rglob("*")]:
            mode = stat.S_IMODE(os.lstat(path).st_mode)
            assert mode == (0o755 if path.is_dir() else 0o644), (path, oct(mode))
        problem, from_record, verdicts = as_nobody(status_of(site))
        assert problem is None and from_record is True
        assert verdicts["aiter-mla-gfx942"] == "applied"
        assert as_nobody(lambda: plugin.preflight_problem(str(site / "vllm"))) is None


@ROOT_ONLY
@pytest.mark.parametrize("hidden", ["record", "state dir"])
def test_a_record_this_user_cannot_read_is_named_never_absent(make_tree, hidden):
    """Issue 21 part B class 5: the same verdict for every user."""
    with shared_site(make_tree) as site:
        engine.apply(locate(site))
        state_dir = site / "vllm" / ".k3patch"
        os.chmod(state_dir / state.STATE_FILE if hidden == "record" else state_dir, 0o600)
        problem, from_record, verdicts = as_nobody(status_of(site))
        assert problem is not None and "permission denied" in problem, problem
        assert from_record is False  # the verdicts come from the code
        assert verdicts["aiter-mla-gfx942"] == "applied"
        said = as_nobody(lambda: plugin.preflight_problem(str(site / "vllm")))
        assert said is not None and "cannot be read" in said and "never applied" not in said


@ROOT_ONLY
@pytest.mark.parametrize("hidden", slow_after(["state.json", ".k3patch"]))
def test_status_as_another_user_names_a_record_it_cannot_read(make_tree, hidden):
    """A record left 0600 (an apply under `umask 077` by an older k3patch): `status` as another
    user gives the verdicts from the code, names that it cannot read the record, and exits 3,
    never a silent "no record"."""
    with shared_site(make_tree) as site:
        assert run_cli("apply", "--vllm", str(site)).returncode == 0
        state_dir = site / "vllm" / ".k3patch"
        os.chmod(state_dir / hidden if hidden == "state.json" else state_dir, 0o600)
        code, stdout, stderr = run_as_nobody(["status", "--quiet", "--vllm", str(site)])
        assert code == 3, (stdout, stderr)
        assert "aiter-mla-gfx942: applied" in stdout
        assert len(stderr.splitlines()) == 1 and "permission denied" in stderr, stderr


@ROOT_ONLY
def test_no_chown_when_the_owner_and_group_are_already_the_files(make_tree, monkeypatch):
    """Issue 21 part B class 6: the owner can apply.

    A setgid directory gives the temp file the target's group already: a chown would be
    refused to an owner outside that group, and is not needed."""
    site = make_tree("0.31.0")
    target = site / "vllm" / AITER
    os.chown(target.parent, -1, 1)
    os.chmod(target.parent, 0o2755)
    os.chown(target, -1, 1)
    assert os.getgid() != 1

    def refuse(fd: int, uid: int, gid: int) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "fchown", refuse)
    engine.apply(locate(site))
    assert os.stat(target).st_gid == 1
    assert scan.scan(locate(site)).verdicts()["aiter-mla-gfx942"].value == "applied"


@ROOT_ONLY
def test_a_refused_chown_of_another_users_file_names_the_owner(make_tree, monkeypatch):
    """Issue 21 part B class 6: the owner can apply.

    Another user's file: its owner cannot be kept, which is a refusal (a group alone, of a
    file this process owns, is a warning: test_write_path)."""
    site = make_tree("0.31.0")
    target = site / "vllm" / AITER
    os.chown(target, 1234, 1)
    before = tree_hashes(site)

    def refuse(fd: int, uid: int, gid: int) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "fchown", refuse)
    with pytest.raises(EnvironmentProblem) as caught:
        engine.apply(locate(site))
    message = str(caught.value)
    assert "owner 1234" in message, message
    assert "run as the tree's owner" not in message
    assert tree_hashes(site) == before


@ROOT_ONLY
def test_the_owner_outside_the_files_group_applies_in_a_setgid_dir(make_tree):
    """Issue 21 part B class 6: the owner can apply.

    For real, as `nobody` owning the tree, the files' group `daemon` (1) not one of its."""
    with shared_site(make_tree) as site:
        for path in [site, *site.rglob("*")]:
            os.chown(path, 65534, 1)
        for path in [p for p in [site, *site.rglob("*")] if p.is_dir()]:
            os.chmod(path, 0o2755)
        result = as_nobody(lambda: engine.apply(locate(site)).written)
        assert result and result[0] != "raised", result
        assert os.stat(site / "vllm" / AITER).st_gid == 1


@ROOT_ONLY
def test_another_user_who_may_not_write_gets_exit_3_and_may_still_read(make_tree):
    with shared_site(make_tree) as site:
        before = everything(site)
        for args in (["apply", "--vllm", str(site)], ["apply", "--quiet", "--vllm", str(site)]):
            code, _, stderr = run_as_nobody(args)
            assert code == 3, stderr
            line = one_line(stderr)
            assert "permission denied" in line and str(site / "vllm") in line
            assert everything(site) == before
        # Reading is allowed: status works for anyone.
        code, stdout, _ = run_as_nobody(["status", "--quiet", "--vllm", str(site)])
        assert code == 1 and "aiter-mla-gfx942: pending" in stdout


@ROOT_ONLY
def test_a_pyc_this_user_cannot_read_is_removed_not_fatal(make_tree):
    """Another user's 0600 pyc in a tree this user may write: apply removes it (the directory
    allows that) and the interpreter compiles the source anew; reading it is not needed."""
    with shared_site(make_tree) as site:
        for path in [site, *site.rglob("*")]:
            os.chown(path, 65534, 65534, follow_symlinks=False)
        cache = site / "vllm" / "__pycache__"
        cache.mkdir()
        os.chown(cache, 65534, 65534)
        pyc = cache / f"_aiter_ops.{sys.implementation.cache_tag}.pyc"
        pyc.write_bytes(b"root's bytecode")
        os.chmod(pyc, 0o600)  # owned by root: nobody cannot read it, but may unlink it
        code, stdout, stderr = run_as_nobody(["apply", "--vllm", str(site)])
        assert code == 0, (stdout, stderr)
        assert f"removed {pyc.name}" in stdout and not pyc.exists()


@ROOT_ONLY
def test_a_read_only_filesystem_is_exit_3_and_status_still_reads(make_tree, tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], check=True)
    try:
        shutil.copytree(make_tree("0.31.0"), mnt / "site")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        before = everything(mnt)
        proc = run_cli("apply", "--vllm", str(mnt / "site"))
        assert proc.returncode == 3
        line = one_line(proc.stderr)
        assert "read-only" in line and str(mnt / "site" / "vllm") in line
        assert everything(mnt) == before
        # status still works on a read-only tree.
        assert run_cli("status", "--vllm", str(mnt / "site")).returncode == 1
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@ROOT_ONLY
@pytest.mark.parametrize("headroom_kb", slow_after([40, 200, 330]))
def test_a_full_disk_leaves_nothing_behind(make_tree, tmp_path, headroom_kb):
    """A tmpfs just big enough for the tree plus a little: the commit runs out of space at
    different steps (blobs, journal, the new file), and every time nothing is left behind."""
    src = make_tree("0.31.0")
    size_kb = sum(p.stat().st_size for p in src.rglob("*") if p.is_file()) // 1024
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_kb + 4096}k", "tmpfs", str(mnt)],
        check=True,
    )
    try:
        shutil.copytree(src, mnt / "site")
        # Fill the rest of the disk, leaving exactly `headroom_kb`.
        free = shutil.disk_usage(mnt).free
        filler = mnt / "filler"
        with open(filler, "wb") as handle:
            handle.write(b"\0" * max(free - headroom_kb * 1024, 0))
        before = everything(mnt / "site")
        proc = run_cli("apply", "--vllm", str(mnt / "site"))
        if proc.returncode == 0:
            pytest.skip(f"{headroom_kb} KiB was enough for the whole commit")
        assert proc.returncode == 3, proc.stderr
        assert "no space left" in one_line(proc.stderr)
        assert everything(mnt / "site") == before
        filler.unlink()
        assert run_cli("apply", "--vllm", str(mnt / "site")).returncode == 0
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def _owners(site: Path) -> dict[str, tuple[int, int]]:
    """uid:gid of `.k3patch` and everything in it."""
    state_dir = site / "vllm/.k3patch"
    return {
        p.relative_to(site).as_posix(): (p.lstat().st_uid, p.lstat().st_gid)
        for p in [state_dir, *state_dir.rglob("*")]
    }


@ROOT_ONLY
def test_a_state_dir_left_by_a_root_run_killed_after_mkdir_is_given_to_the_tree_owner(make_tree):
    """A root run killed between `mkdir .k3patch` (0700, root) and its chown leaves `.k3patch`
    root-owned. Every run that can (root) gives `.k3patch` and its files back to the tree's
    owner, so the owner reverts: never a record and saved originals written into it as
    root:root 0600/0700, which the owner can neither revert nor apply again (exit 3) and
    nobody but root can read."""
    with shared_site(make_tree) as site:
        for path in [site, *site.rglob("*")]:
            os.lchown(path, 65534, 65534)
        (site / "vllm/.k3patch").mkdir(mode=0o700)  # what the killed root run left
        proc = run_cli("apply", "--vllm", str(site), "-q")
        assert proc.returncode == 0, proc.stderr
        owners = _owners(site)
        assert "vllm/.k3patch/state.json" in owners and len(owners) > 3, owners
        assert set(owners.values()) == {(65534, 65534)}, owners
        code, stdout, stderr = run_as_nobody(["revert", "--vllm", str(site)])
        assert code == 0, (stdout, stderr)
        assert not (site / "vllm/.k3patch").exists()


# Run k3patch as root with its first chown of a directory killing the process: the step
# between making a state directory and giving it to the tree's owner.
_KILLED_AT_FIRST_DIRECTORY_CHOWN = """
import os, runpy, stat, sys
real = os.fchown
def fchown(fd, uid, gid):
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        os._exit(137)
    return real(fd, uid, gid)
os.fchown = fchown
sys.argv = ["k3patch", *sys.argv[1:]]
runpy.run_module("k3patch", run_name="__main__")
"""


@ROOT_ONLY
def test_a_root_run_killed_before_its_chown_leaves_no_state_dir_the_owner_cannot_use(make_tree):
    """Root's apply killed right before it gives the new `.k3patch` to the tree's owner. No
    `.k3patch` of root's may be left (it is made under a temp name and renamed into place once
    it is the owner's); the owner's own apply then succeeds, removes the temp directory and
    leaves everything of `.k3patch` the owner's."""
    with shared_site(make_tree) as site:
        for path in [site, *site.rglob("*")]:
            os.lchown(path, 65534, 65534)
        killed = subprocess.run(
            [sys.executable, "-c", _KILLED_AT_FIRST_DIRECTORY_CHOWN, "apply", "--vllm", str(site)],
            capture_output=True,
            text=True,
        )
        assert killed.returncode == 137, killed.stdout + killed.stderr
        state_dir = site / "vllm/.k3patch"
        if state_dir.exists():
            st = state_dir.lstat()
            assert (st.st_uid, st.st_gid) == (65534, 65534), f".k3patch is {st.st_uid}:{st.st_gid}"
        code, stdout, stderr = run_as_nobody(["apply", "--vllm", str(site)])
        assert code == 0, (stdout, stderr)
        assert set(_owners(site).values()) == {(65534, 65534)}, _owners(site)
        assert not [p for p in site.rglob("*k3patch-tmp*")], "a temp directory was left"
