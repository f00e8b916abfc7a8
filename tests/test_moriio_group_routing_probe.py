"""moriio-group-routing's probe on the operators' real trees: the 0.28.0 wheel plus the recipe's
older scripts (tests/forktree), driven in the tree's own interpreter.

The probe drives the fork's real scheduler, notify message, RemoteAllocInfo, worker maps and
transfer plan on CPU with K3's layout (KDA groups 0-2, MLA group 3) over a 1-chunk and a
3-chunk prefill. Block ids name their owner: prefill block 100 * (group + 1) + chunk, decode
block 1000 more. A probe counts only if it fails on the unpatched code, so each fork tree's
defect is pinned here by the blocks the probe names:
- (a) the fork's [0]/[1] choice: MLA layers write group 0's blocks (a KDA group), KDA layers
  group 1's;
- (c) the older group-routing fix alone: per-group lists captured at chunk 1 only (chunks 2-3 of
  MLA never sent), and the geometry-keyed offsets cache of 0.28.0: KDA groups 1 and 2 reuse
  group 0's offsets;
- (d) with its chunked companion and the chunk-gate fix: the offsets cache defect alone.
After `k3patch apply`, `verify` runs the probe and it passes on each; upstream 0.31.0 and 0.33.0
route natively (satisfied) and pass too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import probe_child
import pytest
from conftest import run_cli
from k3patch.patches.moriio_group_routing import PATCH

pytestmark = pytest.mark.verify
ONLY = ["--only", "moriio-group-routing"]


def run_probe(python: str, site: Path) -> dict[str, Any]:
    return probe_child.run_probe(PATCH, python, site)


def verify_json(python: str, site: Path) -> tuple[int, dict[str, Any]]:
    proc = run_cli("verify", "--vllm", str(site), "--python", python, "--json", *ONLY)
    assert proc.stdout, proc.stderr
    check: dict[str, Any] = json.loads(proc.stdout)["verify"]["patches"][0]
    return proc.returncode, check


def lines(probe: dict[str, Any], prefix: str) -> list[str]:
    return [c for c in probe["checks"] if c.startswith(prefix)]


# --------------------------------------------------------------------------------------------
# The unpatched fork trees: the probe fails and names the misrouted layers and blocks.


def test_the_fork_pre_image_writes_mla_into_a_kda_groups_blocks(fork_tree, verify_python):
    probe = run_probe(verify_python, fork_tree("a", full=True))
    assert probe["ok"] is False
    summary = probe["summary"]
    # MLA (group 3) into group 0's blocks on both nodes; KDA group 0 into group 1's.
    assert "model.layers.3.mla (MLA group 3): local [101] -> remote [1101]" in summary
    assert "group(s) 0's blocks; expected local [401] -> remote [1401]" in summary
    assert (
        "model.layers.0.kda (KDA group 0): local [201] -> remote [1201], group(s) 1's blocks; "
        "expected local [101] -> remote [1101]"
    ) in summary
    assert "K3, 1 chunk: 6 of 8 layers misrouted, in group(s) 0, 2, 3: " in summary
    # KDA group 1's own layers happen to be right: [1] is group 1.
    assert (
        "K3, 1 chunk @chunk 1: model.layers.1.kda (KDA group 1): local [201] -> remote [1201] "
        "(offsets reused from model.layers.0.kda)"
    ) in probe["checks"]
    # The fork's block-count gate counts group 0, a KDA group that never grows: the 3-chunk
    # save never leaves (moriio-chunk-gate's defect), reported, not blamed on routing.
    assert any(c.startswith("K3, 3 chunks: not exercised") for c in probe["checks"])
    assert (
        "K3, 3 chunks: prefill chunk 1 (16 tokens, blocks [[101], [201], [301], [401]]): held; "
        "chunk 2 (16 tokens, blocks [[], [], [], [402]]): held; "
        "chunk 3 (8 tokens, blocks [[], [], [], [403]]): held"
    ) in probe["checks"]
    # Two groups: the fork was right, and the probe says so.
    assert lines(probe, "two-group") and not lines(probe, "FAIL two-group")


def test_the_older_fix_alone_never_sends_later_chunks(fork_tree, verify_python):
    probe = run_probe(verify_python, fork_tree("c", full=True))
    assert probe["ok"] is False
    # Captured at chunk 1, never grown: MLA's blocks of chunks 2 and 3 are left out.
    assert (
        "FAIL K3, 3 chunks, every group grows: model.layers.3.mla (MLA group 3): local [401] -> "
        "remote [1401, 1402, 1403], "
        "its prefill blocks of chunk(s) [2, 3] left out; "
        "expected local [401, 402, 403] -> remote [1401, 1402, 1403]"
    ) in probe["checks"]
    # It also reaches two-group models (their lists are filled too), which the fork got right.
    assert (
        "FAIL two-group, 3 chunks: model.layers.0.attn (attention group 0): local [101] -> "
        "remote [1101, 1102, 1103], "
        "its prefill blocks of chunk(s) [2, 3] left out; "
        "expected local [101, 102, 103] -> remote [1101, 1102, 1103]"
    ) in probe["checks"]
    # The per-group choice sits inside 0.28.0's geometry-keyed offsets cache.
    assert (
        "K3, 1 chunk: 4 of 8 layers misrouted, in group(s) 1, 2: model.layers.1.kda (KDA group 1): "
        "local [101] -> "
        "remote [1101] (offsets reused from model.layers.0.kda), group(s) 0's blocks; "
        "expected local [201] -> remote [1201]"
    ) in probe["summary"]


def test_the_older_fix_with_its_companions_still_shares_kda_offsets(fork_tree, verify_python):
    probe = run_probe(verify_python, fork_tree("d", full=True))
    assert probe["ok"] is False
    failed = [f for f in lines(probe, "FAIL ") if "without the fix" not in f]
    # Only KDA groups 1 and 2 (every layer, every case), from group 0's cached offsets.
    assert {f.split(": ", 1)[1].split(" (")[0] for f in failed} == {
        "model.layers.1.kda",
        "model.layers.5.kda",
        "model.layers.2.kda",
        "model.layers.6.kda",
    }
    assert all("(offsets reused from model.layers.0.kda), group(s) 0's blocks" in f for f in failed)
    assert (
        "K3, 3 chunks, every group grows: 4 of 8 layers misrouted, in group(s) 1, 2: "
        "model.layers.1.kda (KDA group 1): local [101, 102, 103] -> remote [1101, 1102, 1103] "
        "(offsets reused from model.layers.0.kda), group(s) 0's blocks; "
        "expected local [201, 202, 203] -> remote [1201, 1202, 1203]"
    ) in probe["summary"]
    # A decode node without the fix: the older fix falls back to [0]/[1] without a word.
    assert (
        "FAIL K3, 1 chunk, decode node without the fix: model.layers.3.mla (MLA group 3): "
        "local [101] -> remote [1101], silently group(s) 0's blocks; "
        "expected local [401] -> remote [1401] or a refusal"
    ) in probe["checks"]
    # Its chunk-gate fix lets the K3 3-chunk save leave at the final chunk, MLA complete.
    assert (
        "K3, 3 chunks @chunk 3: model.layers.7.mla (MLA group 3): local [401, 402, 403] -> "
        "remote [1401, 1402, 1403] (offsets reused from model.layers.3.mla)"
    ) in probe["checks"]


# --------------------------------------------------------------------------------------------
# After `k3patch apply`: verify runs the probe and it passes, on every fork tree.


@pytest.mark.parametrize("name", ["a", "c", "d"])
def test_verify_passes_the_probe_after_apply(fork_tree, verify_python, name):
    site = fork_tree(name, full=True)
    applied = run_cli("apply", "--vllm", str(site))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    rc, check = verify_json(verify_python, site)
    assert rc == 0, check
    assert check["verdict"] == "applied"
    assert [m["status"] for m in check["modules"]] == ["ok", "ok", "ok"]
    assert check["probe"]["ran"] and check["probe"]["ok"], check["probe"]["summary"]
    checks = check["probe"]["checks"]
    assert not [c for c in checks if c.startswith("FAIL")]
    # Every chunk's blocks, each KDA group its own, also where the cache used to share them.
    for line in (
        "K3, 3 chunks @chunk 3: model.layers.7.mla (MLA group 3): "
        "local [401, 402, 403] -> remote [1401, 1402, 1403]",
        "K3, 3 chunks @chunk 3: model.layers.5.kda (KDA group 1): local [201] -> remote [1201]",
        "K3, 3 chunks, every group grows @chunk 3: model.layers.6.kda (KDA group 2): "
        "local [301, 302, 303] -> remote [1301, 1302, 1303]",
    ):
        assert any(c.startswith(line) for c in checks), line
    # A decode node without the fix: every K3 layer refuses the transfer, none guesses.
    refused = lines(check["probe"], "K3, 1 chunk, decode node without the fix: model.")
    assert len(refused) == 8 and all(" refused: " in c for c in refused), refused


def routes(probe: dict[str, Any], prefix: str) -> list[str]:
    """The per-layer route lines, without the note on whose offsets call made them (a rewrite
    may key the offsets cache per layer: the same blocks, computed once per layer)."""
    return [c.split(" (offsets reused")[0] for c in lines(probe, prefix) if "@chunk" in c]


def test_a_two_group_model_routes_as_before(fork_tree, verify_python):
    site = fork_tree("a", full=True)
    before = routes(run_probe(verify_python, site), "two-group")
    assert run_cli("apply", "--vllm", str(site)).returncode == 0
    after = routes(run_probe(verify_python, site), "two-group")
    assert len(before) == 8  # 4 layers x (1 chunk, 3 chunks)
    assert after == before
    assert (
        "two-group, 3 chunks @chunk 3: model.layers.2.attn (attention group 0): "
        "local [101, 102, 103] -> remote [1101, 1102, 1103]"
    ) in after


# --------------------------------------------------------------------------------------------
# Upstream routes per group natively (satisfied): verify runs upstream's checks and passes.


@pytest.mark.parametrize("version", ["0.31.0", "0.33.0"])
def test_verify_passes_on_upstream(make_tree, verify_python, version):
    rc, check = verify_json(verify_python, make_tree(version, full=True))
    assert rc == 0, check
    assert check["verdict"] == "satisfied"
    assert check["probe"]["ok"] is True, check["probe"]
    assert (
        "K3: _split_kv_cache_group_kinds -> attention [3], mamba [0, 1, 2]"
        in check["probe"]["checks"]
    )


# --------------------------------------------------------------------------------------------
# Shipped: the probe is a module of the patch's package, imported relatively in the child.


def test_an_installed_k3patch_ships_and_loads_the_probe(
    tmp_path, make_tree, verify_python, k3patch_source
):
    import subprocess

    root = k3patch_source
    target = tmp_path / "k3patch-install"
    pip = [verify_python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile"]
    subprocess.run([*pip, "--target", str(target), str(root)], check=True)
    installed = target / "k3patch" / "patches" / "moriio_group_routing"
    assert (installed / "probe.py").is_file()
    probe = probe_child.run_probe(
        PATCH,
        verify_python,
        make_tree("0.33.0", full=True),
        package_dir=target / "k3patch",
        patches=target / "k3patch" / "patches",
    )
    assert probe["ok"] is True, probe
    assert any(c.startswith("K3 upstream plan: model.layers.6.mla") for c in probe["checks"])
