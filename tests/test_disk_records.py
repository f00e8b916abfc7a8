"""The state record and the journal are input like any other file: a damaged one, one of
another schema, a missing one or one naming paths outside the targets is named (exit 3) and is
never overwritten, pruned, followed out of the tree or taken as a reason to vouch for it; the
plugin warns and never raises on one; a state dir that cannot be used leaves `status` giving
the verdicts from the code."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from typing import Any

import pytest
from conftest import run_cli, sha, slow_after, tree_hashes
from disk_setups import (
    AITER_FILE,
    CONNECTOR,
    CONNECTOR_FILE,
    GROUP_ROUTING,
    FakeVllm,
    apply_killed_at,
    digest,
    killed_after_every_file_was_replaced,
    needs_strace,
    record,
    source_hashes,
    write_record,
)

from k3patch import engine, exitcodes, plugin, registry, safefs, scan, state
from k3patch.errors import EnvironmentProblem
from k3patch.state import (
    STATE_FILE,
    RecordDamaged,
    RecordOtherSchema,
    fresh_record,
    registered_targets,
)
from k3patch.transaction import FileEdit, Transaction
from k3patch.tree import locate

pytestmark = pytest.mark.wheel


@pytest.mark.parametrize(
    "bad", slow_after(["../../outside.py", "/ABS/outside.py", "envs.py", "a/../b.py"])
)
def test_record_paths_outside_the_targets_are_damage(make_tree, tmp_path, bad):
    """Issue 13 item 2: paths in the record and the journal are confined."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    outside = tmp_path / "outside.py"
    outside.write_text("precious\n")
    bad = bad.replace("/ABS", str(tmp_path))
    data = record(site)
    some = next(iter(data["files"].values()))
    data["files"][bad] = {
        "original": some["original"],
        "applied": digest(outside.read_bytes()),
        "patches": [],
    }
    write_record(site, data)
    snapshot = tree_hashes(site)
    proc = run_cli("revert", "--vllm", str(site))
    assert proc.returncode == 3 and "damaged" in proc.stderr, proc.stderr
    assert outside.read_text() == "precious\n"
    assert tree_hashes(site) == snapshot


def test_a_journal_naming_an_absolute_path_is_damage(make_tree, tmp_path):
    """Issue 13 item 2: paths in the record and the journal are confined."""
    site = make_tree("0.31.0")
    victim = tmp_path / "victim.py"
    victim.write_text("keep me\n")
    litter = tmp_path / ".victim.py.k3patch-tmp.1234"
    litter.write_text("keep me too\n")
    (site / "vllm/.k3patch").mkdir()
    journal = {
        "op": "apply",
        "files": [{"path": str(victim), "before": None, "after": digest(victim.read_bytes())}],
    }
    (site / "vllm/.k3patch/journal.json").write_text(json.dumps(journal))
    snapshot = tree_hashes(site)
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 3 and "damaged" in proc.stderr, proc.stderr
    assert victim.read_text() == "keep me\n" and litter.exists()
    assert tree_hashes(site) == snapshot


def test_a_commit_writes_only_registered_targets(make_tree):
    """Issue 13 item 2: paths in the record and the journal are confined.

    The commit itself refuses a path that is not a target (one outside the package dir
    among them), before its journal: no plan can make it write anywhere else."""
    site = make_tree("0.31.0")
    envs = (site / "vllm/envs.py").read_bytes()
    snapshot = tree_hashes(site)
    for edit in (FileEdit("envs.py", envs, b"x = 1\n"), FileEdit("../outside.py", None, b"x\n")):
        with pytest.raises(EnvironmentProblem, match="not a k3patch target"):
            Transaction(site / "vllm").commit([edit], "apply")
    assert tree_hashes(site) == snapshot and not (site / "outside.py").exists()


def test_a_record_with_an_empty_scan_does_not_vouch_for_a_pristine_tree(make_tree):
    """Issue 13 item 12: the no-op path and the plugin check the registry's targets."""
    patched, pristine = make_tree("0.31.0"), make_tree("0.31.0")
    engine.apply(locate(patched))
    data = record(patched)
    data["scan"] = {}
    # With its saved originals: a record naming copies that are gone is refused outright (3).
    shutil.copytree(patched / "vllm/.k3patch/blobs", pristine / "vllm/.k3patch/blobs")
    write_record(pristine, data)
    assert fresh_record(str(pristine / "vllm")) is None
    proc = run_cli("status", "--quiet", "--vllm", str(pristine))
    assert proc.returncode == 1 and "pending" in proc.stdout
    assert plugin.preflight_problem(str(pristine / "vllm")) is not None  # fail mode raises


def test_the_no_op_paths_targets_are_the_patches_files_or_the_registry_refuses():
    """Issue 13 item 12: the no-op path and the plugin check the registry's targets.

    The no-op path hashes `k3patch.patches.TARGETS` without importing a patch; the registry
    holds the patches to it, so a patch whose file the table lacks cannot go unchecked."""
    patches = registry.all_patches()
    assert registered_targets() == {rel for p in patches for rel in p.files}
    fewer = registered_targets() - {"_aiter_ops.py"}
    with pytest.raises(registry.PatchSetError, match=r"add _aiter_ops\.py to it"):
        registry.check_targets(patches, fewer)
    with pytest.raises(registry.PatchSetError, match=r"remove extra\.py from it"):
        registry.check_targets(patches, registered_targets() | {"extra.py"})


@pytest.mark.parametrize(
    "damage",
    slow_after(
        [
            lambda d: {**d, "schema_version": 99},
            lambda d: "truncated",
            lambda d: {**d, "files": {k: {**v, "original": 5} for k, v in d["files"].items()}},
            lambda d: {k: v for k, v in d.items() if k != "results"},
            lambda d: {**d, "results": [{"patch": 1}]},
            lambda d: {
                **d,
                "files": {k: {**v, "original": "../../etc/passwd"} for k, v in d["files"].items()},
            },
        ]
    ),
    ids=["future-schema", "truncated", "mistyped-hash", "missing-field", "bad-result", "blob-path"],
)
def test_a_bad_record_is_never_overwritten_or_pruned(make_tree, damage):
    """Issue 13 item 5: a record absent, damaged or of another schema."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    # A pending change so that apply has work: revert one file by hand to its original.
    data = record(site)
    state = site / "vllm/.k3patch" / STATE_FILE
    bad = damage(data)
    state.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    if isinstance(bad, str):
        state.write_text(json.dumps(data)[:200])
    rel, fs = next(iter(data["files"].items()))
    blob = site / "vllm/.k3patch/blobs" / fs["original"]
    (site / "vllm" / rel).write_bytes(blob.read_bytes())
    snapshot = tree_hashes(site)
    for command in ("apply", "revert"):
        proc = run_cli(command, "--vllm", str(site))
        assert proc.returncode == 3, (command, proc.stdout, proc.stderr)
        assert "schema" in proc.stderr or "damaged" in proc.stderr
        assert tree_hashes(site) == snapshot
    with pytest.raises(RecordDamaged if "schema" not in proc.stderr else RecordOtherSchema):
        engine.revert(locate(site))


def test_revert_without_a_record_keeps_the_saved_originals(make_tree):
    """Issue 13 item 5: a record absent, damaged or of another schema."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    (site / "vllm/.k3patch" / STATE_FILE).unlink()
    snapshot = tree_hashes(site)
    proc = run_cli("revert", "--vllm", str(site))
    assert proc.returncode == 3 and "missing" in proc.stderr
    assert tree_hashes(site) == snapshot


@pytest.mark.parametrize(
    "damage",
    slow_after(
        [
            lambda d: {k: v for k, v in d.items() if k != "results"},
            lambda d: {**d, "results": [{"patch": 3, "verdict": None}]},
            lambda d: {**d, "patches": [None]},
            lambda d: {**d, "scan": []},
        ]
    ),
    ids=["missing", "mistyped-result", "mistyped-patch", "mistyped-scan"],
)
def test_the_plugin_warns_never_raises_on_a_damaged_record(make_tree, monkeypatch, damage):
    """Issue 13 item 10: the plugin never raises."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    write_record(site, damage(record(site)))
    monkeypatch.setitem(sys.modules, "vllm", FakeVllm(site))
    monkeypatch.setenv(plugin.ENV, "warn")
    plugin.preflight()  # must not raise
    monkeypatch.setenv(plugin.ENV, "fail")
    with pytest.raises(plugin.PreflightError):
        plugin.preflight()


def test_the_plugin_survives_an_unexpected_error(make_tree, monkeypatch):
    """Issue 13 item 10: the plugin never raises."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    monkeypatch.setitem(sys.modules, "vllm", FakeVllm(site))
    monkeypatch.setenv(plugin.ENV, "warn")

    def boom(path: str) -> str | None:
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(safefs, "file_sha256", boom)
    monkeypatch.setattr(plugin, "preflight_problem", lambda d: boom(d))
    plugin.preflight()
    monkeypatch.setenv(plugin.ENV, "fail")
    with pytest.raises(plugin.PreflightError):
        plugin.preflight()


@pytest.mark.parametrize(
    "damage",
    slow_after(
        [
            lambda text: text[:200],
            lambda text: json.dumps({**json.loads(text), "scan": []}),
            lambda text: json.dumps({**json.loads(text), "files": {"../../etc/passwd": {}}}),
        ]
    ),
    ids=["truncated", "mistyped-scan", "path-out-of-the-tree"],
)
def test_the_plugin_says_record_damaged_not_that_the_files_differ(make_tree, damage):
    """Issue 21: the plugin names a damaged record."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    path = site / "vllm/.k3patch" / STATE_FILE
    path.write_text(damage(path.read_text()))
    problem = plugin.preflight_problem(str(site / "vllm"))
    assert problem is not None and problem.startswith("record damaged:"), problem
    assert "differ" not in problem and "never applied" not in problem


@pytest.mark.parametrize("odd", ["state-dir-is-a-file", "journal-is-a-dir"])
def test_a_state_dir_that_is_a_file_or_a_journal_that_is_a_dir_is_exit_3(make_tree, odd):
    """Issue 13 item 15: exit codes that do not lie."""
    site = make_tree("0.31.0")
    state_dir = site / "vllm/.k3patch"
    if odd == "state-dir-is-a-file":
        state_dir.write_text("")
    else:
        (state_dir / "journal.json").mkdir(parents=True)
    before = source_hashes(site)
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "internal error" not in proc.stderr
    assert source_hashes(site) == before
    status = run_cli("status", "--vllm", str(site))
    assert status.returncode == 3 and "internal error" not in status.stderr
    # The verdicts still come from the code; the problem is named in one stderr line.
    assert "pending" in status.stdout and len(status.stderr.splitlines()) == 1


@pytest.mark.parametrize("odd", ["a file", "a symlink", "unreadable"])
def test_status_with_an_unusable_state_dir_gives_the_code_verdicts_and_exits_3(
    make_tree, tmp_path, odd, monkeypatch
):
    """Issue 21 part B class 11: status says when apply could not run."""
    site = make_tree("0.31.0")
    state_dir = site / "vllm" / ".k3patch"
    if odd == "a file":
        state_dir.write_text("")
    elif odd == "a symlink":
        (tmp_path / "elsewhere").mkdir()
        state_dir.symlink_to(tmp_path / "elsewhere")
    else:
        engine.apply(locate(site))
    if odd == "unreadable":  # root reads anything: the refusal as the kernel would give it
        real_open = os.open

        def no_access(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            if str(path).endswith(".k3patch") or str(path) == state.STATE_FILE:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_open(path, flags, *args, **kwargs)

        monkeypatch.setattr(os, "open", no_access)
    report = scan.scan(locate(site))
    assert report.state_problem is not None and str(state_dir) in report.state_problem
    want = "applied" if odd == "unreadable" else "pending"
    assert report.verdicts()["aiter-mla-gfx942"].value == want  # from the code

    assert exitcodes.for_status(report) == 3
    with pytest.raises(EnvironmentProblem):
        engine.apply(locate(site))
    if odd == "unreadable":
        return
    proc = run_cli("status", "--vllm", str(site))
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "aiter-mla-gfx942" in proc.stdout and "pending" in proc.stdout
    assert len(proc.stderr.splitlines()) == 1 and str(state_dir) in proc.stderr
    data = json.loads(run_cli("status", "--json", "--vllm", str(site)).stdout)
    assert data["exit_code"] == 3 and str(state_dir) in data["error"]
    assert data["patches"][0]["verdict"] == "pending"


@pytest.mark.parametrize("damage", ["not-json", "empty-object", "path-outside", "blob-missing"])
def test_damaged_record_on_an_applied_tree_is_named_by_status_and_apply(make_tree, damage):
    """Promise (docs/exit-codes.md, 3): "A damaged state record or journal (not JSON, a missing
    or mistyped field, a path that is not a registered target or leaves the package dir)" is
    exit 3; docs/json.md: `status` adds `error` when its record cannot be used, as it exits 3;
    README: the digest tells two nodes apart when their next runs differ.

    On an applied 0.31.0 tree whose record is then damaged, revert rightly refuses (exit 3,
    "state.json is damaged"), so the record cannot be used: status and apply must say so too
    (exit 3, `error`, a digest other than a clean applied tree's), or the entrypoint and the
    Slurm preflight pass a node that cannot be reverted. The same holds when a saved original
    the record names is deleted (revert: "the saved copy ... is missing or damaged", exit 3)."""
    site = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    clean = run_cli("status", "--vllm", str(site), "--digest").stdout.strip()
    record = site / "vllm/.k3patch/state.json"
    if damage == "not-json":
        record.write_text("{garbage")
    elif damage == "empty-object":
        record.write_text("{}")
    elif damage == "blob-missing":
        data = json.loads(record.read_text())
        (site / "vllm/.k3patch/blobs" / data["files"]["_aiter_ops.py"]["original"]).unlink()
    else:
        data = json.loads(record.read_text())
        first = next(iter(data["files"]))
        data["files"]["../../../etc/passwd"] = data["files"].pop(first)
        record.write_text(json.dumps(data))
    damaged = record.read_bytes()
    revert = run_cli("revert", "--vllm", str(site), "--json")
    assert revert.returncode == 3, revert.stderr  # the record cannot be used: documented
    status = run_cli("status", "--vllm", str(site), "--json")
    apply = run_cli("apply", "--vllm", str(site))
    digest = run_cli("status", "--vllm", str(site), "--digest").stdout.strip()
    assert record.read_bytes() == damaged  # nothing rewritten it in between
    assert status.returncode == 3, (status.returncode, status.stderr)
    assert json.loads(status.stdout).get("error"), status.stdout[:300]
    assert apply.returncode == 3, (apply.returncode, apply.stderr)
    assert digest != clean


@needs_strace
def test_a_journal_missing_an_entry_is_not_trusted(make_tree, tmp_path):
    """Promise (docs/how-apply-keeps-a-tree-whole.md, "Nothing on disk is trusted"): a damaged
    journal is exit 3 with nothing written or pruned, saved originals that no record names are
    damaged too; README: revert restores the recorded originals byte for byte.

    An apply is killed after both files were exchanged and before its journal was removed
    (strace kills it at its 7th renameat). A hostile operator deletes the
    moriio_connector.py entry from that journal; the saved original of that file still lies in
    `.k3patch/blobs/`. The next apply must refuse that journal (exit 3), or the end state must
    be byte-exact: never an apply that rolls back `_aiter_ops.py` only and records only it, then
    a revert that exits 0, removes `.k3patch/` with the unnamed saved original in it, and leaves
    moriio_connector.py patched with nothing left to revert it."""
    site = make_tree("0.31.0")
    pristine = {rel: sha(site / rel) for rel in (AITER_FILE, CONNECTOR_FILE)}
    killed = apply_killed_at(site, "renameat", 7)
    assert killed.returncode != 0
    journal = site / "vllm/.k3patch/journal.json"
    data = json.loads(journal.read_text())
    # both exchanged
    assert all(sha(site / rel) != pristine[rel] for rel in (AITER_FILE, CONNECTOR_FILE))
    kept = [f for f in data["files"] if "moriio" not in f["path"]]
    assert len(kept) == len(data["files"]) - 1
    data["files"] = kept
    journal.write_text(json.dumps(data))
    assert (site / "vllm/.k3patch/blobs" / pristine[CONNECTOR_FILE]).is_file()
    apply = run_cli("apply", "--vllm", str(site))
    revert = run_cli("revert", "--vllm", str(site))
    restored = [sha(site / rel) == pristine[rel] for rel in (AITER_FILE, CONNECTOR_FILE)]
    # Either the tampered journal is refused (exit 3) or the end state is byte-exact.
    assert apply.returncode == 3 or (revert.returncode == 0 and all(restored)), (
        apply.returncode,
        revert.returncode,
        restored,
        revert.stdout,
    )


def test_a_record_missing_an_entry_is_not_trusted(make_tree):
    """Promise (docs/how-apply-keeps-a-tree-whole.md): saved originals that no record names
    make the record damaged (exit 3, nothing removed); README: revert restores the recorded
    originals byte for byte, and a tampered record is refused with exit 3.

    On an applied 0.31.0 tree the moriio_connector.py entry is removed from state.json; its
    saved original stays in `.k3patch/blobs/`. revert must refuse (exit 3) or restore both
    files: never exit 0 having restored `_aiter_ops.py` only, removed `.k3patch/` (the unnamed
    saved original with it) and left moriio_connector.py patched with nothing to revert it."""
    site = make_tree("0.31.0")
    pristine = {rel: sha(site / rel) for rel in (AITER_FILE, CONNECTOR_FILE)}
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    record = site / "vllm/.k3patch/state.json"
    data = json.loads(record.read_text())
    dropped = next(k for k in data["files"] if k.endswith("moriio_connector.py"))
    del data["files"][dropped]
    record.write_text(json.dumps(data))
    assert (site / "vllm/.k3patch/blobs" / pristine[CONNECTOR_FILE]).is_file()
    revert = run_cli("revert", "--vllm", str(site))
    restored = [sha(site / rel) == pristine[rel] for rel in (AITER_FILE, CONNECTOR_FILE)]
    assert revert.returncode == 3 or all(restored), (revert.returncode, restored, revert.stdout)


def test_a_forged_journal_entry_never_deletes_a_vllm_file(make_tree):
    """A journal that passes every check (registered target, sha256 hashes) but says a target
    was absent before (`"before": null`, which k3patch itself writes only for its own state
    record) is refused as damaged (exit 3, nothing written), never obeyed: obeyed, recovery
    deletes vLLM's file and apply reports aiter-mla-gfx942 `not applicable`, exit 0."""
    site = make_tree("0.31.0")
    target = site / "vllm/_aiter_ops.py"
    state_dir = site / "vllm/.k3patch"
    state_dir.mkdir()
    entry = {"path": "_aiter_ops.py", "before": None, "after": sha(target)}
    (state_dir / "journal.json").write_text(
        json.dumps({"op": "apply", "pid": 1, "time": 1.0, "files": [entry]})
    )
    proc = run_cli("apply", "--vllm", str(site), "-q")
    assert target.exists(), f"recovery deleted vllm/_aiter_ops.py (exit {proc.returncode})"
    assert proc.returncode == 3, proc.stdout + proc.stderr


COMMON, ENGINE = (rel.removeprefix("vllm/") for rel in GROUP_ROUTING)


def _swap(files: dict, a: str, b: str, key: str) -> None:
    files[a][key], files[b][key] = files[b][key], files[a][key]


def _point(files: dict, a: str, b: str, key: str) -> None:
    files[a][key] = files[b][key]


def _absent(files: dict, a: str, b: str, key: str) -> None:
    files[a][key] = None


# (how, file a, file b, field): a state.json tampered so, on an applied 0.31.0 tree.
TAMPERED_RECORDS = {
    # Two files of two patches swap originals (both saved copies exist).
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
    """A record whose originals do not belong to their files (state.json's two `original`
    hashes swapped, both still naming saved copies that exist, or the other tamperings of its
    kind) is refused (exit 3, one line, nothing written): never a revert that writes
    moriio_connector.py's original into _aiter_ops.py and the other way round, exit 0
    ('restored'). A record with the applied hashes swapped reads as two files changed since
    k3patch wrote them (exit 1, nothing written)."""
    how, a, b, key = TAMPERED_RECORDS[case]
    site = fork_tree("a") if ENGINE in (a, b) else make_tree("0.31.0")
    proc = run_cli("apply", "--vllm", str(site), "-q")
    assert proc.returncode == 0, proc.stderr
    record = site / "vllm/.k3patch/state.json"
    data = json.loads(record.read_text())
    how(data["files"], a, b, key)
    record.write_text(json.dumps(data, indent=1))
    snapshot = {p: sha(p) for p in site.rglob("*") if p.is_file()}
    proc = run_cli("revert", "--vllm", str(site))
    assert snapshot == {p: sha(p) for p in site.rglob("*") if p.is_file()}, proc.stdout
    if key == "applied":
        assert proc.returncode == 1, proc.stdout + proc.stderr
        return
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert len(proc.stderr.splitlines()) == 1 and "damaged" in proc.stderr, proc.stderr
    assert "does not belong to its file" in proc.stderr


def test_a_tampered_journal_never_makes_recovery_write_one_file_into_another(fork_tree):
    """The journal's side: an apply killed after its renames leaves a journal whose
    before-images of moriio_common.py and moriio_engine.py, swapped, would make recovery write
    each file's original into the other. It is refused as damaged (exit 3, nothing written)."""
    site = fork_tree("a")
    killed_after_every_file_was_replaced(site)
    journal = site / "vllm/.k3patch/journal.json"
    data = json.loads(journal.read_text())
    entries = {e["path"]: e for e in data["files"]}
    common, engine_entry = entries[COMMON], entries[ENGINE]
    common["before"], engine_entry["before"] = engine_entry["before"], common["before"]
    journal.write_text(json.dumps(data))
    snapshot = {p: sha(p) for p in site.rglob("*") if p.is_file()}
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "damaged" in proc.stderr and "does not belong to its file" in proc.stderr
    assert snapshot == {p: sha(p) for p in site.rglob("*") if p.is_file()}


@pytest.mark.parametrize("tamper", slow_after(["swapped", "absent", "gone", "link"]))
def test_status_diff_checks_the_originals_as_revert_does(make_tree, tmp_path, tamper):
    """`status --diff` shows the change from the recorded originals: it must trust them no
    more than revert does. Originals swapped between the two files, or one called absent, made
    it print a diff from the wrong file (or from nothing) with exit 0 while revert refused the
    record as damaged; a saved original gone or replaced by a link printed two error lines.
    Each is exit 3, one line on stderr, no diff, nothing changed."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    data = record(site)
    aiter, other = sorted(data["files"])
    blob = site / "vllm/.k3patch/blobs" / data["files"][aiter]["original"]
    if tamper == "swapped":
        files = data["files"]
        files[aiter]["original"], files[other]["original"] = (
            files[other]["original"],
            files[aiter]["original"],
        )
        write_record(site, data)
    elif tamper == "absent":
        data["files"][aiter]["original"] = None
        write_record(site, data)
    else:
        copy = tmp_path / "copy"
        blob.rename(copy)
        if tamper == "link":
            blob.symlink_to(copy)
    snapshot = tree_hashes(site)
    revert = run_cli("revert", "--json", "--vllm", str(site))
    assert revert.returncode == 3, revert.stdout
    for args in ([], ["--json"]):
        proc = run_cli("status", "--diff", "--vllm", str(site), *args)
        assert proc.returncode == 3, (proc.stdout[:300], proc.stderr)
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
        assert "@@" not in proc.stdout and "+++" not in proc.stdout
    assert tree_hashes(site) == snapshot
