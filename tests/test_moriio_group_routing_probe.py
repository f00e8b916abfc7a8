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
route natively (satisfied) and pass too. One child per fork tree and state (`routed`), shared with
the other patches' tests.

Further cases: models without a Mamba group (one attention group; full attention and
sliding window), decode without external tokens, and both schedulers holding nothing of a
request once it finished. Where the unpatched code fails them: two attention groups on every
fork tree (the fork's [0]/[1] choice sends group 1 to group 0's blocks), one attention group over
3 chunks on (c) (the older fix's lists captured at chunk 1). The others are must-not-break cases:
the fork gets them right, and they catch wrong fixes (a per-request entry left after its save,
group 0 used where no group is Mamba, blocks named without external tokens).

The mutation check's survivors added three more, failing on every unpatched
fork tree: a one-sided peer on either side (the decode node without the fix, and a save without
per-group lists, as a prefill scheduler without the fix sends it) must be refused per layer by
the MoRIIOError that names the side without the fix, not by whatever a missing list raises
later (the fork trees write silently into [0]/[1]'s blocks); a layout of Mamba groups only must
be refused at the worker's layer maps with a ValueError (the fork trees build them silently).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import probe_child
import pytest
from conftest import OracleChild, built_fork_tree, run_cli, slow_except
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3patch.patches.moriio_group_routing import PATCH
from k3patch.patches.moriio_group_routing.batches import BATCHES, LAYOUTS, Batch
from k3patch.patches.moriio_group_routing.probe import (
    ATTENTION_LAYOUT,
    CASES,
    KIND_NAMES,
    TWO_ATTENTION_LAYOUT,
)

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


@pytest.fixture(scope="session")
def routed(probed, verified) -> Callable[[str, bool], dict[str, Any]]:
    """routed(name, applied): fork tree `name`'s probe result, unpatched (every patch's probe in
    one child on the cached tree) or applied (`verify --json` on a copy after `k3patch apply`:
    this patch's entry, with verify's `rc`); both shared with the other patches' tests
    (conftest's `probed` and `verified`)."""

    def get(name: str, applied: bool) -> dict[str, Any]:
        if not applied:
            return probed(f"fork:{name}", PATCH.id)
        found = verified(f"fork:{name}")
        assert found["apply_rc"] == 0, found["output"]
        return {"rc": found["verify_rc"], **found["patches"][PATCH.id]}

    return get


# --------------------------------------------------------------------------------------------
# The unpatched fork trees: the probe fails and names the misrouted layers and blocks.


def test_the_fork_pre_image_writes_mla_into_a_kda_groups_blocks(routed):
    probe = routed("a", False)
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


def test_the_older_fix_alone_never_sends_later_chunks(routed):
    probe = routed("c", False)
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


def test_the_older_fix_with_its_companions_still_shares_kda_offsets(routed):
    probe = routed("d", False)
    assert probe["ok"] is False
    failed = [f for f in lines(probe, "FAIL K3") if "without the fix" not in f]
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


@pytest.mark.parametrize("name", slow_except(["a", "c", "d"], "a", "d"))
def test_verify_passes_the_probe_after_apply(routed, name):
    check = routed(name, True)
    assert check["rc"] == 0, check
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
    # A one-sided peer, either side: every K3 layer refuses the transfer, none guesses, with the
    # error that names the side without the fix.
    for side in ("decode node", "prefill scheduler"):
        refused = lines(check["probe"], f"K3, 1 chunk, {side} without the fix: model.")
        named = " refused: MoRIIOError: MoRIIO transfer tx-k3patch-probe: no per-group block ids "
        named += f"from the {side}; both nodes need k3patch moriio-group-routing"
        assert len(refused) == 8 and all(c.endswith(named) for c in refused), refused
    assert ALL_MAMBA_REFUSED in checks


def routes(probe: dict[str, Any], prefix: str) -> list[str]:
    """The per-layer route lines, without the note on whose offsets call made them (a rewrite
    may key the offsets cache per layer: the same blocks, computed once per layer)."""
    return [c.split(" (offsets reused")[0] for c in lines(probe, prefix) if "@chunk" in c]


def test_a_two_group_model_routes_as_before(routed):
    before = routes(routed("a", False), "two-group")
    after = routes(routed("a", True)["probe"], "two-group")
    assert len(before) == 8  # 4 layers x (1 chunk, 3 chunks)
    assert after == before
    assert (
        "two-group, 3 chunks @chunk 3: model.layers.2.attn (attention group 0): "
        "local [101, 102, 103] -> remote [1101, 1102, 1103]"
    ) in after


# --------------------------------------------------------------------------------------------
# Issue 19's cases on every fork tree: failing where the unpatched code misroutes, passing
# applied, asserted over every case of the table.

NEW_CASES = [
    c for c in CASES if c.layout in (ATTENTION_LAYOUT, TWO_ATTENTION_LAYOUT) or not c.external
]
FORK_TREES = ["a", "a-comments", "a-nodebug", "b", "c", "d"]


ONE_SIDED = {
    "K3, 1 chunk, decode node without the fix",
    "K3, 1 chunk, prefill scheduler without the fix",
}
ALL_MAMBA = "every group Mamba (no attention group): the worker's layer maps"
ALL_MAMBA_REFUSED = (
    f"{ALL_MAMBA} refuse: ValueError: MoRIIO WRITE needs an attention KV-cache group; all groups "
    "are Mamba"
)


def failed_cases(probe: dict[str, Any]) -> set[str]:
    return {c.removeprefix("FAIL ").split(": ")[0] for c in lines(probe, "FAIL ")}


def expected_lines(case: Any) -> list[str]:
    """What the applied probe says of `case`: no state left; then each layer's own group's
    blocks of every chunk on both nodes, or (no external tokens) no block named or written."""
    head = f"{case.label}: per-request state once both requests finished: none"
    if case.one_sided:  # refused per layer, the lines test_verify_passes_... reads
        return [head]
    if not case.external:
        return [head, f"{case.label}: decode's notify names blocks []"]
    local, remote = case.prefill_blocks(), case.decode_blocks()
    return [head] + [
        f"{case.label} @chunk {len(case.chunks)}: {layer} ({KIND_NAMES.get(kind, kind)} group "
        f"{g}): local {local[g]} -> remote {remote[g]}"
        for g, (kind, names) in enumerate(case.layout)
        for layer in names
    ]


@pytest.mark.parametrize("name", slow_except(FORK_TREES, "a", "d"))
def test_issue_19_cases_fail_where_the_fork_misroutes_and_pass_applied(routed, name):
    before = routed(name, False)
    misrouted = {"two attention groups, 1 chunk", "two attention groups, 3 chunks"}
    misrouted |= {"attention only, 3 chunks"} if name == "c" else set()
    assert failed_cases(before) & {c.label for c in NEW_CASES} == misrouted, before["summary"]
    # A one-sided peer on either side: the fork trees write into [0]/[1]'s blocks, unrefused.
    assert ONE_SIDED <= failed_cases(before), before["summary"]
    # Mamba groups only: the fork trees build their layer maps without a word.
    assert f"{ALL_MAMBA}: built without a word" in before["summary"]
    # The unpatched trees leave only the older scripts' own dicts behind (noted, not failed).
    assert not [c for c in lines(before, "FAIL ") if "a leak per request" in c]
    assert any(
        "left by the older scripts (" in c and "mamba_blockids.py" in c for c in before["checks"]
    )

    after = routed(name, True)
    assert after["rc"] == 0 and after["probe"]["ok"], after["probe"]["summary"]
    checks = after["probe"]["checks"]
    assert not lines(after["probe"], "FAIL")
    for case in CASES:
        for want in expected_lines(case):
            assert any(c.startswith(want) for c in checks), want
    assert ALL_MAMBA_REFUSED in checks


# --------------------------------------------------------------------------------------------
# Upstream routes per group natively (satisfied): verify runs upstream's checks and passes.


@pytest.mark.parametrize("version", ["0.31.0", "0.33.0"])
def test_verify_passes_on_upstream(verified, version):
    found = verified(version)
    check = found["patches"][PATCH.id]
    assert found["verify_rc"] == 0, found["output"]
    assert check["verdict"] == "satisfied"
    assert check["probe"]["ok"] is True, check["probe"]
    assert (
        "K3: _split_kv_cache_group_kinds -> attention [3], mamba [0, 1, 2]"
        in check["probe"]["checks"]
    )
    if version == "0.33.0":  # one request through the writer's plan (issue 28's u-* rows)
        for line in (
            "K3 upstream plan, one request: model.layers.7.mla (group 3) -> local [31, 32] "
            "remote [131, 132]",
            "two attention groups upstream plan, one request: model.layers.3.swa (group 1) -> "
            "local [11, 12] remote [111, 112]",
        ):
            assert line in check["probe"]["checks"], check["probe"]["checks"]


# --------------------------------------------------------------------------------------------
# Shipped: the probe is a module of the patch's package, imported relatively in the child.


@pytest.mark.slow
def test_an_installed_k3patch_ships_and_loads_the_probe(
    tmp_path, make_tree, verify_python, k3patch_source
):

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
    mla = "K3 upstream plan, one request: model.layers.6.mla"
    assert any(c.startswith(mla) for c in probe["checks"])


# --------------------------------------------------------------------------------------------
# The batch oracle (several requests share one scheduler and one worker): seeded batches in
# verify, hypothesis-drawn ones here, each judged by batches.serve_batches in one long-lived child
# of the tree's interpreter.
SERVE = "k3patch.patches.moriio_group_routing.batches:serve_batches"


@pytest.fixture(scope="module")
def batch_oracle(tmp_path_factory, verify_python):
    site = tmp_path_factory.mktemp("batch-oracle") / "site"
    shutil.copytree(built_fork_tree("a"), site, ignore=shutil.ignore_patterns(".complete"))
    proc = run_cli("apply", "--vllm", str(site), "--quiet")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    oracle = OracleChild(verify_python, site, SERVE)
    yield oracle.judge
    oracle.close()


@st.composite
def batches(draw) -> Batch:
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    kinds = sorted({kind for kind, _ in LAYOUTS[layout]})
    growing = tuple(k for k in kinds if draw(st.booleans()))
    request = st.lists(st.integers(1, 16), min_size=1, max_size=4).map(tuple)
    chunks = tuple(draw(st.lists(request, min_size=1, max_size=4)))
    return Batch(None, layout, growing, chunks)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=batches())
def test_batch_oracle_holds_on_the_patched_fork(batch_oracle, batch):
    assert batch_oracle(batch) == []


def test_unpatched_fork_fails_generated_batches_naming_seed_and_case(routed):
    probe = routed("a", False)
    assert re.search(r"batch seed \d+: r\d+ model\.layers\.\d+\.\w+ \(", probe["summary"])
    assert "smallest failing batch of seed " in probe["summary"]
    applied = routed("a", True)["probe"]["checks"]
    assert len([c for c in applied if c.startswith("batch seed ")]) == BATCHES
    assert all(c.endswith(": ok") for c in applied if c.startswith("batch seed "))


# --------------------------------------------------------------------------------------------
# Resumed after preemption (issue 28 item 5): vLLM's own Scheduler, the chunk-gate oracle's
# workloads; each save's per-group lists must hold the request's blocks once each.


def test_applied_fork_sends_each_resumed_requests_blocks_once(routed):
    checks = routed("a", True)["probe"]["checks"]
    runs = [c for c in checks if c.startswith("scheduler workload seed ")]
    assert len(runs) == 40, runs
    assert all(c.endswith(": ok") for c in runs), [c for c in runs if not c.endswith(": ok")]
    # Preemption is there to judge: several workloads save requests after a preemption.
    resumed = [c for c in runs if not re.search(r", 0 saved after a preemption\)", c)]
    assert len(resumed) >= 3, runs


@pytest.mark.slow
def test_the_earlier_growth_sends_resumed_blocks_twice_and_the_oracle_says_so(
    tmp_path, verify_python
):
    # k3patch's growth before the resume branch (the mutation row routing-resume-appends):
    # written over an applied fork tree, the probe fails naming a resumed request's doubled list.
    site = tmp_path / "site"
    shutil.copytree(built_fork_tree("a"), site, ignore=shutil.ignore_patterns(".complete"))
    assert run_cli("apply", "--vllm", str(site / "vllm"), *ONLY).returncode == 0
    connector = site / "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"
    text = connector.read_text()
    branch = re.search(
        r"\n( +)if _k3patch_req_id in _k3patch_cached\.resumed_req_ids:\n(?:\1 .*\n)+", text
    )
    assert branch is not None
    connector.write_text(text[: branch.start() + 1] + text[branch.end() :])
    probe = run_probe(verify_python, site)
    assert probe["ok"] is False, probe
    assert re.search(
        r"scheduler workload seed \d+: r\d+ saved at step \d+ with per-group lists .*, "
        r"expected its blocks once each .*preempted at step",
        probe["summary"],
    ), probe["summary"]
