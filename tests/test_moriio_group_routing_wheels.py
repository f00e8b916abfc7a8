"""moriio-group-routing on real vLLM wheels: upstream's verdicts (not applicable while the
connector is single-group or sliding-window-only, satisfied once it routes per group natively),
nothing written, the must-not-touch `[0]`s of SITES.md byte-identical after `apply`, and the
probe exercising upstream's own routing with K3's layout."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from conftest import run_cli, slow_after, slow_except, tree_hashes

from k3patch.patches.moriio_group_routing import PATCH

pytestmark = pytest.mark.wheel
ONLY = ["--only", "moriio-group-routing"]
MORIIO = "distributed/kv_transfer/kv_connector/v1/moriio"
PACKAGE = f"vllm/{MORIIO}"

VERDICTS = {
    "0.29.0": ("not applicable", "upstream 0.14.1-0.29.0 single-group connector"),
    "0.30.0": ("not applicable", "upstream 0.30.0 sliding-window-only HMA"),
    "0.31.0": ("satisfied", "upstream 0.31.0-0.32.0 native per-group routing"),
    "0.33.0": ("satisfied", "upstream 0.33.0+ native per-group WRITE routing"),
    "0.34.0": ("satisfied", "upstream 0.33.0+ native per-group WRITE routing"),
}


def patch_status(site: Path) -> dict:
    proc = run_cli("status", "--vllm", str(site), "--json", *ONLY)
    return json.loads(proc.stdout)["patches"][0]


def package_hashes(site: Path) -> dict[str, str]:
    return {rel: h for rel, h in tree_hashes(site).items() if rel.startswith(PACKAGE)}


@pytest.mark.parametrize("version", slow_after(sorted(VERDICTS)))
def test_upstream_verdicts_and_nothing_written(make_tree, version):
    site = make_tree(version)
    verdict, shape = VERDICTS[version]
    patch = patch_status(site)
    assert patch["verdict"] == verdict
    assert [s["file"] for s in patch["sites"]] == [
        f"{MORIIO}/moriio_common.py",
        f"{MORIIO}/moriio_connector.py",
        f"{MORIIO}/moriio_engine.py",
    ]
    assert {s["shape"] for s in patch["sites"]} == {shape}
    before = package_hashes(site)
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    assert package_hashes(site) == before


def test_single_group_verdict_says_why(make_tree):
    detail = patch_status(make_tree("0.29.0"))["sites"][0]["detail"]
    assert "no hybrid support" in detail
    assert "SupportsHMA" in detail


def test_native_routing_is_named(make_tree):
    detail = patch_status(make_tree("0.33.0"))["sites"][0]["detail"]
    assert "self.worker.layer_to_group[task.layer_name]" in detail
    detail = patch_status(make_tree("0.31.0"))["sites"][0]["detail"]
    assert "_split_kv_cache_group_kinds" in detail
    assert "transfer_group_index_by_layer" in detail


# --------------------------------------------------------------------------------------------
# SITES.md: never rewrite these [0]s.


def must_not_touch(site: Path) -> list[str]:
    """Source text of every statement SITES.md puts off limits, found in the real files: the
    READ attention-first payload ([0] / [1:]) under `_has_mamba`, the `isinstance(x[0], int)`
    type probes, `block_notify_list[0]`, and the `new_block_ids_to_zero` filter."""
    found: list[str] = []
    for path in sorted((site / PACKAGE).glob("*.py")):
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if not isinstance(node, ast.stmt) or isinstance(
                node, ast.FunctionDef | ast.ClassDef | ast.For | ast.While | ast.With | ast.Try
            ):
                continue
            source = ast.get_source_segment(text, node) or ""
            if isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if "_has_mamba" in test and "[1:]" in ast.unparse(node):
                    found.append(source)
                if "new_block_ids_to_zero" in test:
                    found.append(source)
                if "isinstance(block_ids[0], int)" in test:
                    found.append(ast.get_source_segment(text, node.test) or "")
                continue
            dumped = ast.unparse(node)
            if "isinstance(block_ids[0], int)" in dumped or "block_notify_list[0]" in dumped:
                if not any(isinstance(c, ast.stmt) for c in ast.iter_child_nodes(node)):
                    found.append(source)
    return found


# The cases each release holds (0.34.0 splits a READ payload of several attention groups with a
# helper: no `[0]` / `[1:]` left there).
CASES = {
    "0.31.0": ("[1:]", "isinstance(block_ids[0], int)"),
    "0.33.0": (
        "[1:]",
        "isinstance(block_ids[0], int)",
        "new_block_ids_to_zero",
        "block_notify_list[0]",
    ),
    "0.34.0": ("isinstance(block_ids[0], int)", "new_block_ids_to_zero", "block_notify_list[0]"),
}


# Slow (.ci/run): a plain pytest checks the same on a fork tree (test_moriio_group_routing.py).
@pytest.mark.slow
@pytest.mark.parametrize("version", sorted(CASES))
def test_must_not_touch_cases_stay_byte_identical_after_apply(make_tree, version):
    site = make_tree(version)
    segments = must_not_touch(site)
    # The cases are really there, so the assertion below means something.
    joined = "\n".join(segments)
    assert [case for case in CASES[version] if case not in joined] == []
    # This patch alone: the whole package is untouched.
    before = package_hashes(site)
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    assert package_hashes(site) == before
    # Every patch together (others may rewrite moriio_connector.py): the cases stay verbatim.
    proc = run_cli("apply", "--vllm", str(site))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    texts = "\n".join(p.read_text() for p in sorted((site / PACKAGE).glob("*.py")))
    for segment in segments:
        assert texts.count(segment) >= 1, segment


# --------------------------------------------------------------------------------------------
# The probe on upstream's own code (satisfied trees): K3's layout through its native routing.


@pytest.mark.verify
def test_probe_exercises_upstream_031_group_split(probed):
    # The verify child only imports (no bytecode is written), so the pristine cache serves; one
    # child runs every patch's probe on it, shared with their tests (conftest).
    probe = probed("0.31.0", PATCH.id)
    assert probe["ok"] is True, probe
    assert "K3: _split_kv_cache_group_kinds -> attention [3], mamba [0, 1, 2]" in probe["checks"]
    assert any("refused by register_kv_caches" in c for c in probe["checks"])


@pytest.mark.verify
@pytest.mark.parametrize("version", slow_except(["0.33.0", "0.34.0"], "0.33.0"))
def test_probe_exercises_upstream_write_plan(verified, version):
    # Satisfied here, so verify runs it on the tree as it is (apply edits other patches' files).
    found = verified(version)
    assert found["patches"][PATCH.id]["verdict"] == "satisfied", found["output"]
    probe = found["patches"][PATCH.id]["probe"]
    assert probe["ok"] is True, probe
    # One request through upstream's _prepare_transfer_plan (issue 28's attack: the probe used
    # to read the plan without sending a request): K3's MLA layer writes group 3's blocks.
    assert (
        "K3 upstream plan, one request: model.layers.7.mla (group 3) -> local [31, 32] "
        "remote [131, 132]" in probe["checks"]
    )
