"""moriio-chunk-gate's behaviour on the real code, no GPU: the probe drives the real
`build_connector_meta` of a tree (unpatched and patched) with synthetic scheduler steps, then
vLLM's own `Scheduler.schedule()` of the tree with the MoRIIO connector's scheduler side, in the
verify child (the tree's interpreter, PYTHONPATH = the tree, the patch module loaded by file
path). Unpatched 0.28.0-0.31.0 and the fork trees send after chunk 1 (the bug); patched, they
send once, at the final chunk; upstream 0.33.0 does too; the older script's slack shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import pristine_tree, run_cli

from k3patch import verify as verify_mod
from k3patch.registry import all_patches
from k3patch.tree import locate

PATCH_ID = "moriio-chunk-gate"
ONLY = ["--only", PATCH_ID]
MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"
K3_BUG = "[k3-2611]: save at chunk 1 of 2, expected chunk 2 only"
K3_FIXED = "[k3-2611]: save at chunk 2 of 2, expected chunk 2 only"
THREE_CHUNKS_FIXED = "[k3-3chunk]: save at chunk 3 of 3, expected chunk 3 only"


def run_probe(python: str, root: Path) -> dict:
    """The probe alone, in the verify child, on whatever code the tree holds."""
    from probe_child import child_args

    patch = next(p for p in all_patches() if p.id == PATCH_ID)
    args = {**child_args(patch), "modules": [MODULE]}
    result = verify_mod._run_child(python, locate(root), args)
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


# The operators' real trees and vLLM's own Scheduler. Unpatched fork code (shape C gates)
# sends at chunk 1; the older script's real form sends a 2-token last chunk one chunk early
# (its slack); patched, both send once, at the final chunk, also under Scheduler.schedule().

SCHED_BUG = "Scheduler.schedule() [sched-2611]: save at chunk 1 of 2, expected chunk 2 only"
SCHED_FIXED = "Scheduler.schedule() [sched-2611]: save at chunk 2 of 2, expected chunk 2 only"
SCHED_SLACK = "Scheduler.schedule() [sched-2050]: save at chunk 1 of 2, expected chunk 2 only"
NOT_STALE = "(the count before this step's chunk, not stale)"


def _scheduler_lines(probe: dict) -> list[str]:
    return [c for c in probe["checks"] if c.startswith("Scheduler.schedule()")]


def _assert_fixed(probe: dict) -> None:
    assert probe["ok"] is True, probe["summary"]
    lines = _scheduler_lines(probe)
    assert SCHED_FIXED in lines
    assert "Scheduler.schedule() [sched-5000]: save at chunk 3 of 3, expected chunk 3 only" in lines
    assert "Scheduler.schedule() [sched-2050]: save at chunk 2 of 2, expected chunk 2 only" in lines


@pytest.mark.wheel
@pytest.mark.verify
@pytest.mark.parametrize("name", ["a", "c"])
def test_probe_on_fork_tree_before_and_after(fork_tree, verify_python, name):
    site = fork_tree(name, full=True)
    before = run_probe(verify_python, site)
    assert before["ok"] is False
    assert K3_BUG in before["summary"]
    assert SCHED_BUG in before["summary"]
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    _assert_fixed(run_probe(verify_python, site))


@pytest.mark.wheel
@pytest.mark.verify
def test_probe_shows_the_legacy_slack_and_verify_after_repair(fork_tree, verify_python):
    # Tree d: the older script's real form sends a 2,611-token prompt whole, but its slack of
    # 2 sends a prompt whose last chunk is 2 tokens one chunk early, in both probes.
    site = fork_tree("d", full=True)
    probe = run_probe(verify_python, site)
    assert probe["ok"] is False
    assert probe["summary"].startswith("wrong in 2 of 12 checks")
    assert "[k3-2050]: save at chunk 1 of 2, expected chunk 2 only" in probe["summary"]
    assert SCHED_SLACK in probe["summary"]
    assert SCHED_FIXED in probe["checks"]
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    code, check = verify_cli(site, verify_python)
    assert code == 0, check
    assert check["verdict"] == "applied"
    _assert_fixed(check["probe"])


@pytest.mark.wheel
@pytest.mark.verify
def test_scheduler_probe_on_unpatched_and_patched_0_28_0(make_tree, verify_python):
    site = make_tree("0.28.0", full=True)
    before = run_probe(verify_python, site)
    assert SCHED_BUG in before["summary"]
    assert "Scheduler.schedule() [sched-5000]: save at chunk 1 of 3" in before["summary"]
    # The older script's docstring says req.num_computed_tokens is stale (0) inside
    # build_connector_meta; vLLM's own scheduler shows it is the count before the chunk.
    stale = [c for c in before["checks"] if "inside build_connector_meta" in c]
    assert len(stale) == 3 and all(NOT_STALE in c for c in stale), stale
    assert any(
        "(num_prompt_tokens 2611) req.num_computed_tokens = 0, 2048 at chunks 1-2" in c
        for c in stale
    )
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    _assert_fixed(run_probe(verify_python, site))


@pytest.mark.wheel
@pytest.mark.verify
def test_scheduler_probe_on_0_31_0_and_0_33_0(make_tree, verify_python):
    site = make_tree("0.31.0", full=True)
    assert SCHED_BUG in run_probe(verify_python, site)["summary"]
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    _assert_fixed(run_probe(verify_python, site))
    # 0.33.0 carries upstream's fix: it passes unpatched.
    _assert_fixed(run_probe(verify_python, pristine_tree("0.33.0")))


@pytest.mark.wheel
@pytest.mark.verify
def test_with_group_routing_on_the_fork(fork_tree, verify_python):
    # Both MoRIIO patches edit moriio_connector.py: applied together they fold, both read
    # applied, and the chunk gate still sends once, at the final chunk.
    if not any(p.id == "moriio-group-routing" for p in all_patches()):
        pytest.skip("the moriio-group-routing patch is not in this checkout")
    site = fork_tree("a", full=True)
    both = ["--only", PATCH_ID, "--only", "moriio-group-routing"]
    before = json.loads(run_cli("status", "--vllm", str(site), "--json", *both).stdout)
    routing = {p["id"]: p["verdict"] for p in before["patches"]}["moriio-group-routing"]
    if routing != "pending":
        pytest.skip(f"moriio-group-routing reads {routing} on fork tree a (not this patch's)")
    assert run_cli("apply", "--vllm", str(site), *both).returncode == 0
    proc = run_cli("status", "--vllm", str(site), "--json", *both)
    assert proc.returncode == 0, proc.stdout
    verdicts = {p["id"]: p["verdict"] for p in json.loads(proc.stdout)["patches"]}
    assert verdicts == {PATCH_ID: "applied", "moriio-group-routing": "applied"}
    _assert_fixed(run_probe(verify_python, site))


@pytest.mark.wheel
@pytest.mark.verify
def test_mamba_n1_truncation_needs_no_slack(fork_tree, verify_python, monkeypatch):
    # The older chunk-gate script says its slack absorbs mamba_n1's P-side truncation
    # (`request.num_prompt_tokens -= 1`). With the truncation on, the scheduler computes N-1
    # tokens and the gate compares with the truncated count: k3patch's gate still sends once,
    # at the final chunk, and the older form still sends a 2-token last chunk early.
    monkeypatch.setenv("K3_MAMBA_N1_FORCE", "1")
    truncated = "[sched-2050]: inside build_connector_meta (num_prompt_tokens 2049)"
    legacy = fork_tree("d", full=True)
    probe = run_probe(verify_python, legacy)
    assert any(truncated in c for c in probe["checks"]), probe["checks"]
    assert SCHED_SLACK in probe["summary"]
    patched = fork_tree("a", full=True)
    assert run_cli("apply", "--vllm", str(patched), *ONLY).returncode == 0
    probe = run_probe(verify_python, patched)
    assert any(truncated in c for c in probe["checks"]), probe["checks"]
    _assert_fixed(probe)
