"""The operators' real trees (tests/forktree: the vLLM 0.28.0 wheel + the recipe's older
scripts' site edits) x the four patches: the verdicts each tree must give, then the whole cycle
(apply exits 0, every patch applied or satisfied after, a second apply byte-identical, revert
byte-identical to the tree as it was before apply)."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli, slow_after, slow_except, tree_hashes

AITER, KDA, GATE, ROUTING = (
    "aiter-mla-gfx942",
    "kda-gather-diagnostic",
    "moriio-chunk-gate",
    "moriio-group-routing",
)
ALL_PENDING = {AITER: "pending", KDA: "pending", GATE: "pending", ROUTING: "pending"}

# tree -> (the verdict of every patch, words each patch's report must carry: the defect named)
EXPECTED: dict[str, tuple[dict[str, str], dict[str, tuple[str, ...]]]] = {
    "a": (ALL_PENDING, {}),
    "b": (ALL_PENDING, {}),
    "a-comments": (ALL_PENDING, {}),
    "a-nodebug": (ALL_PENDING, {}),
    # The older group-routing fix alone: its group lists are captured at the first chunk only.
    "c": (ALL_PENDING, {ROUTING: ("chunk",)}),
    # + the chunked companion, the older chunk-gate fix and the KDA no-sync fix. The chunk gate
    # fires up to K3_CHUNK_GATE_SLACK tokens early and falls back to block counts; the routing
    # fix picks block ids inside the geometry-keyed offsets cache.
    "d": (
        {AITER: "pending", KDA: "satisfied", GATE: "pending", ROUTING: "pending"},
        {GATE: ("SLACK", "block"), ROUTING: ("geometry",), KDA: ("k3-kda-nosync",)},
    ),
}


def status(site) -> tuple[int, dict[str, dict]]:
    proc = run_cli("status", "--vllm", str(site), "--json")
    data = json.loads(proc.stdout)
    return proc.returncode, {p["id"]: p for p in data["patches"]}


def words_of(patch: dict) -> str:
    parts = [patch.get("caveat", "")]
    for s in patch["sites"]:
        parts += [s["shape"], s["detail"]]
    return " ".join(parts)


@pytest.mark.wheel
@pytest.mark.parametrize("name", slow_after(sorted(EXPECTED)))
def test_real_tree_verdicts_and_cycle(fork_tree, name):
    verdicts, words = EXPECTED[name]
    site = fork_tree(name)
    rc, patches = status(site)
    assert {pid: p["verdict"] for pid, p in patches.items()} == verdicts, name
    assert rc == 1
    for pid, needles in words.items():
        text = words_of(patches[pid])
        for needle in needles:
            assert needle in text, f"{name} {pid}: {needle!r} not in {text!r}"

    before = tree_hashes(site / "vllm")
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rc, patches = status(site)
    assert rc == 0
    for pid, patch in patches.items():
        assert patch["verdict"] in ("applied", "satisfied"), (name, pid, patch["verdict"])
        if verdicts[pid] == "pending":
            assert patch["verdict"] == "applied", (name, pid)

    after = tree_hashes(site / "vllm")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    assert tree_hashes(site / "vllm") == after

    assert run_cli("revert", "--vllm", str(site)).returncode == 0
    assert tree_hashes(site / "vllm") == before


@pytest.mark.wheel
def test_entrypoint_warn_mode_starts_vllm_with_the_safe_fixes(fork_tree, tmp_path):
    """One drifted patch on a real tree: in warn mode the entrypoint starts vLLM with the other
    three applied, and its log names the one that is missing."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    site = fork_tree("a")
    aiter = site / "vllm" / "_aiter_ops.py"
    aiter.write_text(
        aiter.read_text().replace(
            "return cls._AITER_ENABLED and cls._MLA_ENABLED",
            "return cls._AITER_ENABLED or cls._MLA_ENABLED",
        )
    )
    bindir = tmp_path / "bin"
    bindir.mkdir()
    started = tmp_path / "vllm-started"
    fake = bindir / "vllm"
    fake.write_text(f'#!/usr/bin/env bash\necho "$@" > {started}\n')
    fake.chmod(0o755)
    python_bin = Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": f"{bindir}:{python_bin}:{os.environ['PATH']}",
        "K3PATCH_ARGS": f"--vllm {site}",
        "K3PATCH_BIN": str(python_bin / "k3patch"),
        "K3PATCH_ON_DRIFT": "warn",
        "NO_COLOR": "1",
    }
    entry = Path(__file__).resolve().parent.parent / "examples" / "entrypoint.sh"
    proc = subprocess.run(
        ["bash", str(entry), "--model", "K3"], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert started.read_text().strip() == "serve --model K3"
    log = proc.stdout + proc.stderr
    assert "aiter-mla-gfx942: drifted" in log
    _, patches = status(site)
    assert patches[AITER]["verdict"] == "drifted"
    for pid in (KDA, GATE, ROUTING):
        assert patches[pid]["verdict"] == "applied", (pid, patches[pid]["verdict"])


@pytest.mark.wheel
@pytest.mark.verify
@pytest.mark.parametrize("name", slow_except(["a", "b", "c", "d"], "a", "d"))
def test_verify_runs_every_probe_on_each_applied_real_tree(verified, name):
    found = verified(f"fork:{name}")
    assert found["apply_rc"] == 0 and found["verify_rc"] == 0, found["output"]
    checked = found["patches"]
    assert set(checked) == {AITER, KDA, GATE, ROUTING}
    for pid, patch in checked.items():
        assert patch["verdict"] in ("applied", "satisfied"), (name, pid, patch["verdict"])
        probe = patch["probe"]
        assert probe["ran"] and probe["ok"], (name, pid, probe)
