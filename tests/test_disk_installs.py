"""What is installed now decides: an upgrade, a reinstall or a hand edit over a patched tree,
an uninstall that left `.k3patch`, several dist-infos beside one package. Revert never puts back
another version's file (it names both hashes instead), and the version is the installed one."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from conftest import pristine_tree, run_cli
from disk_setups import (
    AITER,
    add_dist_info,
    record,
    record_b64,
    source_hashes,
    upgrade,
)

from k3patch import engine, scan
from k3patch.state import (
    registered_targets,
)
from k3patch.tree import TreeError, locate

pytestmark = pytest.mark.wheel


def test_revert_after_an_upgrade_and_a_new_apply_leaves_the_new_version(make_tree):
    """Issue 13 item 1: upgrade or reinstall, then revert."""
    site = make_tree("0.29.0")
    tree = locate(site)
    assert engine.apply(tree).written
    upgrade(site, "0.31.0")
    tree = locate(site)
    engine.apply(tree)
    outcome = engine.revert(tree)
    assert not outcome.conflicts
    new = pristine_tree("0.31.0") / "vllm"
    for rel in registered_targets():
        if (new / rel).exists():
            assert (site / "vllm" / rel).read_bytes() == (new / rel).read_bytes(), rel
    assert not (site / "vllm/.k3patch").exists()


def test_revert_after_an_upgrade_without_a_new_apply_names_both_hashes(make_tree):
    """Issue 13 item 1: upgrade or reinstall, then revert."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    upgrade(site, "0.33.0")
    changed = [rel for rel, fs in record(site)["files"].items()]
    outcome = engine.revert(locate(site))
    # Each file is 0.33.0's now: neither what k3patch wrote nor the recorded original.
    pristine = pristine_tree("0.33.0") / "vllm"
    differing = [r for r in changed if (site / "vllm" / r).read_bytes() != b""]
    assert outcome.conflicts and len(outcome.conflicts) <= len(differing)
    assert all("original" in c and "k3patch wrote" in c for c in outcome.conflicts)
    assert (site / "vllm" / AITER).read_bytes() == (pristine / AITER).read_bytes()


def test_revert_after_a_force_reinstall_is_clean(make_tree):
    """Issue 13 item 1: upgrade or reinstall, then revert."""
    site = make_tree("0.31.0")
    before = source_hashes(site)
    engine.apply(locate(site))
    written = list(record(site)["files"])
    upgrade(site, "0.31.0")  # --force-reinstall: the originals are back
    outcome = engine.revert(locate(site))
    assert not outcome.conflicts and outcome.restored == sorted(written)
    assert source_hashes(site) == before
    assert not (site / "vllm/.k3patch").exists()


def test_a_hand_edit_on_top_of_the_patch_keeps_the_original_recorded(make_tree):
    """Issue 13 item 1: upgrade or reinstall, then revert.

    Not an upgrade: the same install, k3patch's edit still there. The original stays
    recorded, so revert refuses (both hashes named) instead of forgetting the file."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    target = site / "vllm" / AITER
    target.write_bytes(target.read_bytes() + b"# a local note\n")
    engine.apply(locate(site))  # nothing pending: records the classification again
    assert AITER in record(site)["files"]
    edited = target.read_bytes()
    outcome = engine.revert(locate(site))
    assert any(AITER in c and "original" in c for c in outcome.conflicts), outcome
    assert target.read_bytes() == edited


def test_a_state_dir_left_by_an_uninstall_is_exit_3(make_tree):
    """Issue 13 item 1: upgrade or reinstall, then revert."""
    site = make_tree("0.31.0")
    engine.apply(locate(site))
    for entry in (site / "vllm").iterdir():
        if entry.name != ".k3patch":
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    with pytest.raises(TreeError) as info:
        locate(site)
    assert not info.value.usage and "no longer installed" in str(info.value)
    assert run_cli("status", "--vllm", str(site)).returncode == 3


def with_version_py(site: Path, version: str) -> None:
    shutil.copy2(pristine_tree(version) / "vllm" / "_version.py", site / "vllm" / "_version.py")


def test_of_several_dist_infos_the_one_whose_record_owns_the_files_decides(make_tree):
    """Issue 21 part B class 4: the installed version decides."""
    site = make_tree("0.31.0")
    with_version_py(site, "0.31.0")
    add_dist_info(site, "0.31.0", record_from="0.31.0")
    add_dist_info(site, "0.29.0", record_from="0.29.0")  # sorts first; pip --upgrade left it
    tree = locate(site)
    assert tree.version == "0.31.0", tree.version_source
    assert "vllm-0.31.0.dist-info" in tree.version_source
    assert tree.kind == "site-packages"
    # The digest follows the true version: the same as a tree with only the new dist-info.
    alone = make_tree("0.31.0")
    assert scan.scan(tree).digest == scan.scan(locate(alone)).digest


def test_an_older_package_beside_a_newer_dist_info_reads_as_itself(make_tree):
    """Issue 21 part B class 4: the installed version decides."""
    site = make_tree("0.29.0")
    with_version_py(site, "0.29.0")
    add_dist_info(site, "0.29.0", record_from="0.29.0")
    add_dist_info(site, "0.31.0", record_from="0.31.0")
    assert locate(site).version == "0.29.0"


@pytest.mark.parametrize("records", ["none", "both-foreign", "both-own"])
def test_the_version_is_unknown_when_no_record_tells(make_tree, records):
    """Issue 21 part B class 4: the installed version decides."""
    site = make_tree("0.31.0")
    with_version_py(site, "0.31.0")
    if records == "none":
        add_dist_info(site, "0.29.0")
    elif records == "both-foreign":  # neither RECORD lists these bytes (a hand-edited tree)
        add_dist_info(site, "0.31.0", record_from="0.29.0")
        add_dist_info(site, "0.29.0", record_from="0.29.0")
    else:  # two RECORDs that both claim the files: no way to tell
        add_dist_info(site, "0.31.0", record_from="0.31.0")
        add_dist_info(site, "0.29.0", record_from="0.31.0")
    tree = locate(site)
    assert tree.version is None, tree.version_source
    assert tree.version_source.startswith("unknown (2 vllm dist-infos")
    assert tree.kind == "site-packages"
    assert scan.scan(tree).digest != scan.scan(locate(make_tree("0.31.0"))).digest


def test_a_dist_info_record_is_parsed_as_pip_writes_it(make_tree):
    """Issue 21 part B class 4: the installed version decides."""
    site = make_tree("0.31.0")
    dist = add_dist_info(site, "0.31.0")
    init = (site / "vllm" / "__init__.py").read_bytes()
    envs = (site / "vllm" / "envs.py").read_bytes()
    rows = [
        f"vllm/__init__.py,sha256={record_b64(init)},{len(init)}",
        f'"vllm/envs.py",sha256={record_b64(envs)},{len(envs)}',  # csv quoting, as pip may
        "vllm-0.31.0.dist-info/RECORD,,",
    ]
    (dist / "RECORD").write_text("\n".join(rows) + "\n")
    add_dist_info(site, "0.29.0", record_from="0.29.0")
    assert locate(site).version == "0.31.0"
