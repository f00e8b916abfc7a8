"""What is installed now decides: an upgrade, a reinstall or a hand edit over a patched tree,
an uninstall that left `.k3patch`, several dist-infos beside one package, a build that kept only
bytecode or put an extension module where a target is. Revert never puts back another version's
file (it names both hashes instead), the version is the installed one, and a target is judged by
the file import would load."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import pristine_tree, run_cli
from disk_setups import (
    AITER,
    CONNECTOR,
    add_dist_info,
    preflight_fail,
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


# -- What import loads: a build that kept only bytecode, or an extension named like a target ---

FINDER = (
    "import importlib.machinery as m, sys\n"
    "f = m.FileFinder(sys.argv[1], (m.ExtensionFileLoader, m.EXTENSION_SUFFIXES),"
    " (m.SourceFileLoader, m.SOURCE_SUFFIXES), (m.SourcelessFileLoader, m.BYTECODE_SUFFIXES))\n"
    "s = f.find_spec(sys.argv[2])\n"
    "print(type(s.loader).__name__, s.origin)\n"
)


def import_would_load(pkg: Path, module: str) -> tuple[str, str]:
    """The loader (its class name) and the file that import finds for `module` in `pkg`, as
    the path finder chooses them (by name, before it opens a file)."""
    out = subprocess.run(
        [sys.executable, "-c", FINDER, str(pkg), module], capture_output=True, text=True, check=True
    ).stdout.split(maxsplit=1)
    return out[0], out[1].strip()


def test_a_target_present_only_as_bytecode_is_drifted(make_tree):
    """A pyc-only tree (compileall -b, .py removed) imports the unpatched bytecode: every patch
    whose file is gone is drifted, saying why, in status and apply alike (exit 1), never "not
    applicable" with exit 0; the plugin refuses too."""
    site = make_tree("0.31.0")
    pkg = site / "vllm"
    listed = run_cli("list", "--json")
    files = sorted({f for p in json.loads(listed.stdout)["patches"] for f in p["files"]})
    stripped = []
    for rel in files:
        path = pkg / rel
        if path.is_file():
            subprocess.run([sys.executable, "-m", "compileall", "-q", "-b", str(path)], check=True)
            path.unlink()
            stripped.append(rel)
    assert AITER in stripped and CONNECTOR in stripped
    loader, _ = import_would_load(pkg, "vllm._aiter_ops")
    assert loader == "SourcelessFileLoader", "precondition: import loads the unpatched .pyc"

    status = run_cli("status", "--quiet", "--vllm", str(site))
    apply = run_cli("apply", "--quiet", "--vllm", str(site))
    assert status.returncode != 0 and apply.returncode != 0, (
        f"status rc={status.returncode}: {status.stdout!r}; apply rc={apply.returncode}"
    )
    # The verdict: drifted, saying why, in status and apply alike; the plugin refuses too.
    for proc in (status, apply):
        assert proc.returncode == 1, proc.stderr
        assert "aiter-mla-gfx942: drifted" in proc.stdout, proc.stdout
        text = " ".join(proc.stdout.split())  # the report wraps long lines
        assert "_aiter_ops.py: present only as bytecode (_aiter_ops.pyc" in text, text
    assert preflight_fail(pkg, {}).returncode != 0


@pytest.mark.parametrize("when", ["after apply", "before apply"])
def test_an_extension_module_named_like_a_target_makes_it_drifted(make_tree, when):
    """An extension module named like a target (a Cython/mypyc/Nuitka build that kept the .py)
    is what import loads, so the patched .py never runs; status must not say applied. An
    empty file is enough to show k3patch reads it: the path finder picks ExtensionFileLoader by
    the name's suffix before it opens the file (proven below with FileFinder), so the name alone
    decides which file import would run; what is inside only decides whether it then loads."""
    import importlib.machinery

    site = make_tree("0.31.0")
    pkg = site / "vllm"
    original = (pkg / AITER).read_bytes()
    ext = pkg / ("_aiter_ops" + importlib.machinery.EXTENSION_SUFFIXES[0])
    if when == "after apply":
        assert run_cli("apply", "--quiet", "--vllm", str(site)).returncode == 0
    patched = (pkg / AITER).read_bytes()
    ext.write_bytes(b"")
    _, origin = import_would_load(pkg, "vllm._aiter_ops")
    assert origin == str(ext), "precondition: import would load the extension, not the .py"

    status = run_cli("status", "--quiet", "--vllm", str(site))
    slow = run_cli("status", "--quiet", "--vllm", str(site), env={"K3PATCH_NO_FASTPATH": "1"})
    plugin = preflight_fail(pkg, {})
    apply = run_cli("apply", "--quiet", "--vllm", str(site))
    for proc in (status, slow, apply):
        assert proc.returncode == 1, (proc.args, proc.stdout, proc.stderr)
        assert "aiter-mla-gfx942: drifted" in proc.stdout, proc.stdout
        assert f"compiled extension {ext.name}" in " ".join(proc.stdout.split()), proc.stdout
    assert plugin.returncode != 0, plugin.stderr
    if when == "after apply":  # before it there is no record, which the plugin says first
        assert ext.name in plugin.stderr, plugin.stderr
    # apply refuses that patch: the .py is as it was (never patched over the extension).
    assert (pkg / AITER).read_bytes() == (patched if when == "after apply" else original)
