"""The operators' real trees (tests/forktree: the vLLM 0.28.0 wheel + the recipe's older
scripts' site edits) and the newest vLLM release x the four patches: the verdicts each tree must
give, then the whole cycle (apply exits 0, every patch applied or satisfied after, a second apply
byte-identical, revert byte-identical to the tree as it was before apply)."""

from __future__ import annotations

import json

import pytest
from conftest import NEWEST_RELEASE, run_cli, slow_after, slow_except, tree_hashes

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


# The newest release k3patch knows (conftest.KNOWN_RELEASES), read as a user would meet it:
# upstream fixed the MoRIIO gates (0.32.0) and routes per group natively (0.31.0, WRITE 0.33.0),
# has no KDA diagnostic, and still enables AITER MLA on gfx942. A release the tables do not know
# yet is what `benchmarks/verdict_sweep.py --newest` reports.
RELEASES: dict[str, tuple[dict[str, str], dict[str, tuple[str, ...]]]] = {
    "0.34.0": (
        {AITER: "pending", KDA: "not applicable", GATE: "satisfied", ROUTING: "satisfied"},
        {GATE: ("_is_final_prefill_chunk",), ROUTING: ("layer_to_group",), KDA: ("on device",)},
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
    verdicts_and_cycle(fork_tree(name), name, verdicts, words)


def test_the_newest_release_known_has_its_row():
    assert NEWEST_RELEASE in RELEASES


@pytest.mark.wheel
@pytest.mark.parametrize("version", sorted(RELEASES))
def test_release_verdicts_and_cycle(make_tree, version):
    verdicts, words = RELEASES[version]
    patches = verdicts_and_cycle(make_tree(version), version, verdicts, words)
    # Each shape the release is in was declared as seen in it: no "a known shape, but seen in".
    assert not [s for p in patches.values() for s in p["sites"] if "seen in vLLM" in s["detail"]]


def verdicts_and_cycle(site, name: str, verdicts: dict[str, str], words: dict) -> dict:
    """The tree's verdicts and words, then apply, apply again, revert; the first status's
    patches by id."""
    rc, patches = status(site)
    assert {pid: p["verdict"] for pid, p in patches.items()} == verdicts, name
    assert rc == (1 if "pending" in verdicts.values() else 0)
    for pid, needles in words.items():
        text = words_of(patches[pid])
        for needle in needles:
            assert needle in text, f"{name} {pid}: {needle!r} not in {text!r}"

    before = tree_hashes(site / "vllm")
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rc, applied = status(site)
    assert rc == 0
    for pid, patch in applied.items():
        want = "applied" if verdicts[pid] == "pending" else verdicts[pid]
        assert patch["verdict"] == want, (name, pid, patch["verdict"])

    after = tree_hashes(site / "vllm")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    assert tree_hashes(site / "vllm") == after

    assert run_cli("revert", "--vllm", str(site)).returncode == 0
    assert tree_hashes(site / "vllm") == before
    return patches


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
@pytest.mark.parametrize(
    "spec",
    slow_except(["fork:a", "fork:b", "fork:c", "fork:d", *RELEASES], "fork:a", "fork:d"),
)
def test_verify_runs_every_probe_on_each_applied_real_tree(verified, spec):
    found = verified(spec)
    assert found["apply_rc"] == 0 and found["verify_rc"] == 0, found["output"]
    checked = found["patches"]
    assert set(checked) == {AITER, KDA, GATE, ROUTING}
    for pid, patch in checked.items():
        if patch["verdict"] == "not applicable":  # nothing there to import or probe
            assert not patch["probe"]["ran"], (spec, pid, patch["probe"])
            continue
        assert patch["verdict"] in ("applied", "satisfied"), (spec, pid, patch["verdict"])
        probe = patch["probe"]
        assert probe["ran"] and probe["ok"], (spec, pid, probe)
