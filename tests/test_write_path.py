"""The write path under what a node does to it: a full disk at every fill level, a
status racing a live apply, a killed run's journal on a node that otherwise reads clean, a hand
edit under a re-apply, and a tree whose owner is not the user who runs k3patch."""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import json
import os
import py_compile
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_cli, tree_hashes
from disk_setups import ROOT_ONLY, everything, run_as_nobody, shared_site

pytestmark = pytest.mark.wheel
AITER = "_aiter_ops.py"
CONNECTOR = "distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"


# -- A full disk, at every fill level ----------------------------------------------------------


@ROOT_ONLY
def test_a_full_disk_at_any_fill_level_leaves_the_tree_whole(make_tree, tmp_path):
    """A small tmpfs holding a 0.31.0 tree with unchecked-hash pycs of both files apply
    changes, filled so that only `headroom` KiB are free, for every headroom from 0 up to
    the first that lets the apply through: each refused apply exits 3 with one line, leaves
    every source byte for byte as it was, no journal, no record, no temp file; and the
    stale pycs are gone or the sources unchanged (never patched source under old bytecode).
    On main, at about 480 KiB, the rollback itself ran out of space: one file patched, one
    rolled back, a journal and a new record left, exit 3."""
    src = make_tree("0.31.0")
    mnt = tmp_path / "full"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)], check=True)
    try:
        site = mnt / "site"
        shutil.copytree(src, site)
        pycs = []
        for rel in (AITER, CONNECTOR):
            source = site / "vllm" / rel
            pyc = importlib.util.cache_from_source(str(source))
            unchecked = py_compile.PycInvalidationMode.UNCHECKED_HASH
            py_compile.compile(str(source), cfile=pyc, invalidation_mode=unchecked)
            pycs.append(Path(pyc))
        sources = {k: v for k, v in everything(site).items() if "__pycache__" not in k}
        filler = mnt / "filler"
        outcomes = []
        for headroom_kb in range(0, 2048, 24):
            filler.unlink(missing_ok=True)
            free = shutil.disk_usage(mnt).free
            with open(filler, "wb") as handle:
                handle.write(b"\0" * max(free - headroom_kb * 1024, 0))
            proc = run_cli("apply", "--vllm", str(site))
            outcomes.append((headroom_kb, proc.returncode))
            if proc.returncode == 0:
                break
            assert proc.returncode == 3, (headroom_kb, proc.stdout, proc.stderr)
            assert len(proc.stderr.splitlines()) == 1, proc.stderr
            assert "no space left" in proc.stderr, proc.stderr
            now = everything(site)
            assert {k: v for k, v in now.items() if "__pycache__" not in k} == sources, headroom_kb
            assert not [k for k in now if ".k3patch-tmp." in k], (headroom_kb, now)
        assert outcomes[-1][1] == 0, outcomes
        assert len(outcomes) > 3, f"the sweep never ran out of space: {outcomes}"
        assert not any(pyc.exists() for pyc in pycs)
        assert not (site / "vllm/.k3patch/journal.json").exists()
        status = run_cli("status", "--quiet", "--vllm", str(site))
        assert status.returncode == 0, status.stdout
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# -- status and a live apply -------------------------------------------------------------------

PAUSED_APPLY = """
import os, sys, time
from k3patch import engine
from k3patch.tree import locate
site, paused, go_on = sys.argv[1:]
def hook(step):
    if step == "replaced:_aiter_ops.py":  # one file written, the other not yet
        open(paused, "w").close()
        while not os.path.exists(go_on):
            time.sleep(0.01)
engine.apply(locate(site), fault=hook)
"""


def test_status_during_a_live_apply_reports_what_that_apply_left(make_tree, tmp_path):
    """An apply holds the lock and has written one of its two files; a status started now
    reads only after that apply is done: every patch applied, the final digest. On main it read
    both files first (one patched, one not), then found the journal and waited, and reported
    what it had read: one patch applied, one pending, a digest of no committed state."""
    site = make_tree("0.31.0")
    paused, go_on = tmp_path / "paused", tmp_path / "go-on"
    writer = subprocess.Popen(
        [sys.executable, "-c", PAUSED_APPLY, str(site), str(paused), str(go_on)]
    )
    try:
        deadline = time.monotonic() + 120
        while not paused.exists():
            assert writer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        env = {**os.environ, "NO_COLOR": "1"}
        status = subprocess.Popen(
            [sys.executable, "-m", "k3patch", "status", "--json", "--vllm", str(site)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        time.sleep(3)  # status is well into its run: a status that took no lock has read both files
        go_on.touch()
        out, _ = status.communicate(timeout=120)
        assert writer.wait(timeout=120) == 0
    finally:
        go_on.touch()
        writer.kill()
    data = json.loads(out)
    verdicts = {p["id"]: p["verdict"] for p in data["patches"]}
    assert verdicts["aiter-mla-gfx942"] == "applied", verdicts
    assert verdicts["moriio-chunk-gate"] == "applied", verdicts
    assert data["exit_code"] == 0 and data["interrupted"] is None
    final = run_cli("status", "--digest", "--vllm", str(site)).stdout.strip()
    assert data["digest"] == final


# -- A hand edit under a re-apply ----------------------------------------------------------------


def test_a_re_apply_over_a_hand_edit_records_the_file_as_it_is_now(make_tree):
    """An operator adds a line to a patched file and puts one gate back: revert refuses (the
    file is neither k3patch's nor the original). apply re-patches the gate; a later revert
    gives back the file as the operator left it (their line kept, the gate as they put it), not
    the wheel's original. On main that revert deleted the operator's line, exit 0."""
    site = make_tree("0.31.0")
    target = site / "vllm" / CONNECTOR
    original = target.read_text()
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    patched = target.read_text()
    # The operator's edit: the last gate put back as the wheel has it, and a line added.
    a, b = original.splitlines(keepends=True), patched.splitlines(keepends=True)
    matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
    _, i1, i2, j1, j2 = [op for op in matcher.get_opcodes() if op[0] != "equal"][-1]
    hand = "".join(b[:j1] + a[i1:i2] + b[j2:]) + "# operator: keep this line\n"
    target.write_text(hand)
    assert run_cli("status", "--quiet", "--vllm", str(site)).returncode == 1  # a gate pending
    refused = run_cli("revert", "--vllm", str(site))
    assert refused.returncode == 1 and target.read_text() == hand
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    assert target.read_text() == patched + "# operator: keep this line\n"
    back = run_cli("revert", "--vllm", str(site))
    assert back.returncode == 0, back.stdout + back.stderr
    assert target.read_text() == hand, "revert lost the operator's edit"
    assert (
        hashlib.sha256((site / "vllm" / AITER).read_bytes()).hexdigest()
        == hashlib.sha256((make_tree("0.31.0") / "vllm" / AITER).read_bytes()).hexdigest()
    )


# -- The tree's owner, whoever runs k3patch ------------------------------------------------------


@ROOT_ONLY
def test_root_applying_on_a_users_tree_leaves_the_state_to_its_owner(make_tree):
    """sudo on a user's venv: `.k3patch` and every file in it belong to the tree's owner, who
    can then revert and apply again. On main they were root's and the owner got exit 3."""
    with shared_site(make_tree) as site:
        for path in [site, *site.rglob("*")]:
            os.chown(path, 65534, 65534, follow_symlinks=False)
        pristine = tree_hashes(site)
        assert run_cli("apply", "--vllm", str(site)).returncode == 0  # as root
        state = site / "vllm" / ".k3patch"
        owners = {(p.stat().st_uid, p.stat().st_gid) for p in [state, *state.rglob("*")]}
        assert owners == {(65534, 65534)}, owners
        for args in (["revert"], ["apply"], ["revert"]):
            code, stdout, stderr = run_as_nobody([*args, "--vllm", str(site)])
            assert code == 0, (args, stdout, stderr)
        assert tree_hashes(site) == pristine


@ROOT_ONLY
def test_an_owner_outside_the_files_group_applies_with_one_warning(make_tree):
    """`chown -R user` leaves group root: the owner may replace those files (pip or an editor
    would), only not keep group root. apply and revert succeed, each says so in one warning
    line on stderr. On main the owner could not apply at all (exit 3)."""
    with shared_site(make_tree) as site:
        for path in [site, *site.rglob("*")]:
            os.chown(path, 65534, 0, follow_symlinks=False)
        pristine = tree_hashes(site)
        code, stdout, stderr = run_as_nobody(["apply", "--vllm", str(site)])
        assert code == 0, (stdout, stderr)
        assert len(stderr.splitlines()) == 1, stderr
        (warning,) = stderr.splitlines()
        assert warning.startswith("k3patch: warning:") and "group 0" in warning, stderr
        assert (site / "vllm" / AITER).stat().st_gid == 65534
        code, stdout, stderr = run_as_nobody(["revert", "--vllm", str(site)])
        assert code == 0, (stdout, stderr)
        assert tree_hashes(site) == pristine


# -- Litter that outlived its journal -----------------------------------------------------------


@pytest.mark.parametrize("command", ["apply", "revert"])
def test_a_temp_file_beside_a_target_without_a_journal_is_removed(make_tree, command):
    """A run that died (or whose unlink failed) after its journal was gone left the old file's
    copy beside the target: the next locked run removes it, journal or not, never only in the
    directories a journal names (without one, the copy would stay for good)."""
    site = make_tree("0.31.0")
    if command == "revert":
        assert run_cli("apply", "--vllm", str(site)).returncode == 0
    litter = [
        site / "vllm" / "._aiter_ops.py.k3patch-tmp.0123456789abcdef",
        site / "vllm" / os.path.dirname(CONNECTOR) / ".moriio_connector.py.k3patch-tmp.00ff",
    ]
    for path in litter:
        path.write_bytes(b"a copy of an old file")
    proc = run_cli(command, "--vllm", str(site))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not [p for p in litter if p.exists()]
    assert not [p for p in site.rglob("*") if ".k3patch-tmp." in p.name]


# -- A replacement whose rename or close fails ---------------------------------------------------


@pytest.mark.parametrize("call", ["os.replace", "os.close"])
def test_a_failed_rename_or_close_leaves_no_temp_file(make_tree, monkeypatch, call):
    """ENOSPC from the rename of a saved copy into place, or EIO from closing a temp file (NFS
    reports a failed write there): exit 3 (an environment problem), the tree whole, and not
    one temp file left, the run's own included."""
    import errno

    from k3patch import engine
    from k3patch.errors import EnvironmentProblem
    from k3patch.tree import locate

    site = make_tree("0.31.0")
    before = tree_hashes(site)
    real_replace, real_open, real_close = os.replace, os.open, os.close
    temps: set[int] = set()

    def failing_replace(src, dst, *args, **kwargs):
        if ".k3patch-tmp." in str(src) and len(os.path.basename(str(dst))) == 64:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst, *args, **kwargs)

    def tracking_open(path, flags, mode=0o777, *, dir_fd=None):
        fd = real_open(path, flags, mode, dir_fd=dir_fd)
        if ".k3patch-tmp." in str(path):
            temps.add(fd)
        return fd

    def failing_close(fd):
        real_close(fd)
        if fd in temps:
            temps.discard(fd)
            raise OSError(errno.EIO, "Input/output error")

    if call == "os.replace":
        monkeypatch.setattr(os, "replace", failing_replace)
    else:
        monkeypatch.setattr(os, "open", tracking_open)
        monkeypatch.setattr(os, "close", failing_close)
    with pytest.raises(EnvironmentProblem):
        engine.apply(locate(site))
    monkeypatch.undo()
    assert not [p for p in site.rglob("*") if ".k3patch-tmp." in p.name]
    assert tree_hashes(site) == before
    assert not (site / "vllm/.k3patch").exists()


# -- An I/O error while finding the tree ---------------------------------------------------------


@ROOT_ONLY
def test_a_tree_this_user_may_not_search_is_an_environment_problem_not_a_wrong_path(make_tree):
    """`os.path.exists` and friends turn every failure into False: a directory this user may not
    search read as "not a vLLM tree" (exit 2, usage). It is permission denied (exit 3)."""
    with shared_site(make_tree) as site:
        os.chmod(site, 0o700)  # root's: nobody may not look inside
        for args in (["status"], ["apply"], ["revert"]):
            code, stdout, stderr = run_as_nobody([*args, "--vllm", str(site)])
            assert code == 3, (args, stdout, stderr)
            assert len(stderr.splitlines()) == 1 and "permission denied" in stderr, stderr


# -- A rollback on a full disk where fsync fails too ---------------------------------------------


def test_a_rollback_whose_fsyncs_fail_puts_back_every_file(make_tree, monkeypatch):
    """The disk fills up at the record's temp file, the last of the commit, and from then on
    every fsync fails too (ext4 reports a full disk there). Every file already replaced is put
    back all the same (a rename each), never left one patch applied and one not by the first
    failed fsync; the next run, with space, ends in the applied tree."""
    import errno

    from k3patch import engine
    from k3patch.errors import EnvironmentProblem
    from k3patch.tree import locate

    site = make_tree("0.31.0")
    sources = {k: v for k, v in tree_hashes(site).items() if "/.k3patch/" not in k}
    real_open, real_fsync = os.open, os.fsync
    full = []

    def open_on_a_full_disk(path, flags, mode=0o777, *, dir_fd=None):
        if ".state.json.k3patch-tmp." in str(path):
            full.append(True)
        if full and flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def fsync_on_a_full_disk(fd):
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "open", open_on_a_full_disk)
    monkeypatch.setattr(os, "fsync", fsync_on_a_full_disk)
    with pytest.raises(EnvironmentProblem):
        engine.apply(locate(site))
    monkeypatch.undo()
    assert full, "the fault never fired"
    now = {k: v for k, v in tree_hashes(site).items() if "/.k3patch/" not in k}
    assert now == sources, "the rollback stopped half way"
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    assert not [p for p in site.rglob("*") if ".k3patch-tmp." in p.name]
    assert run_cli("status", "--quiet", "--vllm", str(site)).returncode == 0
