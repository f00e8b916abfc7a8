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
from conftest import run_cli, slow_after, tree_hashes
from disk_setups import (
    FakeVllm,
    digest,
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
