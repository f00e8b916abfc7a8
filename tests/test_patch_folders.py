"""A patch is one folder: what the folder declares is all the rest of k3patch learns about it.

- `TARGETS` (what the no-op path hashes without importing a patch) is the union of the folders'
  files.txt lists, and the registry refuses a folder whose files.txt and PATCH.files differ;
- the mutation rows are found by folder name (tests/mutation_rows/<folder>.py), every patch has
  them, and the harness derives the test file and the probes it runs with;
- README's patches table is checked (not generated) against the patches found: its third column
  (verdicts over every release) comes from sweeps, not from the folder.

The whole of it on a fifth folder, installed from a wheel: tests/test_fifth_patch.py.
"""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

from k3patch import registry
from k3patch.state import registered_targets

ROOT = Path(__file__).resolve().parent.parent
PATCHES = ROOT / "patches"
sys.path.insert(0, str(ROOT / "benchmarks"))


def folder_of(patch) -> str:
    return type(patch).__module__.rsplit(".", 1)[1]


def test_targets_are_the_union_of_the_folders_files_lists():
    patches = registry.all_patches()
    assert registered_targets() == {rel for p in patches for rel in p.files}
    for patch in patches:
        listed = (PATCHES / folder_of(patch) / "files.txt").read_text().splitlines()
        assert {ln for ln in listed if ln and not ln.startswith("#")} == set(patch.files)


def test_a_new_folder_adds_its_files_and_nothing_else_does(tmp_path):
    (tmp_path / "__init__.py").write_text((PATCHES / "__init__.py").read_text())
    for name, files in {
        "b_patch": "# a comment\nb.py\n\nshared.py\n",
        "a_patch": "shared.py\n",
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
        (tmp_path / name / "files.txt").write_text(files)
    (tmp_path / "no_init").mkdir()  # not a package: not a patch
    (tmp_path / "no_init" / "files.txt").write_text("ignored.py\n")
    (tmp_path / "helpers").mkdir()  # a package without files.txt declares nothing
    (tmp_path / "helpers" / "__init__.py").write_text("")
    got = runpy.run_path(str(tmp_path / "__init__.py"))
    assert got["DECLARED"] == {
        "a_patch": ("shared.py",),
        "b_patch": ("b.py", "shared.py"),
        "helpers": (),
    }
    assert got["TARGETS"] == ("shared.py", "b.py")


def test_the_registry_refuses_a_files_list_that_differs_from_the_patch():
    found = {folder_of(p): p for p in registry.all_patches()}
    declared = {name: patch.files for name, patch in found.items()}
    registry.check_declared(found, declared)
    aiter = found["aiter_mla_gfx942"]
    fewer = {**declared, "aiter_mla_gfx942": ("platforms/rocm.py",)}
    with pytest.raises(registry.PatchSetError, match=r"aiter_mla_gfx942/files.txt: add _aiter_ops"):
        registry.check_declared(found, fewer)
    more = {**declared, "aiter_mla_gfx942": (*aiter.files, "extra.py")}
    with pytest.raises(registry.PatchSetError, match=r"remove extra.py \(its patch reads none\)"):
        registry.check_declared(found, more)
    orphan = {**declared, "stray": ("stray.py",)}
    with pytest.raises(registry.PatchSetError, match=r"patches/stray/files.txt: remove stray.py"):
        registry.check_declared(found, orphan)
    without = {k: v for k, v in declared.items() if k != "aiter_mla_gfx942"}
    with pytest.raises(registry.PatchSetError, match=r"a patch is a folder with a files.txt"):
        registry.check_declared(found, without)


def test_every_patch_has_its_mutation_rows_and_the_harness_derives_the_rest():
    import mutants

    folders = {folder_of(p): p.id for p in registry.all_patches()}
    assert mutants.FOLDERS == {patch_id: folder for folder, patch_id in folders.items()}
    for patch_id, (tests,) in mutants.TESTS.items():
        assert (ROOT / tests).is_file(), f"{patch_id}: no {tests}"
        assert patch_id in mutants.VERIFY_WITH[patch_id]
    # The two MoRIIO patches share moriio_connector.py: their probes run together.
    assert set(mutants.VERIFY_WITH["moriio-chunk-gate"]) == {
        "moriio-chunk-gate",
        "moriio-group-routing",
    }
    assert "moriio-chunk-gate" not in mutants.VERIFY_WITH["aiter-mla-gfx942"]


def readme_patch_ids(text: str) -> list[str]:
    """The ids of README's `## The patches` table, in order."""
    section = re.search(r"^## The patches\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "README has no `## The patches` section"
    return re.findall(r"^\| `([a-z0-9-]+)` \|", section.group(1), re.M)


def test_readme_lists_every_patch_found():
    ids = readme_patch_ids((ROOT / "README.md").read_text(encoding="utf-8"))
    found = [p.id for p in registry.all_patches()]
    missing, extra = sorted(set(found) - set(ids)), sorted(set(ids) - set(found))
    assert not missing, f"add a row for {missing} to README's patches table"
    assert not extra, f"README's patches table lists {extra}, which no folder defines"
    assert len(ids) == len(set(ids))


def test_the_registry_checks_every_folder_when_it_loads(monkeypatch):
    import k3patch.patches as package

    monkeypatch.setitem(package.DECLARED, "aiter_mla_gfx942", ("platforms/rocm.py",))
    registry.all_patches.cache_clear()
    try:
        with pytest.raises(registry.PatchSetError, match=r"aiter_mla_gfx942/files.txt: add _aiter"):
            registry.all_patches()
    finally:
        monkeypatch.undo()
        registry.all_patches.cache_clear()
    assert registry.all_patches()
