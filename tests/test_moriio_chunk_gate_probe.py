"""moriio-chunk-gate's behaviour on the real code, no GPU: the probe drives the real
`build_connector_meta` of a tree (unpatched and patched) with synthetic scheduler steps, then
vLLM's own `Scheduler.schedule()` of the tree with the MoRIIO connector's scheduler side, in the
verify child (the tree's interpreter, PYTHONPATH = the tree, the patch module loaded by file
path). One child per tree and state, asserting over the probe's whole table (probe.TABLE, and
probe.SCHEDULED through the Scheduler): on every tree where the patch is pending, each row fails
that the tree's gate gets wrong, and only those; applied, and on upstream's fix, every row passes.
"""

from __future__ import annotations

import dataclasses
import re
import shutil

import pytest
from conftest import OracleChild, built_fork_tree, run_cli, slow_except
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from k3patch import scan
from k3patch.patches.moriio_chunk_gate.probe import SCHEDULED, TABLE, Prefill
from k3patch.patches.moriio_chunk_gate.workloads import (
    K3_BLOCK,
    MAX_LEN,
    WORKLOADS,
    Ask,
    Workload,
    generate,
    workload_from,
)
from k3patch.tree import locate
from k3patch.verdicts import Verdict

PATCH_ID = "moriio-chunk-gate"
ONLY = ["--only", PATCH_ID]
MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"
K3_BUG = "[k3-2611]: save at chunk 1 of 2, expected chunk 2 only"
K3_FIXED = "[k3-2611]: save at chunk 2 of 2, expected chunk 2 only"
NOT_STALE = "(the count before this step's chunk, not stale)"


def row_results(probe: dict) -> dict[str, bool]:
    """Each table row's check, direct and through the Scheduler, by its line's head: passed?"""
    heads = [f"{row.label}: " for row in TABLE]
    heads += [f"Scheduler.schedule() [{req_id}] {row.label}: " for req_id, row in SCHEDULED]
    failures = "" if probe["ok"] else probe["summary"].split(" checks: ", 1)[1]
    lines = {head: [c for c in probe["checks"] if c.startswith(head)] for head in heads}
    assert all(len(found) == 1 for found in lines.values()), lines
    # A failure is its whole line in the "; "-joined summary (one line holds another's text).
    return {head: f"; {line};" not in f"; {failures};" for head, (line,) in lines.items()}


def case_results(probe: dict, tag: str) -> dict[str, bool]:
    """A written-out case's check, by its request's tag ("[resumed-4000]"): line -> passed?"""
    failures = "" if probe["ok"] else probe["summary"].split(" checks: ", 1)[1]
    found = [c for c in probe["checks"] if f" {tag}: " in c]
    assert len(found) == 1, (tag, found)
    return {line: f"; {line};" not in f"; {failures};" for line in found}


# A request preempted and resumed is prefilled again over prompt and output: its final chunk
# ends past num_prompt_tokens (G1 must compare `>=`). K3's block: the block-count gates send at
# chunk 1 (their defect); the older script's slack gate is right there (must not break on d).
RESUMED_K3 = "[resumed-4000]"
RESUMED_RIGHT = ": save at chunk 2 of 2, expected chunk 2 only (G1)"


def rows_wrong(where_wrong) -> set[str]:
    """The heads of the rows (direct and scheduled) a gate gets wrong, by `where_wrong(row)`."""
    heads = {f"{row.label}: " for row in TABLE if where_wrong(row)}
    scheduled = [(req_id, row) for req_id, row in SCHEDULED if where_wrong(row)]
    return heads | {f"Scheduler.schedule() [{req_id}] {row.label}: " for req_id, row in scheduled}


def block_count_wrong(row: Prefill) -> bool:
    """The unpatched gate sends once the allocated blocks cover the prompt: at the first chunk
    that allocates the last block the prompt needs. That is the final chunk, and the gate right,
    exactly where the final chunk allocates a block (every 16-token row: chunks end on a block;
    K3's 5,761 and 6,144-token prompts) or the prompt takes one chunk (G2 sends at once)."""
    final = len(row.chunks)
    return final > 1 and row.steps[final - 1][1] == 0


def slack_wrong(row: Prefill) -> bool:
    """The older k3-chunk-gate script gates on progress minus a slack of 2: it sends a chunk
    early exactly where the last chunk is 1 or 2 tokens (any block size)."""
    return len(row.chunks) > 1 and row.chunks[-1] <= 2


# Every tree where the patch is pending, with what its unpatched gate gets wrong. A plain
# pytest runs 0.31.0, fork a and fork d (each kind of gate once); .ci/run every tree (slow).
KEPT = ("0.31.0", "fork-a", "fork-d")
PENDING = [
    pytest.param(tree, wrong, id=tree, marks=() if tree in KEPT else (pytest.mark.slow,))
    for tree, wrong in [
        *((v, block_count_wrong) for v in ("0.23.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0")),
        *(("0.31.0", block_count_wrong), *((f"fork-{n}", block_count_wrong) for n in "abc")),
        # The older script's real form (tree d): its slack, and its block-count fallback unused.
        ("fork-d", slack_wrong),
    ]
]


@pytest.mark.wheel
@pytest.mark.verify
@pytest.mark.parametrize(("tree", "wrong"), PENDING)
def test_pending_tree_fails_the_rows_its_gate_gets_wrong_and_passes_all_applied(
    probed, verified, tree, wrong
):
    # Both results are shared with the other patches' tests of the same tree (conftest).
    spec = tree.replace("fork-", "fork:")
    before = probed(spec, PATCH_ID)
    assert before["ok"] is False
    failed = {head for head, ok in row_results(before).items() if not ok}
    assert failed == rows_wrong(wrong), (failed ^ rows_wrong(wrong), before["summary"])
    # The older script's docstring says req.num_computed_tokens is stale (0) inside
    # build_connector_meta; vLLM's own scheduler shows it is the count before the chunk.
    inside = [c for c in before["checks"] if "inside build_connector_meta" in c]
    assert len(inside) == len(SCHEDULED) and all(NOT_STALE in c for c in inside), inside
    if wrong is block_count_wrong:
        assert K3_BUG in before["summary"]
    ((line, ok),) = case_results(before, RESUMED_K3).items()
    assert ok is (wrong is slack_wrong), line
    if wrong is block_count_wrong:
        assert line.endswith(f"{RESUMED_K3}: save at chunk 1 of 2, expected chunk 2 only (G1)")

    found = verified(spec)
    assert found["apply_rc"] == 0, found["output"]
    assert found["patches"][PATCH_ID]["verdict"] == "applied"
    after = found["patches"][PATCH_ID]["probe"]
    assert after["ok"] is True, after["summary"]
    assert all(row_results(after).values())
    # 0.27.1 and older crash on a running request without kv_transfer_params (vLLM's own, fixed
    # in 0.28.0): there, and only there, every workload request is sent to a decode node.
    all_remote = [c for c in after["checks"] if c.startswith("every request sent to a decode")]
    assert bool(all_remote) is (tree in ("0.23.0", "0.27.1")), all_remote
    assert any(K3_FIXED in c for c in after["checks"])
    ((line, ok),) = case_results(after, RESUMED_K3).items()
    assert ok and line.endswith(RESUMED_K3 + RESUMED_RIGHT), line
    # A truncated row's gate compares with N-1 (a fork's own mamba_n1 truncation cut it).
    truncated = "Scheduler.schedule() [sched-4098-n1]: inside build_connector_meta "
    assert any(c.startswith(truncated + "(num_prompt_tokens 4097)") for c in after["checks"])


@pytest.mark.wheel
@pytest.mark.verify
@pytest.mark.parametrize("version", slow_except(["0.32.0", "0.33.0", "0.34.0"], "0.33.0"))
def test_verify_passes_every_row_on_upstream_fix(verified, version):
    found = verified(version)
    check = found["patches"][PATCH_ID]
    assert found["verify_rc"] == 0, found["output"]
    assert check["verdict"] == "satisfied"
    assert check["probe"]["ok"] is True, check["probe"]["summary"]
    assert all(row_results(check["probe"]).values())
    ((line, ok),) = case_results(check["probe"], RESUMED_K3).items()
    assert ok and line.endswith(RESUMED_K3 + RESUMED_RIGHT), line


@pytest.mark.wheel
@pytest.mark.verify
def test_verify_on_patched_real_tree(verified):
    found = verified("0.31.0")
    assert found["apply_rc"] == 0 and found["verify_rc"] == 0, found["output"]
    check = found["patches"][PATCH_ID]
    assert check["verdict"] == "applied"
    assert check["modules"] == [{"module": MODULE, "status": "ok", "reason": "", "decided_by": ""}]
    assert check["probe"]["ok"] is True, check["probe"]["summary"]
    checks = check["probe"]["checks"]
    assert any(K3_FIXED in c for c in checks)
    assert any("[local]: no save in 2 chunks" in c for c in checks)


@pytest.mark.wheel
@pytest.mark.verify
def test_with_group_routing_on_the_fork(verified):
    # Both MoRIIO patches edit moriio_connector.py: applied together they fold, both read
    # applied, and the chunk gate still sends once, at the final chunk.
    before = scan.scan(locate(built_fork_tree("a")), use_record=False)
    assert before.verdicts()["moriio-group-routing"] is Verdict.PENDING
    found = verified("fork:a")
    verdicts = {pid: found["patches"][pid]["verdict"] for pid in (PATCH_ID, "moriio-group-routing")}
    assert verdicts == {PATCH_ID: "applied", "moriio-group-routing": "applied"}, found["output"]
    probe = found["patches"][PATCH_ID]["probe"]
    assert probe["ok"] is True, probe["summary"]
    assert all(row_results(probe).values())


# --------------------------------------------------------------------------------------------
# The probe's oracle driven by hypothesis: workloads drawn (and shrunk) here, each run in one
# long-lived child of the tree's interpreter (vLLM imported once) by probe.serve_workloads,
# which answers what the reference model says went wrong. verify runs the same oracle on
# seeded standard-library workloads (no hypothesis in an image's Python).
SERVE = "k3patch.patches.moriio_chunk_gate.workloads:serve_workloads"


@pytest.fixture(scope="module")
def oracles(tmp_path_factory, verify_python):
    """oracles(name, patched) -> the oracle on fork tree `name`, unpatched or applied."""
    made: dict[tuple[str, bool], OracleChild] = {}

    def get(name: str, patched: bool) -> OracleChild:
        if (name, patched) not in made:
            site = tmp_path_factory.mktemp(f"oracle-{name}-{patched}") / "site"
            shutil.copytree(built_fork_tree(name), site, ignore=shutil.ignore_patterns(".complete"))
            if patched:
                proc = run_cli("apply", "--vllm", str(site), "--quiet")
                assert proc.returncode == 0, proc.stdout + proc.stderr
            made[name, patched] = OracleChild(verify_python, site, SERVE)
        return made[name, patched]

    yield get
    for oracle in made.values():
        oracle.close()


@st.composite
def workloads(draw) -> Workload:
    """As probe.generate draws them, with hypothesis choosing (and shrinking) every value."""
    k3 = draw(st.booleans())
    block = K3_BLOCK if k3 else draw(st.sampled_from((16, 32, 64)))
    budget = draw(st.sampled_from((2048, 3000))) if k3 else draw(st.integers(24, 260))
    longest = MAX_LEN - K3_BLOCK if k3 else 700
    asks = []
    for _ in range(draw(st.integers(1, 6))):
        prompt = draw(st.integers(1, longest))
        remote = draw(st.booleans())
        external = draw(st.integers(0, prompt - 1)) // block * block if draw(st.booleans()) else 0
        ask = Ask(
            prompt=prompt,
            family=draw(st.integers(0, 2)),
            shared=draw(st.integers(0, prompt)),
            arrives=draw(st.integers(1, 6)),
            remote=remote,
            external=external,
            decode=1 if remote else draw(st.integers(1, 12)),
            priority=draw(st.integers(0, 2)),
        )
        asks.append(ask)
    need = max(-(-(a.prompt + a.decode) // block) for a in asks) + 1
    pool = draw(st.integers(need, need + sum(-(-(a.prompt + a.decode) // block) for a in asks)))
    cap = draw(st.one_of(st.just(0), st.integers(max(1, budget // 4), budget)))
    policy = draw(st.sampled_from(("fcfs", "priority")))
    return Workload(None, block, budget, pool, tuple(asks), draw(st.booleans()), cap, policy)


@pytest.mark.wheel
@pytest.mark.verify
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(w=workloads())
def test_oracle_holds_on_the_patched_fork(oracles, w):
    assert oracles("a", True).judge(w) == []


@pytest.mark.wheel
@pytest.mark.verify
def test_oracle_finds_and_shrinks_the_unpatched_gate(oracles):
    # hypothesis's own search and shrinking finds a workload the unpatched fork gets wrong (a
    # save that leaves before the step computing the prompt's last token) and the patched
    # fork gets right.
    oracle = oracles("a", False)
    found = find(
        workloads(),
        lambda w: bool(oracle.judge(w)),
        settings=settings(max_examples=200, deadline=None, database=None),
    )
    early = [
        m
        for m in (
            re.match(r"r\d+ saved at step\(s\) \[(\d+)\], expected once at step (\d+)", w)
            for w in oracle.judge(found)
        )
        if m
    ]
    assert any(int(m[1]) < int(m[2]) for m in early), (found, oracle.judge(found))
    assert oracles("a", True).judge(found) == []


@pytest.mark.wheel
@pytest.mark.verify
def test_seeded_workloads_are_the_same_everywhere():
    # verify's workloads come from seeds alone: an operator's failing seed is the lead's case.
    assert [generate(seed) for seed in range(WORKLOADS)] == [
        generate(seed) for seed in range(WORKLOADS)
    ]
    assert workload_from(dataclasses.asdict(generate(3))) == generate(3)
    assert len({generate(seed) for seed in range(WORKLOADS)}) == WORKLOADS


@pytest.mark.wheel
@pytest.mark.verify
def test_unpatched_fork_fails_generated_workloads_naming_seed_and_case(probed, verified):
    before = probed("fork:a", PATCH_ID)
    assert re.search(r"workload seed \d+: r\d+ saved at step", before["summary"])
    assert "smallest failing workload of seed " in before["summary"]
    after = verified("fork:a")["patches"][PATCH_ID]["probe"]["checks"]
    lines = [c for c in after if c.startswith("workload seed ")]
    assert len(lines) == WORKLOADS and all(c.endswith(": ok") for c in lines), lines
    # The workloads reach what they are for: preemption, cache hits and several prompts a step.
    assert sum("0 preemption(s)" not in c for c in lines) >= 3
    assert sum(", 0 starting with" not in c for c in lines) >= 10


# --------------------------------------------------------------------------------------------
# Issue 28's attack: wrong fixes that passed verify, each made in the applied fork a's connector
# and run through the chunk-gate probe (as verify runs it; status would read the edit drifted).
G1_SCHEDULED = "                        + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n"
ATTACKS = {
    # The snapshot read with get: one dict per chunked request left for the server's life.
    "o-params-get": (
        [("kv_params = self._req_kv_params.pop(\n", "kv_params = self._req_kv_params.get(\n")],
        "still held in the connector's _req_kv_params",
    ),
    # mamba_n1's N-1 applied again to the prompt the fork already cut: fires at N-2 on a K3 node.
    "chunk-att-fork-double-n1": (
        [
            (
                f"{p}req.num_prompt_tokens\n",
                f"{p}self._get_remote_prefill_token_count(req.num_prompt_tokens)\n",
            )
            for p in ("                        >= ", "                < ")
        ],
        "mamba_n1 N-1: 2,049 (1 chunk + 1): save at chunk 1 of 2, expected chunk 2 only",
    ),
    # G1 reads this step's tokens by position: wrong where a new request precedes a resumed one.
    "chunk-g1-scheduled-by-position": (
        [
            (
                G1_SCHEDULED,
                G1_SCHEDULED.replace(".get(req_id, 0)", "").replace(
                    "scheduler_output.num_scheduled_tokens",
                    "list(scheduler_output.num_scheduled_tokens.values())[i]",
                ),
            )
        ],
        "written workload seed 1: r0 saved at step(s) [6, 7], expected once at step 7",
    ),
}


@pytest.mark.wheel
@pytest.mark.verify
@pytest.mark.parametrize("attack", list(ATTACKS))
def test_the_attacks_that_passed_verify_fail_the_probe(tmp_path, verify_python, attack):
    from probe_child import run_probe

    from k3patch.registry import all_patches

    edits, failure = ATTACKS[attack]
    site = tmp_path / "site"
    shutil.copytree(built_fork_tree("a"), site, ignore=shutil.ignore_patterns(".complete"))
    assert run_cli("apply", "--vllm", str(site), "--quiet").returncode == 0
    connector = site / (MODULE.replace(".", "/") + ".py")
    text = connector.read_text(encoding="utf-8")
    for old, new in edits:
        assert text.count(old) == 1, (attack, old)
        text = text.replace(old, new)
    connector.write_text(text, encoding="utf-8")
    (patch,) = [p for p in all_patches() if p.id == PATCH_ID]
    probe = run_probe(patch, verify_python, site)
    assert probe["ok"] is False and failure in probe["summary"], probe["summary"]
