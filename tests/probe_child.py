"""Run a patch's probe in a tree's interpreter the way `k3patch verify` runs it (the patch
imported as `k3patch.patches.<name>`, a folder patch's probe relatively), whatever the tree's
verdict: verify itself runs probes only for applied or satisfied patches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from k3patch import verify as verify_mod
from k3patch.patch import Patch
from k3patch.registry import patches_dir
from k3patch.tree import locate


def child_args(
    *chosen: Patch, package_dir: Path | None = None, patches: Path | None = None
) -> dict:
    """The verify child's arguments for the `chosen` patches' probes alone (and the modules they
    name); k3patch's modules and the patches from the given directories (default: this
    checkout's)."""
    package_dir = package_dir or Path(verify_mod.__file__).parent
    patches = patches or patches_dir()
    return {
        "package_dir": str(package_dir),
        "patches_dir": str(patches),
        "patch_modules": {patch.id: type(patch).__module__ for patch in chosen},
        "modules": list(dict.fromkeys(m for patch in chosen for m in patch.modules)),
        "probes": [patch.id for patch in chosen],
    }


def run_probe(patch: Patch, python: str, site: Path, **where: Path) -> dict[str, Any]:
    """The probe's result (ok, summary, checks); every module of the patch must import."""
    result = verify_mod._run_child(python, locate(site), child_args(patch, **where))
    assert all(r["ok"] for r in result["imports"].values()), result["imports"]
    probe: dict[str, Any] = result["probes"][patch.id]
    assert "error" not in probe, probe
    return probe
