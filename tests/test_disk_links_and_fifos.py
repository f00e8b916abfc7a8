"""No symlink is followed and no FIFO is opened where k3patch reads, writes or deletes: each is
refused (exit 2 for a linked target, 3 otherwise, in one line) before the first write, never
blocked on, and nothing outside the tree changes. The no-op path never vouches for a tree
through one. Anything that could block runs bounded: in a thread joined with a timeout (a FIFO
left blocking is opened for writing afterwards, which frees the thread), or in a subprocess with
a timeout."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, slow_after, tree_hashes
from disk_setups import (
    AITER,
    BOUND,
    FakeVllm,
    add_dist_info,
    bounded,
    fifo_at,
    source_hashes,
)

from k3patch import engine, plugin, replace, scan, state
from k3patch.errors import EnvironmentProblem
from k3patch.state import (
    STATE_FILE,
    registered_targets,
)
from k3patch.transaction import Transaction
from k3patch.tree import TreeError, locate

pytestmark = pytest.mark.wheel
ROCM = "platforms/rocm.py"
PYC = f"__pycache__/_aiter_ops.{sys.implementation.cache_tag}.pyc"
WHERE = ["METADATA", "RECORD", "_version.py", "target", "pyc", "record", "journal"]


def test_blobs_as_a_symlink_is_refused_and_the_linked_dir_untouched(make_tree, tmp_path):
    """Issue 13 item 3: no symlink followed where k3patch writes or deletes."""
    site = make_tree("0.31.0")
    user = tmp_path / "user"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work\n")
    (site / "vllm/.k3patch").mkdir()
    (site / "vllm/.k3patch/blobs").symlink_to(user)
    before = source_hashes(site)
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 3, proc.stderr
    assert sorted(p.name for p in user.iterdir()) == ["thesis.tex"]
    assert source_hashes(site) == before
    assert run_cli("revert", "--vllm", str(site)).returncode in (0, 3)
    assert (user / "thesis.tex").read_text() == "years of work\n"


def test_prune_removes_only_blob_named_regular_files(make_tree, tmp_path):
    """Issue 13 item 3: no symlink followed where k3patch writes or deletes."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    blobs = site / "vllm/.k3patch/blobs"
    (blobs / "notes.txt").write_text("mine\n")
    victim = tmp_path / "victim"
    victim.write_text("x\n")
    (blobs / ("f" * 64)).symlink_to(victim)
    Transaction(site / "vllm").blobs.prune(set())
    assert (blobs / "notes.txt").exists() and victim.exists() and (blobs / ("f" * 64)).is_symlink()


def test_links_at_predictable_temp_names_are_never_written_through(make_tree, tmp_path):
    """Issue 13 item 4: no symlink followed where k3patch writes."""
    site = make_tree("0.31.0")
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    os.chmod(victim, 0o600)
    for rel in registered_targets():
        target = site / "vllm" / rel
        if target.parent.is_dir():
            for pid in range(os.getpid(), os.getpid() + 64):
                (target.parent / f".{target.name}.k3patch-tmp.{pid}").symlink_to(victim)
    assert engine.apply(locate(site)).written
    assert victim.read_text() == "root's file\n" and stat_mode(victim) == 0o600


def test_a_link_at_the_very_temp_name_chosen_is_never_opened(make_tree, tmp_path, monkeypatch):
    """Issue 13 item 4: no symlink followed where k3patch writes.

    Even a guessed name is safe: O_CREAT|O_EXCL|O_NOFOLLOW fails on the link instead of
    writing through it (here every name is the same, so the link is always in the way)."""
    site = make_tree("0.31.0")
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    os.chmod(victim, 0o600)
    monkeypatch.setattr(replace.secrets, "token_hex", lambda n: "0" * 16)
    target = site / "vllm" / AITER
    (target.parent / f".{target.name}.k3patch-tmp.{'0' * 16}").symlink_to(victim)
    before = source_hashes(site)
    with pytest.raises(EnvironmentProblem):
        engine.apply(locate(site))
    assert victim.read_text() == "root's file\n" and stat_mode(victim) == 0o600
    assert {k: v for k, v in source_hashes(site).items() if "k3patch-tmp" not in k} == {
        k: v for k, v in before.items() if "k3patch-tmp" not in k
    }


def stat_mode(path: Path) -> int:
    return os.stat(path).st_mode & 0o7777


@pytest.mark.parametrize("link", ["distributed", "distributed/kv_transfer", ".k3patch"])
def test_a_symlinked_directory_on_the_way_is_refused_before_any_write(make_tree, tmp_path, link):
    """Issue 13 item 6: no symlink followed on the way to a target.

    Refused before the first write: found only when the commit reached the connector, the
    link left `_aiter_ops.py` written and a journal recovery must refuse (it names a path that
    resolves outside the tree), and every later run failed on that journal."""
    site = make_tree("0.31.0")
    elsewhere = tmp_path / "elsewhere"
    real = site / "vllm" / link
    if real.exists():
        shutil.move(real, elsewhere)
    else:
        elsewhere.mkdir()
    real.symlink_to(elsewhere)
    outside, before = tree_hashes(elsewhere), source_hashes(site)
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "symlink" in proc.stderr
    assert tree_hashes(elsewhere) == outside
    assert source_hashes(site) == before
    assert not (site / "vllm" / ".k3patch" / "journal.json").exists()


def test_pycache_symlink_is_refused_before_any_write(make_tree, tmp_path):
    """Issue 13, what to build: the pycache directory."""
    site = make_tree("0.31.0")
    elsewhere = tmp_path / "pyc"
    elsewhere.mkdir()
    (site / "vllm" / "__pycache__").symlink_to(elsewhere)
    before = source_hashes(site)
    with pytest.raises(EnvironmentProblem):
        engine.apply(locate(site))
    assert source_hashes(site) == before and list(elsewhere.iterdir()) == []


def test_a_fifo_target_is_refused_without_hanging(make_tree):
    """Issue 13 item 11: FIFOs."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    target = site / "vllm" / ROCM
    target.unlink()
    os.mkfifo(target)
    # A hang is caught by the timeout below (generous: it is a guard, not a measurement).
    for args in (["status"], ["apply"], ["status", "--quiet"]):
        proc = subprocess.run(
            [sys.executable, "-m", "k3patch", *args, "--vllm", str(site)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 3 and "not a regular file" in proc.stderr, (args, proc.stderr)
    assert plugin.preflight_problem(str(site / "vllm")) is not None


@pytest.mark.parametrize("swap", ["target", "record"])
@pytest.mark.parametrize(
    "kind", slow_after(["symlink to an identical copy", "fifo", "fifo holding the bytes"])
)
def test_the_no_op_path_never_vouches_through_a_link_or_a_fifo(make_tree, tmp_path, swap, kind):
    """Issue 13 item 11: FIFOs.

    A patched target (or the state record) replaced by a symlink to a byte-identical copy
    outside the tree, or by a FIFO (empty, or with the file's own bytes waiting in it): the
    no-op path must not answer from the record (the hash would match through the link or the
    pipe); it answers exactly what the full path answers."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    path = site / "vllm" / (ROCM if swap == "target" else f".k3patch/{STATE_FILE}")
    data = path.read_bytes()
    pipe = None
    if kind.startswith("fifo"):
        path.unlink()
        os.mkfifo(path)
        if kind == "fifo holding the bytes":
            assert len(data) < 65536  # all of it fits in the pipe's buffer
            pipe = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # keeps a writer: no EOF
    else:
        copy = tmp_path / "outside-copy"
        shutil.copy2(path, copy)
        path.unlink()
        path.symlink_to(copy)
    for args in (["status"], ["status", "--quiet"], ["apply", "--quiet"], ["status", "--json"]):
        cmd = [sys.executable, "-m", "k3patch", *args, "--vllm", str(site)]
        if pipe is not None:  # the file's bytes, and only them, wait in the pipe
            try:
                while os.read(pipe, 1 << 16):
                    pass
            except BlockingIOError:
                pass
            assert os.write(pipe, data) == len(data)
        fast = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        env = {**os.environ, "K3PATCH_NO_FASTPATH": "1"}
        full = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert (fast.returncode, fast.stdout, fast.stderr) == (
            full.returncode,
            full.stdout,
            full.stderr,
        ), args
        if swap == "target":  # refused: a link is not patched through (2), a FIFO not read (3)
            assert fast.returncode == (2 if kind.startswith("symlink") else 3), (args, fast)
        elif args[-1] == "--json":  # the tree is read from its code, never from that record
            assert json.loads(fast.stdout)["from_record"] is False, fast.stdout
    if pipe is not None:
        os.close(pipe)


@pytest.mark.parametrize("where", ["vllm-0.31.0.dist-info/METADATA", f"vllm/.k3patch/{STATE_FILE}"])
def test_the_plugin_never_blocks_on_a_fifo(make_tree, monkeypatch, where):
    """Issue 21: the plugin never blocks on a FIFO.

    In a thread joined with a timeout: a blocking open would hang vLLM's start."""
    import threading

    site = make_tree("0.31.0")
    engine.apply(locate(site))
    fifo = site / where
    fifo.unlink()
    os.mkfifo(fifo)
    monkeypatch.setitem(sys.modules, "vllm", FakeVllm(site))
    monkeypatch.setenv(plugin.ENV, "warn")
    thread = threading.Thread(target=plugin.preflight, daemon=True)
    thread.start()
    thread.join(60)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # frees the blocked thread
        thread.join(5)
        pytest.fail(f"the plugin blocked on a FIFO at {where}")
    assert "regular" in (plugin.preflight_problem(str(site / "vllm")) or "")


def plant(site: Path, where: str) -> Path:
    """The tree prepared for a FIFO at `where`, and the FIFO."""
    pkg = site / "vllm"
    if where == "METADATA":
        return fifo_at(site / "vllm-0.31.0.dist-info" / "METADATA")
    if where == "RECORD":  # several dist-infos: the RECORDs decide, and one is a FIFO
        add_dist_info(site, "0.29.0")
        return fifo_at(site / "vllm-0.29.0.dist-info" / "RECORD")
    if where == "_version.py":  # a checkout: no dist-info, the version from _version.py
        shutil.rmtree(site / "vllm-0.31.0.dist-info")
        return fifo_at(pkg / "_version.py")
    if where == "pyc":
        return fifo_at(pkg / PYC)
    engine.apply(locate(site))  # the record, journal and hashed targets of an applied tree
    if where == "target":
        return fifo_at(pkg / AITER)  # a file apply wrote: revert reads it too
    if where == "record":
        return fifo_at(pkg / ".k3patch" / state.STATE_FILE)
    assert where == "journal"
    return fifo_at(pkg / state.JOURNAL_REL)


@pytest.mark.parametrize("where", slow_after(WHERE))
def test_a_fifo_anywhere_k3patch_reads_is_refused_never_blocked_on(make_tree, where):
    """Issue 21 part B class 1: a FIFO at every file k3patch reads.

    In-process: locate, status (scan), apply, revert and the plugin's preflight each refuse
    (TreeError or EnvironmentProblem, or for status a named state problem), within the bound."""
    site = make_tree("0.31.0")
    fifo = plant(site, where)
    pkg = str(site / "vllm")

    def status() -> str | None:
        report = scan.scan(locate(site))
        return report.state_problem

    refusals = []
    for name, call in (
        ("status", status),
        ("apply", lambda: engine.apply(locate(site))),
        ("revert", lambda: engine.revert(locate(site))),
    ):
        try:
            result = bounded(call, [fifo])
        except TreeError as exc:
            assert not exc.usage, (name, exc)
            refusals.append(name)
            continue
        except EnvironmentProblem:
            refusals.append(name)
            continue
        if name == "status" and where == "pyc":
            assert result is None  # status reads no bytecode but a regular file's header
        elif name == "status":
            assert result is not None, f"status on a FIFO {where}: no problem named"
            refusals.append(name)
        elif where == "pyc":
            # A pyc of a file to change is removed before the change, whatever it is: the
            # FIFO is unlinked, never opened; revert then restores the files.
            assert not os.path.lexists(fifo)
            done = result.written if name == "apply" else result.restored
            assert done, (name, result)
        else:
            pytest.fail(f"{name} went on past a FIFO {where}: {result!r}")
    if where == "pyc":
        return
    assert {"status", "apply"} <= set(refusals), refusals
    problem = bounded(lambda: plugin.preflight_problem(pkg), [fifo])
    assert problem is not None and "regular" in problem, problem
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # refused, never replaced or removed


# A pyc FIFO is removed unopened (test_a_fifo_anywhere_k3patch_reads...): no refusal.
@pytest.mark.parametrize("where", slow_after([w for w in WHERE if w != "pyc"]))
def test_the_cli_exits_3_on_a_fifo_with_one_line(make_tree, where):
    """Issue 21 part B class 1: a FIFO at every file k3patch reads."""
    site = make_tree("0.31.0")
    plant(site, where)
    before = tree_hashes(site)
    for args in (["status"], ["apply", "--quiet"]):
        proc = run_cli(*args, "--vllm", str(site), timeout=BOUND * 2)
        assert proc.returncode == 3, (args, proc.stdout, proc.stderr)
        lines = proc.stderr.splitlines()
        assert len(lines) == 1 and "regular" in lines[0], proc.stderr
    assert tree_hashes(site) == before


def test_recovery_of_an_interrupted_apply_never_blocks_on_a_pyc_fifo(make_tree):
    """Issue 21 part B class 1: a FIFO at every file k3patch reads."""
    site = make_tree("0.31.0")
    env = {"K3PATCH_TEST_CRASH_AT": f"replaced:{AITER}"}
    crash = run_cli("apply", "--vllm", str(site), env=env)
    assert crash.returncode == 137
    assert (site / "vllm" / state.JOURNAL_REL).exists()
    fifo = fifo_at(site / "vllm" / PYC)
    outcome = bounded(lambda: engine.apply(locate(site)), [fifo])
    assert outcome.recovered and not (site / "vllm" / state.JOURNAL_REL).exists()
    assert not os.path.lexists(fifo)  # a pyc of the rolled-back file: removed, never opened


def test_bytecode_is_removed_never_compiled_with_a_blocking_open(make_tree, monkeypatch):
    """Issue 21 part B class 1: a FIFO at every file k3patch reads.

    py_compile opens the source with a blocking open(): never used on the tree (the
    bytecode of a changed file is removed, and Python compiles the new source itself)."""
    import py_compile

    site = make_tree("0.31.0")
    pyc = site / "vllm" / PYC
    pyc.parent.mkdir()
    py_compile.compile(
        str(site / "vllm" / AITER),
        cfile=str(pyc),
        invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
    )

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("py_compile.compile used on a tree file")

    monkeypatch.setattr(py_compile, "compile", refuse)
    engine.apply(locate(site))
    assert not pyc.exists()


@pytest.mark.parametrize("applied_first", [False, True], ids=["pending", "applied"])
def test_a_directory_named_like_a_target_is_refused_and_nothing_written(make_tree, applied_first):
    """`vllm/_aiter_ops.py/` a directory (a package dir named like a target file): every command
    refuses it in one line, exit 2 (docs/exit-codes.md), nothing written; a FIFO at a target
    (exit 3) is this file's too."""
    site = make_tree("0.31.0")
    if applied_first:
        assert run_cli("apply", "--vllm", str(site), "-q").returncode == 0
    target = site / "vllm/_aiter_ops.py"
    target.unlink()
    target.mkdir()
    before = tree_hashes(site)
    for command in ("status", "apply", "revert", "verify"):
        proc = run_cli(command, "--vllm", str(site))
        if command == "revert" and not applied_first:
            assert proc.returncode == 0 and "nothing to revert" in proc.stdout, proc.stdout
            continue
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert proc.stderr.splitlines() == [
            f"k3patch: error: {target} is a directory, expected a Python file"
        ], proc.stderr
        assert tree_hashes(site) == before, command


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_a_link_or_fifo_named_like_a_saved_copy_is_named_not_left_quietly(
    make_tree, tmp_path, kind
):
    """An entry planted in `blobs/` under a saved copy's name that is no regular file: k3patch
    never follows, opens or removes it, so a revert cannot remove `.k3patch`. Status said
    nothing and revert exited 0 leaving `blobs/` behind (a false success). Now status, apply
    and revert name it (exit 3, one line) before anything is written; once it is removed,
    revert leaves no `.k3patch`."""
    site = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    planted = site / "vllm/.k3patch/blobs" / ("ab" * 32)
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    if kind == "symlink":
        planted.symlink_to(victim)
    else:
        fifo_at(planted)
    snapshot = tree_hashes(site)
    for command in ("status", "apply", "revert"):
        proc = run_cli(command, "--vllm", str(site), timeout=BOUND)
        assert proc.returncode == 3, (command, proc.stdout, proc.stderr)
        assert len(proc.stderr.splitlines()) == 1 and str(planted) in proc.stderr, proc.stderr
    assert tree_hashes(site) == snapshot and victim.read_text() == "keep me\n"
    assert planted.is_symlink() if kind == "symlink" else stat.S_ISFIFO(planted.lstat().st_mode)
    planted.unlink()
    assert run_cli("revert", "--vllm", str(site)).returncode == 0
    assert not (site / "vllm/.k3patch").exists()
