"""Defects found by the write-path attack (see FOUND.md on branch attack-wp). Each test fails on
the code it was written against; it passes once the defect is fixed."""

from __future__ import annotations

import hashlib
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


@pytest.mark.xfail(
    strict=True,
    reason="open defect FOUND-4: a saved copy is not tied to the file it belongs to, so a "
    "record with two originals swapped makes revert write each into the other",
)
def test_a_tampered_record_never_makes_revert_write_one_file_into_another(make_tree):
    """FOUND-4: state.json's two `original` hashes swapped (both still name saved copies that
    exist): revert writes moriio_connector.py's original into _aiter_ops.py and the other way
    round, and exits 0 ('restored'). A record whose originals do not belong to their files must
    be refused (exit 3, nothing written)."""
    import json

    site = make_tree("0.31.0")
    proc = run_cli("apply", "--vllm", str(site), "-q")
    assert proc.returncode == 0, proc.stderr
    record = site / "vllm/.k3patch/state.json"
    data = json.loads(record.read_text())
    files = data["files"]
    connector = "distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"
    a, c = files["_aiter_ops.py"], files[connector]
    connector_original = c["original"]
    a["original"], c["original"] = c["original"], a["original"]
    record.write_text(json.dumps(data, indent=1))
    run_cli("revert", "--vllm", str(site))
    assert _h(site / "vllm/_aiter_ops.py") != connector_original, (
        "revert wrote moriio_connector.py's original into _aiter_ops.py"
    )


@pytest.mark.xfail(
    strict=True,
    reason="open defect FOUND-5: a .k3patch that root's killed run left root-owned before its "
    "chown is never handed back to the tree's owner",
)
def test_a_state_dir_left_by_a_root_run_killed_after_mkdir_is_given_to_the_tree_owner(make_tree):
    """FOUND-5 (root only): a root run killed between `mkdir .k3patch` (0700, root) and its
    chown leaves `.k3patch` root-owned; root's next apply (the same user recovering) writes the
    record and saved originals into it as root:root 0600/0700, so the tree's owner can never
    revert or apply again (exit 3) and nobody but root can read the record."""
    import os
    import shutil

    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root")
    site = make_tree("0.31.0")
    for path in [site, *site.rglob("*")]:
        os.lchown(path, 65534, 65534)
    (site / "vllm/.k3patch").mkdir(mode=0o700)  # what the killed root run left
    proc = run_cli("apply", "--vllm", str(site), "-q")
    assert proc.returncode == 0, proc.stderr
    for path in [site / "vllm/.k3patch", site / "vllm/.k3patch/state.json"]:
        st = path.stat()
        assert (st.st_uid, st.st_gid) == (65534, 65534), f"{path} is {st.st_uid}:{st.st_gid}"
    shutil.rmtree(site)
