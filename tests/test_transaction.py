"""The commit is a transaction: a fault at any step, in-process or a real kill, leaves a tree
that the next apply brings to fully patched and revert to fully original, byte for byte; a
recovery that cannot finish (a file edited since the kill, a saved copy gone) changes nothing and
never leaves a patch half applied."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, sha, slow_after, tree_hashes
from disk_setups import GROUP_ROUTING, killed_after_every_file_was_replaced

from k3patch import engine, scan
from k3patch.errors import EnvironmentProblem
from k3patch.transaction import Transaction
from k3patch.tree import locate

pytestmark = pytest.mark.wheel


def planned_files(version: str = "0.31.0") -> list[str]:
    """The files a full apply writes on a fresh tree (every landed patch that is pending)."""
    from conftest import pristine_tree

    plan = engine.apply(locate(pristine_tree(version)), check=True).plan
    assert plan is not None
    return list(plan.new_texts)


# Every step of a commit, in order; with two or more source files there is a step between
# two file replacements.
STEPS = [
    "blobs-written",
    "journal-written",
    *(f"replaced:{rel}" for rel in planned_files()),
    "replaced:.k3patch/state.json",
    "bytecode-removed",
    "kept-removed",
]


class Boom(Exception):
    pass


def fault_at(step: str):
    def hook(name: str) -> None:
        if name == step:
            raise Boom(step)

    return hook


def sources_only(hashes: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in hashes.items() if "/.k3patch/" not in k}


@pytest.mark.parametrize("step", slow_after(STEPS))
def test_exception_at_each_step_rolls_back(make_tree, step):
    site = make_tree("0.31.0")
    tree = locate(site)
    original = tree_hashes(site)
    with pytest.raises(Boom):
        engine.apply(tree, fault=fault_at(step))
    assert sources_only(tree_hashes(site)) == sources_only(original)
    assert not (tree.state_dir / "journal.json").exists()
    assert not [p for p in site.rglob("*") if ".k3patch-tmp." in p.name]
    # And the next apply completes normally.
    assert engine.apply(tree).written == planned_files()
    assert scan.scan(tree).verdicts()["aiter-mla-gfx942"].value == "applied"


REVERT_STEPS = [
    "blobs-written",
    "journal-written",
    *(f"replaced:{rel}" for rel in planned_files()),
    "bytecode-removed",
    "kept-removed",
]


@pytest.mark.parametrize("step", slow_after(REVERT_STEPS))
def test_exception_at_each_revert_step_rolls_back_to_patched(make_tree, step):
    site = make_tree("0.31.0")
    tree = locate(site)
    engine.apply(tree)
    patched = tree_hashes(site)
    with pytest.raises(Boom):
        engine.revert(tree, fault=fault_at(step))
    assert tree_hashes(site) == patched, "a failed revert must leave the patched tree whole"
    assert not (tree.state_dir / "journal.json").exists()
    # And the next revert completes.
    assert engine.revert(tree).restored == sorted(planned_files())


KILL_STEPS = [*STEPS, "journal-removed"]


@pytest.mark.parametrize("step", slow_after(KILL_STEPS))
def test_kill_at_each_step_then_apply_or_revert(make_tree, step):
    site = make_tree("0.31.0")
    original = tree_hashes(site)
    killed = run_cli("apply", "--vllm", str(site), env={"K3PATCH_TEST_CRASH_AT": step})
    assert killed.returncode == 137

    status = json.loads(run_cli("status", "--vllm", str(site), "--json").stdout)
    # Write-ahead: the journal precedes the blobs; the bytecode goes before the journal.
    journal_left = step not in ("bytecode-removed", "journal-removed")
    assert (status["interrupted"] is not None) == journal_left
    if journal_left:
        assert status["exit_code"] == 1

    # Two copies of the interrupted tree: one goes forward with apply, the other back.
    twin = site.parent / f"{site.name}-twin"
    shutil.copytree(site, twin, symlinks=True)
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    patched = tree_hashes(site)
    reference = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(reference)).returncode == 0
    assert sources_only(patched) == sources_only(tree_hashes(reference))
    assert json.loads(run_cli("status", "--vllm", str(site), "--json").stdout)["exit_code"] == 0

    # Twin B: revert from the same interrupted state returns to the original.
    back = run_cli("revert", "--vllm", str(twin))
    assert back.returncode == 0, back.stderr
    if not journal_left:
        # The commit had finished (or not begun): revert restores the originals, no record.
        assert tree_hashes(twin) == original
    else:
        assert sources_only(tree_hashes(twin)) == sources_only(original)
    assert not [p for p in twin.rglob("*") if ".k3patch-tmp." in p.name]


def test_revert_refuses_when_file_changed_since(make_tree):
    site = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    target = site / "vllm" / "_aiter_ops.py"
    target.write_text(target.read_text() + "\n# edited by hand\n")
    before = tree_hashes(site)
    proc = run_cli("revert", "--vllm", str(site))
    assert proc.returncode == 1
    assert "changed since k3patch applied it" in proc.stdout
    assert tree_hashes(site) == before


def test_revert_refuses_a_tampered_saved_copy(make_tree):
    """A saved original is checked against its name: a blob whose bytes changed is never
    written back into the tree."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    for blob in (site / "vllm/.k3patch/blobs").iterdir():
        blob.write_bytes(b"not the original\n")
    before = tree_hashes(site)
    with pytest.raises(EnvironmentProblem, match="missing or damaged"):
        engine.revert(locate(site))
    assert tree_hashes(site) == before


def test_mode_and_owner_are_kept(make_tree):
    site = make_tree("0.31.0")
    target = site / "vllm" / "_aiter_ops.py"
    os.chmod(target, 0o640)
    if os.geteuid() == 0:
        os.chown(target, 1234, 4321)
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    st = target.stat()
    assert stat.S_IMODE(st.st_mode) == 0o640
    if os.geteuid() == 0:
        assert (st.st_uid, st.st_gid) == (1234, 4321)


def test_concurrent_applies_serialise_one_writer(make_tree):
    site = make_tree("0.31.0")
    n = 32
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "k3patch", "apply", "--vllm", str(site), "--json"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]
    results = [(p.wait(), p.stdout.read()) for p in procs]
    assert all(code == 0 for code, _ in results), results
    writers = [json.loads(out)["written"] for _, out in results]
    assert sum(1 for w in writers if w) == 1, writers
    reference = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(reference)).returncode == 0
    assert sources_only(tree_hashes(site)) == sources_only(tree_hashes(reference))
    assert not [p for p in site.rglob("*") if ".k3patch-tmp." in p.name]


def test_recover_refuses_a_file_changed_by_someone_else(make_tree):
    site = make_tree("0.31.0")
    run_cli("apply", "--vllm", str(site), env={"K3PATCH_TEST_CRASH_AT": "replaced:_aiter_ops.py"})
    target = site / "vllm" / "_aiter_ops.py"
    target.write_text("# someone else\n")
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 3
    assert "changed by something else" in proc.stderr
    assert target.read_text() == "# someone else\n"
    assert Transaction(site / "vllm").pending_journal() is not None


def _assert_whole(site: Path, pairs: dict[str, tuple[str, str]]) -> None:
    now = {rel: sha(site / rel) for rel in pairs}
    all_original = all(now[rel] == pairs[rel][0] for rel in pairs)
    all_patched = all(now[rel] != pairs[rel][0] for rel in pairs)  # patched (maybe + hand edit)
    assert all_original or all_patched, f"moriio-group-routing half-patched: {now}"


def test_recovery_that_fails_on_a_hand_edited_file_leaves_no_half_patched_patch(fork_tree):
    """A killed apply's recovery that meets a journalled file changed since (an operator's edit
    after the crash) exits 3 with nothing written: it checks every file before it puts any
    back, so it never rolls back the files before that one and stops there, leaving
    moriio-group-routing half applied (common original, engine patched)."""
    site = fork_tree("a")
    pairs = killed_after_every_file_was_replaced(site)
    edited = site / GROUP_ROUTING[1]  # moriio_engine.py
    edited.write_bytes(edited.read_bytes() + b"# operator note\n")
    snapshot = {p: sha(p) for p in (site / "vllm").rglob("*.py")}
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 3
    # An error leaves no change on disk ...
    assert snapshot == {p: sha(p) for p in (site / "vllm").rglob("*.py")}, "error changed files"
    # ... and, in any case, never a half-patched patch.
    _assert_whole(site, pairs)


def test_recovery_that_fails_on_a_missing_saved_copy_leaves_no_half_patched_patch(fork_tree):
    """The same with one saved copy (blob) missing: exit 3 ('the saved copy ... is missing'),
    and never the files journalled before it rolled back, moriio-group-routing half applied."""
    site = fork_tree("a")
    pairs = killed_after_every_file_was_replaced(site)
    blob = site / "vllm/.k3patch/blobs" / pairs[GROUP_ROUTING[1]][0]
    blob.unlink()
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 3
    _assert_whole(site, pairs)


def test_a_patched_file_deleted_since_is_a_conflict_named_without_none(make_tree):
    """revert restores only files that still hold what k3patch wrote: a patched file deleted
    since is "changed since" (exit 1, nothing written, the other file not reverted either), and
    the message says it is absent, never a Python `None`; so does the rollback of a journal
    whose file was deleted after the kill (exit 3, nothing rolled back)."""
    site = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    (site / "vllm/_aiter_ops.py").unlink()
    before = tree_hashes(site)
    for args in ([], ["--json"]):
        proc = run_cli("revert", "--vllm", str(site), *args)
        assert proc.returncode == 1, proc.stderr
        assert "vllm/_aiter_ops.py changed since" in proc.stdout and "now absent" in proc.stdout
        assert "None" not in proc.stdout + proc.stderr
        assert tree_hashes(site) == before
    killed = make_tree("0.31.0")
    crash = {"K3PATCH_TEST_CRASH_AT": "replaced:_aiter_ops.py"}
    assert run_cli("apply", "--vllm", str(killed), env=crash).returncode == 137
    (killed / "vllm/_aiter_ops.py").unlink()
    before = tree_hashes(killed)
    proc = run_cli("revert", "--vllm", str(killed))
    assert proc.returncode == 3 and "(now absent, k3patch wrote " in proc.stderr, proc.stderr
    assert "None" not in proc.stdout + proc.stderr and tree_hashes(killed) == before
