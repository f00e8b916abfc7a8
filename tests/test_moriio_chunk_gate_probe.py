"""moriio-chunk-gate's behaviour on the real code, no GPU: the probe drives the real
`build_connector_meta` of a tree (unpatched and patched) with synthetic scheduler steps, in the
verify child (the tree's interpreter, PYTHONPATH = the tree, the patch module loaded by file
path). Unpatched 0.29.0/0.31.0 and the fork send after chunk 1 (the bug); patched, they send
once, at the final chunk; upstream 0.33.0 does too; the older script's slack shows."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES, pristine_tree, run_cli
from k3patch import model
from k3patch import verify as verify_mod
from k3patch.registry import all_patches, patch_module_file
from k3patch.tree import locate

PATCH_ID = "moriio-chunk-gate"
ONLY = ["--only", PATCH_ID]
MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"
K3_BUG = "[k3-2611]: save at chunk 1 of 2, expected chunk 2 only"
K3_FIXED = "[k3-2611]: save at chunk 2 of 2, expected chunk 2 only"
THREE_CHUNKS_FIXED = "[k3-3chunk]: save at chunk 3 of 3, expected chunk 3 only"


def run_probe(python: str, root: Path) -> dict:
    """The probe alone, in the verify child, on whatever code the tree holds."""
    patch = next(p for p in all_patches() if p.id == PATCH_ID)
    result = verify_mod._run_child(
        python,
        locate(root),
        {
            "model": model.__file__,
            "patches": {PATCH_ID: str(patch_module_file(patch))},
            "modules": [MODULE],
            "probes": [PATCH_ID],
        },
    )
    assert result["imports"][MODULE]["ok"], result["imports"][MODULE]
    assert result["imports"][MODULE]["file"].startswith(str(root))
    probe: dict = result["probes"][PATCH_ID]
    return probe


def verify_cli(site: Path, python: str) -> tuple[int, dict]:
    proc = run_cli("verify", "--vllm", str(site), "--python", python, "--json", *ONLY)
    assert proc.stdout, proc.stderr
    return proc.returncode, json.loads(proc.stdout)["verify"]["patches"][0]


@pytest.mark.wheel
@pytest.mark.verify
@pytest.mark.parametrize("version", ["0.29.0", "0.31.0"])
def test_probe_reproduces_the_bug_on_unpatched_code(verify_python, version):
    probe = run_probe(verify_python, pristine_tree(version))
    assert probe["ok"] is False
    assert K3_BUG in probe["summary"]
    assert "[k3-3chunk]: save at chunk 1 of 3, expected chunk 3 only" in probe["summary"]
    # A normal block size was never affected: block count and progress agree there.
    assert any("[small]: save at chunk 3 of 3" in c for c in probe["checks"])


@pytest.mark.wheel
@pytest.mark.verify
@pytest.mark.parametrize("version", ["0.29.0", "0.31.0"])
def test_verify_on_patched_real_tree(make_tree, verify_python, version):
    site = make_tree(version, full=True)
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    code, check = verify_cli(site, verify_python)
    assert code == 0, check
    assert check["verdict"] == "applied"
    assert check["modules"] == [{"module": MODULE, "status": "ok", "reason": "", "decided_by": ""}]
    assert check["probe"]["ok"] is True, check["probe"]["summary"]
    checks = check["probe"]["checks"]
    assert any(K3_FIXED in c for c in checks)
    assert any(THREE_CHUNKS_FIXED in c for c in checks)
    assert any("[k3-2050]: save at chunk 2 of 2" in c for c in checks)
    assert any("[local]: no save in 2 chunks" in c for c in checks)


@pytest.mark.wheel
@pytest.mark.verify
def test_verify_on_upstream_fix(make_tree, verify_python):
    site = make_tree("0.33.0", full=True)
    code, check = verify_cli(site, verify_python)
    assert code == 0, check
    assert check["verdict"] == "satisfied"
    assert check["probe"]["ok"] is True
    assert any(K3_FIXED in c for c in check["probe"]["checks"])


@pytest.mark.wheel
@pytest.mark.verify
def test_probe_on_patched_shape_b(make_tree, verify_python):
    # 0.27.1 (shape B: no skip of unregistered requests) imports on torch 2.13 CPU too.
    site = make_tree("0.27.1", full=True)
    assert run_probe(verify_python, site)["ok"] is False
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    probe = run_probe(verify_python, site)
    assert probe["ok"] is True, probe["summary"]


# The fixtures import with the standard library alone: any interpreter runs their probe.


def test_probe_on_fork_fixture_before_and_after(tmp_path):
    site = tmp_path / "fork"
    shutil.copytree(FIXTURES / "chunk-gate-fork", site)
    before = run_probe(sys.executable, site)
    assert before["ok"] is False
    assert K3_BUG in before["summary"]
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    after = run_probe(sys.executable, site)
    assert after["ok"] is True, after["summary"]
    code, check = verify_cli(site, sys.executable)
    assert code == 0 and check["probe"]["ok"] is True


def test_probe_shows_the_legacy_slack(tmp_path):
    # Satisfied (legacy), and it does send a 2,611-token prompt whole; but its slack of 2
    # sends a prompt whose last chunk is 2 tokens one chunk early.
    site = tmp_path / "legacy"
    shutil.copytree(FIXTURES / "chunk-gate-legacy", site)
    probe = run_probe(sys.executable, site)
    assert probe["ok"] is False
    assert probe["summary"].startswith("wrong in 1 of 6 requests")
    assert "[k3-2050]: save at chunk 1 of 2, expected chunk 2 only" in probe["summary"]
    assert any(K3_FIXED in c for c in probe["checks"])


def test_with_group_routing_on_the_fork(tmp_path):
    # Both MoRIIO patches edit moriio_connector.py (group routing also adds a per-request map
    # to the scheduler and a post-loop block to build_connector_meta): applied together they
    # fold, both read applied, and the chunk gate still sends once, at the final chunk.
    if not any(p.id == "moriio-group-routing" for p in all_patches()):
        pytest.skip("the moriio-group-routing patch is not in this checkout")
    site = tmp_path / "fork"
    shutil.copytree(FIXTURES / "group-routing-fork", site)
    both = ["--only", PATCH_ID, "--only", "moriio-group-routing"]
    assert run_cli("apply", "--vllm", str(site), *both).returncode == 0
    proc = run_cli("status", "--vllm", str(site), "--json", *both)
    assert proc.returncode == 0, proc.stdout
    verdicts = {p["id"]: p["verdict"] for p in json.loads(proc.stdout)["patches"]}
    assert verdicts == {PATCH_ID: "applied", "moriio-group-routing": "applied"}
    probe = run_probe(sys.executable, site)
    assert probe["ok"] is True, probe["summary"]
