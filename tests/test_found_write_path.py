"""Defects found by the write-path attack (see FOUND.md on branch attack-wp). Each test fails on
the code it was written against; it passes once the defect is fixed."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from conftest import run_cli

MORIIO = "vllm/distributed/kv_transfer/kv_connector/v1/moriio"
GROUP_ROUTING = [f"{MORIIO}/moriio_common.py", f"{MORIIO}/moriio_engine.py"]


def _h(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _killed_after_every_file_was_replaced(site: Path) -> dict[str, tuple[str, str]]:
    """An apply killed after all its renames (journal still there). Returns, per file of
    moriio-group-routing, (original hash, patched hash)."""
    before = {rel: _h(site / rel) for rel in GROUP_ROUTING}
    proc = run_cli(
        "apply", "--vllm", str(site), "-q", env={"K3PATCH_TEST_CRASH_AT": "kept-removed"}
    )
    assert proc.returncode == 137, proc.stderr
    assert (site / "vllm/.k3patch/journal.json").exists()
    return {rel: (before[rel], _h(site / rel)) for rel in GROUP_ROUTING}


def _assert_whole(site: Path, pairs: dict[str, tuple[str, str]]) -> None:
    now = {rel: _h(site / rel) for rel in pairs}
    all_original = all(now[rel] == pairs[rel][0] for rel in pairs)
    all_patched = all(now[rel] != pairs[rel][0] for rel in pairs)  # patched (maybe + hand edit)
    assert all_original or all_patched, f"moriio-group-routing half-patched: {now}"


def test_recovery_that_fails_on_a_hand_edited_file_leaves_no_half_patched_patch(fork_tree):
    """FOUND-1: recovery rolls the journalled files back one by one and stops at the first one
    that changed (an operator's edit after the crash): the files before it are already back to
    their originals, the rest stay patched, so moriio-group-routing is half applied (common
    original, engine patched) and the run still exits 3 'with nothing written'."""
    site = fork_tree("a")
    pairs = _killed_after_every_file_was_replaced(site)
    engine = site / GROUP_ROUTING[1]
    engine.write_bytes(engine.read_bytes() + b"# operator note\n")
    snapshot = {p: _h(p) for p in (site / "vllm").rglob("*.py")}
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 3
    # An error leaves no change on disk ...
    assert snapshot == {p: _h(p) for p in (site / "vllm").rglob("*.py")}, "error changed files"
    # ... and, in any case, never a half-patched patch.
    _assert_whole(site, pairs)


def test_recovery_that_fails_on_a_missing_saved_copy_leaves_no_half_patched_patch(fork_tree):
    """FOUND-1b: the same with one saved copy (blob) missing: the files journalled before it are
    rolled back, then exit 3 'the saved copy ... is missing'; moriio-group-routing half applied."""
    site = fork_tree("a")
    pairs = _killed_after_every_file_was_replaced(site)
    blob = site / "vllm/.k3patch/blobs" / pairs[GROUP_ROUTING[1]][0]
    blob.unlink()
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 3
    _assert_whole(site, pairs)


def test_a_forged_journal_entry_never_deletes_a_vllm_file(make_tree):
    """FOUND-2: a journal that passes every check (registered target, sha256 hashes) but says a
    target was absent before (`"before": null`, which k3patch itself writes only for its own
    state record) makes recovery delete vLLM's file: apply exits 0 and reports
    aiter-mla-gfx942 `not applicable`. A tampered journal must be refused as damaged (exit 3,
    nothing written), never obeyed."""
    site = make_tree("0.31.0")
    target = site / "vllm/_aiter_ops.py"
    state_dir = site / "vllm/.k3patch"
    state_dir.mkdir()
    entry = {"path": "_aiter_ops.py", "before": None, "after": _h(target)}
    import json

    (state_dir / "journal.json").write_text(
        json.dumps({"op": "apply", "pid": 1, "time": 1.0, "files": [entry]})
    )
    proc = run_cli("apply", "--vllm", str(site), "-q")
    assert target.exists(), f"recovery deleted vllm/_aiter_ops.py (exit {proc.returncode})"
    assert proc.returncode == 3, proc.stdout + proc.stderr


def test_recovery_leaves_no_bytecode_that_runs_other_code_than_the_source(make_tree):
    """FOUND-3: an apply killed after its renames, then an unchecked-hash compile of the patched
    files (a `compileall --invalidation-mode unchecked-hash` image step, before anything ran
    k3patch again), then `revert`: recovery rolls the sources back to the originals (exit 0,
    "recovered: rolled back _aiter_ops.py") but leaves the unchecked-hash pyc of the patched code,
    which Python loads without looking at the source: the reverted tree runs the patched code."""
    import importlib.util
    import py_compile

    site = make_tree("0.31.0")
    proc = run_cli(
        "apply", "--vllm", str(site), "-q", env={"K3PATCH_TEST_CRASH_AT": "kept-removed"}
    )
    assert proc.returncode == 137
    source = site / "vllm/_aiter_ops.py"
    pyc = Path(
        py_compile.compile(
            str(source), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH
        )
    )
    proc = run_cli("revert", "--vllm", str(site))
    assert proc.returncode == 0, proc.stderr
    if pyc.exists():
        data = pyc.read_bytes()
        unchecked = int.from_bytes(data[4:8], "little") == 1
        same = data[8:16] == importlib.util.source_hash(source.read_bytes())
        assert not unchecked or same, "an unchecked-hash pyc of the patched code outlived revert"


CONNECTOR = f"{MORIIO}/moriio_connector.py".removeprefix("vllm/")
COMMON, ENGINE = (rel.removeprefix("vllm/") for rel in GROUP_ROUTING)


def _swap(files: dict, a: str, b: str, key: str) -> None:
    files[a][key], files[b][key] = files[b][key], files[a][key]


def _point(files: dict, a: str, b: str, key: str) -> None:
    files[a][key] = files[b][key]


def _absent(files: dict, a: str, b: str, key: str) -> None:
    files[a][key] = None


# (how, file a, file b, field): a state.json tampered so, on an applied 0.31.0 tree.
TAMPERED_RECORDS = {
    # FOUND-4 itself: two files of two patches swap originals (both saved copies exist).
    "originals swapped across patches": (_swap, "_aiter_ops.py", CONNECTOR, "original"),
    # Two files of one patch (moriio-group-routing, on fork tree "a"), which share names.
    "originals swapped within a patch": (_swap, COMMON, ENGINE, "original"),
    # One file's original pointing at another file's saved copy of the same tree.
    "original of another file": (_point, "_aiter_ops.py", CONNECTOR, "original"),
    "original of another file of the same patch": (_point, ENGINE, COMMON, "original"),
    # An "absent" original, whose revert would delete vLLM's file.
    "original absent": (_absent, "_aiter_ops.py", "", "original"),
    # The hashes of what k3patch wrote swapped: neither file is "what k3patch wrote".
    "applied hashes swapped": (_swap, "_aiter_ops.py", CONNECTOR, "applied"),
}


@pytest.mark.parametrize("case", list(TAMPERED_RECORDS))
def test_a_tampered_record_never_makes_revert_write_one_file_into_another(
    make_tree, fork_tree, case
):
    """FOUND-4: state.json's two `original` hashes swapped (both still name saved copies that
    exist): revert wrote moriio_connector.py's original into _aiter_ops.py and the other way
    round, and exited 0 ('restored'). A record whose originals do not belong to their files is
    refused (exit 3, one line, nothing written); the same for the other tamperings of its kind.
    A record with the applied hashes swapped reads as two files changed since k3patch wrote
    them (exit 1, nothing written)."""
    import json

    how, a, b, key = TAMPERED_RECORDS[case]
    site = fork_tree("a") if ENGINE in (a, b) else make_tree("0.31.0")
    proc = run_cli("apply", "--vllm", str(site), "-q")
    assert proc.returncode == 0, proc.stderr
    record = site / "vllm/.k3patch/state.json"
    data = json.loads(record.read_text())
    how(data["files"], a, b, key)
    record.write_text(json.dumps(data, indent=1))
    snapshot = {p: _h(p) for p in site.rglob("*") if p.is_file()}
    proc = run_cli("revert", "--vllm", str(site))
    assert snapshot == {p: _h(p) for p in site.rglob("*") if p.is_file()}, proc.stdout
    if key == "applied":
        assert proc.returncode == 1, proc.stdout + proc.stderr
        return
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "damaged" in proc.stderr, proc.stderr
    assert "does not belong to its file" in proc.stderr


def test_a_tampered_journal_never_makes_recovery_write_one_file_into_another(fork_tree):
    """FOUND-4, the journal's side: an apply killed after its renames leaves a journal whose
    before-images of moriio_common.py and moriio_engine.py, swapped, would make recovery write
    each file's original into the other. It is refused as damaged (exit 3, nothing written)."""
    import json

    site = fork_tree("a")
    _killed_after_every_file_was_replaced(site)
    journal = site / "vllm/.k3patch/journal.json"
    data = json.loads(journal.read_text())
    entries = {e["path"]: e for e in data["files"]}
    common, engine = entries[COMMON], entries[ENGINE]
    common["before"], engine["before"] = engine["before"], common["before"]
    journal.write_text(json.dumps(data))
    snapshot = {p: _h(p) for p in site.rglob("*") if p.is_file()}
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "damaged" in proc.stderr and "does not belong to its file" in proc.stderr
    assert snapshot == {p: _h(p) for p in site.rglob("*") if p.is_file()}


ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to give files away)")


def _owners(site: Path) -> dict[str, tuple[int, int]]:
    """uid:gid of `.k3patch` and everything in it."""
    state_dir = site / "vllm/.k3patch"
    return {
        p.relative_to(site).as_posix(): (p.lstat().st_uid, p.lstat().st_gid)
        for p in [state_dir, *state_dir.rglob("*")]
    }


@ROOT_ONLY
def test_a_state_dir_left_by_a_root_run_killed_after_mkdir_is_given_to_the_tree_owner(make_tree):
    """FOUND-5 (root only): a root run killed between `mkdir .k3patch` (0700, root) and its
    chown left `.k3patch` root-owned; root's next apply (the same user recovering) wrote the
    record and saved originals into it as root:root 0600/0700, so the tree's owner could never
    revert or apply again (exit 3) and nobody but root could read the record. Now every run
    that can (root) gives `.k3patch` and its files back to the tree's owner, and the owner
    reverts."""
    from disk_setups import run_as_nobody, shared_site

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
    """FOUND-5, the kill itself: root's apply killed right before it gives the new `.k3patch`
    to the tree's owner. No `.k3patch` of root's may be left (it is made under a temp name and
    renamed into place once it is the owner's); the owner's own apply then succeeds, removes
    the temp directory and leaves everything of `.k3patch` the owner's."""
    import subprocess
    import sys

    from disk_setups import run_as_nobody, shared_site

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
