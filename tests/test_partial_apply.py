"""A drifted patch is refused on its own: nothing of it is written, the other patches are still
applied in the same transaction, apply exits 1 and names it. `--all-or-nothing` writes nothing."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli, sha, slow_after, tree_hashes

AITER = "_aiter_ops.py"
CONNECTOR = "distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"


def drift_aiter(site) -> None:
    target = site / "vllm" / AITER
    target.write_text(
        target.read_text().replace(
            "return cls._AITER_ENABLED and cls._MLA_ENABLED",
            "return cls._AITER_ENABLED or cls._MLA_ENABLED",
        )
    )


def apply_json(site, *args):
    proc = run_cli("apply", "--vllm", str(site), "--json", *args)
    data = json.loads(proc.stdout)
    assert data["exit_code"] == proc.returncode
    return data


def verdicts(site) -> dict[str, str]:
    proc = run_cli("status", "--vllm", str(site), "--json")
    return {p["id"]: p["verdict"] for p in json.loads(proc.stdout)["patches"]}


@pytest.mark.wheel
def test_drifted_patch_does_not_hold_back_the_others(make_tree):
    site = make_tree("0.31.0")
    drift_aiter(site)
    aiter_before = sha(site / "vllm" / AITER)
    connector_before = sha(site / "vllm" / CONNECTOR)
    data = apply_json(site)
    assert data["exit_code"] == 1
    assert data["refused"] is True and data["refused_patches"] == ["aiter-mla-gfx942"]
    assert data["written"] == [f"vllm/{CONNECTOR}"]
    assert sha(site / "vllm" / AITER) == aiter_before  # nothing of the drifted patch
    assert sha(site / "vllm" / CONNECTOR) != connector_before
    after = verdicts(site)
    assert after["aiter-mla-gfx942"] == "drifted"
    assert after["moriio-chunk-gate"] == "applied"
    # A second apply writes nothing more and still names the drifted patch.
    hashes = tree_hashes(site)
    again = apply_json(site)
    assert again["exit_code"] == 1 and again["refused_patches"] == ["aiter-mla-gfx942"]
    assert again["written"] == [] and tree_hashes(site) == hashes
    # Revert restores exactly the tree as it was before apply (the drift included).
    assert run_cli("revert", "--vllm", str(site)).returncode == 0
    assert sha(site / "vllm" / CONNECTOR) == connector_before
    assert sha(site / "vllm" / AITER) == aiter_before


@pytest.mark.wheel
def test_all_or_nothing_writes_nothing_on_drift(make_tree):
    site = make_tree("0.31.0")
    drift_aiter(site)
    before = tree_hashes(site)
    data = apply_json(site, "--all-or-nothing")
    assert data["exit_code"] == 1
    assert data["refused_patches"] == ["aiter-mla-gfx942"] and data["all_or_nothing"] is True
    assert data["written"] == []
    assert tree_hashes(site) == before
    quiet = run_cli("apply", "--vllm", str(site), "--quiet", "--all-or-nothing")
    assert quiet.returncode == 1
    assert "refused: aiter-mla-gfx942 (drifted): nothing was written (--all-or-nothing)" in (
        quiet.stdout
    )
    assert tree_hashes(site) == before


@pytest.mark.wheel
def test_check_mode_names_the_refused_patch_and_what_would_apply(make_tree):
    site = make_tree("0.31.0")
    drift_aiter(site)
    before = tree_hashes(site)
    proc = run_cli("apply", "--vllm", str(site), "--check")
    assert proc.returncode == 1
    assert "aiter-mla-gfx942 (drifted)" in proc.stdout
    assert "would apply: moriio-chunk-gate" in proc.stdout
    assert tree_hashes(site) == before


@pytest.mark.wheel
@pytest.mark.parametrize(
    "select", slow_after([["--only", "moriio-chunk-gate"], ["--skip", "moriio-group-routing"]])
)
def test_a_partial_apply_records_what_the_full_path_reads(fork_tree, select):
    """After `apply --only X`, a left-out patch whose file X rewrote (on fork tree a,
    moriio-group-routing's pending sites in moriio_connector.py, below the chunk gate's) has
    moved: the record must hold its sites as they read now, so the no-op path's answers, line
    numbers included, are the full path's."""
    from k3patch import engine, scan
    from k3patch.registry import select as chosen
    from k3patch.tree import locate

    site = fork_tree("a")
    before = scan.scan(locate(site), use_record=False)
    outcome = engine.apply(
        locate(site),
        chosen(
            select[1::2] if select[0] == "--only" else None,
            select[1::2] if select[0] == "--skip" else None,
        ),
    )
    assert f"{CONNECTOR}" in outcome.written
    recorded = scan.scan(locate(site))
    fresh = scan.scan(locate(site), use_record=False)
    assert recorded.from_record and not fresh.from_record
    assert [r.to_json() for r in recorded.results] == [r.to_json() for r in fresh.results]
    # The left-out patch's sites did move: the old lines would have been wrong.
    moved = {(r.site, r.line) for r in before.for_patch("moriio-group-routing")}
    assert moved != {(r.site, r.line) for r in fresh.for_patch("moriio-group-routing")}
    # And the CLI's no-op path prints what the full path prints.
    for args in (["status", "--json", "--sites"], ["status", "--sites"]):
        fast = run_cli(*args, "--vllm", str(site))
        full = run_cli(*args, "--vllm", str(site), env={"K3PATCH_NO_FASTPATH": "1"})
        assert fast.returncode == full.returncode
        unmark = lambda text: text.replace('"from_record": true', '"from_record": false').replace(  # noqa: E731
            "  (from the state record)", ""
        )
        assert unmark(fast.stdout) == unmark(full.stdout), args
