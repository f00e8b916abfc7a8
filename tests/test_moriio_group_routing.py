"""moriio-group-routing on the hand-written fork fixtures: verdicts, the pending -> applied ->
revert cycle as one transaction over three files, half-patched and drifted packages, formatting
and marker comments, the chunk gates left alone, and the routing itself (the bug reproduced on
the fork's code, fixed on the patched code, unchanged for a two-group model)."""

from __future__ import annotations

import ast
import difflib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import FIXTURES, run_cli, tree_hashes
from conftest import status_json as _status_json
from k3patch.patches import moriio_group_routing as gr

from k3patch import model
from k3patch.registry import all_patches, patch_module_file

ONLY = ["--only", "moriio-group-routing"]
FORK = "group-routing-fork"
LEGACY = "group-routing-legacy"
COMMON = "vllm/" + gr.COMMON
CONNECTOR = "vllm/" + gr.CONNECTOR
ENGINE = "vllm/" + gr.ENGINE
SITE_NAMES = [s.name for s in gr.FORK_SITES]


def copy_fixture(name: str, tmp_path: Path, as_name: str | None = None) -> Path:
    dst = tmp_path / (as_name or name)
    shutil.copytree(FIXTURES / name, dst)
    return dst


def status_json(tree: Path, *only: str) -> dict:
    return _status_json(tree, *(only or ONLY))


def patch_of(data: dict, patch_id: str = "moriio-group-routing") -> dict:
    return next(p for p in data["patches"] if p["id"] == patch_id)


def sites_of(tree: Path) -> dict[str, dict]:
    return {s["site"]: s for s in patch_of(status_json(tree))["sites"]}


def source_hashes(tree: Path) -> dict[str, str]:
    return {rel: h for rel, h in tree_hashes(tree).items() if not rel.startswith("vllm/.k3patch")}


def applied_texts(tmp_path: Path) -> dict[str, str]:
    """The fork fixture's three files as k3patch writes them."""
    tree = copy_fixture(FORK, tmp_path, "applied-reference")
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    return {rel: (tree / rel).read_text() for rel in (COMMON, CONNECTOR, ENGINE)}


# --------------------------------------------------------------------------------------------
# Verdicts


def test_fork_fixture_reads_pending_site_by_site(tmp_path):
    tree = copy_fixture(FORK, tmp_path)
    data = status_json(tree)
    assert data["_rc"] == 1
    assert data["vllm"]["version"] == "0.29.0+k3fork"
    patch = patch_of(data)
    assert patch["verdict"] == "pending"
    assert [s["site"] for s in patch["sites"]] == SITE_NAMES
    assert {s["verdict"] for s in patch["sites"]} == {"pending"}
    assert {s["file"] for s in patch["sites"]} == {gr.COMMON, gr.CONNECTOR, gr.ENGINE}
    assert all(s["shape"].startswith("fork: mamba block ids") for s in patch["sites"])


def test_legacy_fixture_reads_satisfied_and_is_left_alone(tmp_path):
    tree = copy_fixture(LEGACY, tmp_path)
    before = source_hashes(tree)
    patch = patch_of(status_json(tree))
    assert patch["verdict"] == "satisfied"
    assert {s["shape"] for s in patch["sites"]} == {"older anchor script k3-group-routing (legacy)"}
    # Its pitfall is named, not hidden: the group map falls back to group 0 on any exception.
    assert all("except Exception" in s["detail"] for s in patch["sites"])
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    assert source_hashes(tree) == before


def test_a_marker_comment_does_not_make_the_fork_read_applied(tmp_path):
    tree = copy_fixture(FORK, tmp_path)
    for rel in (COMMON, CONNECTOR, ENGINE):
        path = tree / rel
        path.write_text(
            "# k3patch moriio-group-routing applied\n# k3-group-routing\n" + path.read_text()
        )
    assert patch_of(status_json(tree))["verdict"] == "pending"


@pytest.mark.parametrize("line_length,quote", [(60, "single"), (120, "double")])
def test_formatting_never_changes_a_verdict(tmp_path, line_length, quote):
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    pending = copy_fixture(FORK, tmp_path, "pending")
    applied = copy_fixture(FORK, tmp_path, "applied")
    assert run_cli("apply", "--vllm", str(applied), *ONLY).returncode == 0
    for tree, want in ((pending, "pending"), (applied, "applied")):
        for rel in (COMMON, CONNECTOR, ENGINE):
            text = (tree / rel).read_text()
            # Comments and blank lines between statements, then a different formatter setting.
            noisy = "\n".join(
                f"{line}\n{line[: len(line) - len(line.lstrip())]}# reviewed"
                if line.rstrip().endswith(")") and not line.lstrip().startswith(("def ", "@"))
                else line
                for line in text.splitlines()
            )
            ast.parse(noisy)
            (tree / rel).write_text(noisy)
            subprocess.run(
                [
                    ruff,
                    "format",
                    "--no-cache",
                    "--isolated",
                    "--line-length",
                    str(line_length),
                    "--config",
                    f"format.quote-style='{quote}'",
                    str(tree / rel),
                ],
                check=True,
                capture_output=True,
            )
            assert (tree / rel).read_text() != text
        sites = patch_of(status_json(tree))["sites"]
        assert {s["verdict"] for s in sites} == {want}, [
            (s["site"], s["verdict"], s["detail"]) for s in sites if s["verdict"] != want
        ]


# --------------------------------------------------------------------------------------------
# The transaction: apply, idempotence, exact revert


def test_apply_is_idempotent_and_revert_is_exact(tmp_path):
    tree = copy_fixture(FORK, tmp_path)
    original = source_hashes(tree)

    check = run_cli("apply", "--vllm", str(tree), "--check", *ONLY)
    assert check.returncode == 1
    assert source_hashes(tree) == original, "--check wrote something"

    first = run_cli("apply", "--vllm", str(tree), *ONLY)
    assert first.returncode == 0, first.stderr
    once = source_hashes(tree)
    assert {rel for rel in once if once[rel] != original[rel]} == {COMMON, CONNECTOR, ENGINE}
    sites = patch_of(status_json(tree))["sites"]
    assert [s["site"] for s in sites] == SITE_NAMES
    assert {s["verdict"] for s in sites} == {"applied"}

    second = run_cli("apply", "--vllm", str(tree), *ONLY)
    assert second.returncode == 0
    assert source_hashes(tree) == once, "a second apply changed bytes"

    back = run_cli("revert", "--vllm", str(tree))
    assert back.returncode == 0, back.stderr
    assert tree_hashes(tree) == tree_hashes(FIXTURES / FORK), "revert is not byte-identical"


def test_the_rewrite_only_adds_to_the_scheduler_and_worker(tmp_path):
    # Everything the fork has in moriio_connector.py stays, byte for byte: the chunk gates in
    # build_connector_meta (moriio-chunk-gate's sites) included. Only lines are added.
    texts = applied_texts(tmp_path)
    before = (FIXTURES / FORK / CONNECTOR).read_text().splitlines()
    after = texts[CONNECTOR].splitlines()
    removed = [line for line in difflib.ndiff(before, after) if line.startswith("- ")]
    assert removed == []
    gates = [
        "                    if (\n"
        "                        len(self._reqs_need_pending_save[req_id][1]) * self.block_size\n"
        "                        >= req.num_prompt_tokens\n"
        "                    ):\n",
        "            if req.num_prompt_tokens > len(block_ids) * self.block_size:\n",
        "        if self.mode == MoRIIOMode.WRITE and get_role() == ROLE.PRODUCER:\n",
    ]
    for gate in gates:
        assert gate in (FIXTURES / FORK / CONNECTOR).read_text()
        assert gate in texts[CONNECTOR]
    # The engine's only removal is the fork's [0]/[1] choice in the transfer plan.
    engine_before = (FIXTURES / FORK / ENGINE).read_text().splitlines()
    gone = [
        line[2:].strip()
        for line in difflib.ndiff(engine_before, texts[ENGINE].splitlines())
        if line.startswith("- ")
    ]
    assert "_k3_local = [task.local_block_ids, task.mamba_local_block_ids]" in gone
    assert all(line.startswith(("_k3_", "1", "if isinstance", "else 0", ")")) for line in gone)


def test_no_fallback_to_group_zero_in_the_post_image(tmp_path):
    texts = applied_texts(tmp_path)
    for rel, text in texts.items():
        fork = (FIXTURES / FORK / rel).read_text()
        added = "\n".join(
            line[2:]
            for line in difflib.ndiff(fork.splitlines(), text.splitlines())
            if line.startswith("+ ")
        )
        assert "except Exception" not in added, rel
        assert "except" not in added, rel
    plan = ast.parse(texts[ENGINE])
    writer = next(n for n in plan.body if isinstance(n, ast.ClassDef) and n.name == "MoRIIOWriter")
    fn = next(n for n in writer.body if getattr(n, "name", "") == "_prepare_transfer_plan")
    assert not any(isinstance(n, ast.Try) for n in ast.walk(fn))


# --------------------------------------------------------------------------------------------
# Half-patched and drifted packages: the three files are one change


def test_half_patched_package_reads_pending_and_apply_completes_it(tmp_path):
    texts = applied_texts(tmp_path)
    tree = copy_fixture(FORK, tmp_path)
    (tree / CONNECTOR).write_text(texts[CONNECTOR])
    (tree / ENGINE).write_text(texts[ENGINE])
    sites = sites_of(tree)
    by_file = {
        rel: {s["verdict"] for s in sites.values() if s["file"] == rel[5:]}
        for rel in (COMMON, CONNECTOR, ENGINE)
    }
    assert by_file == {COMMON: {"pending"}, CONNECTOR: {"applied"}, ENGINE: {"applied"}}
    assert patch_of(status_json(tree))["verdict"] == "pending"

    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    for rel, text in texts.items():
        assert (tree / rel).read_text() == text, rel
    assert patch_of(status_json(tree))["verdict"] == "applied"


def test_one_file_patched_another_drifted_writes_nothing_and_names_both(tmp_path):
    texts = applied_texts(tmp_path)
    tree = copy_fixture(FORK, tmp_path)
    (tree / COMMON).write_text(texts[COMMON])
    engine = (tree / ENGINE).read_text()
    # A fork build whose plan picks the group differently: in no shape k3patch knows.
    drifted = engine.replace("else 0\n", "else 2\n")
    assert drifted != engine
    (tree / ENGINE).write_text(drifted)
    before = source_hashes(tree)

    data = status_json(tree)
    patch = patch_of(data)
    assert patch["verdict"] == "drifted"
    sites = {s["site"]: s for s in patch["sites"]}
    assert {s["verdict"] for s in sites.values() if s["file"] == gr.COMMON} == {"applied"}
    plan = sites["MoRIIOWriter._prepare_transfer_plan"]
    assert plan["verdict"] == "drifted"
    assert "else 2" in plan["found"]
    assert any("_k3_sel = 1 if isinstance" in e for e in plan["expected"])
    assert "moriio_common.py applied" in plan["detail"]
    assert "moriio_engine.py drifted" in plan["detail"]
    assert "moriio_connector.py pending" in plan["detail"]

    proc = run_cli("apply", "--vllm", str(tree), *ONLY)
    assert proc.returncode == 1
    assert source_hashes(tree) == before, "a drifted package was partly written"
    assert not (tree / "vllm" / ".k3patch" / "state.json").exists()


def test_hand_edited_post_image_is_drift_not_applied(tmp_path):
    texts = applied_texts(tmp_path)
    tree = copy_fixture(FORK, tmp_path)
    for rel, text in texts.items():
        (tree / rel).write_text(text)
    # Someone "simplifies" the patched plan back to group 0: the original bug, silently.
    engine = texts[ENGINE].replace(
        "_k3_sel = self.worker.kv_group_of_layer[task.layer_name]", "_k3_sel = 0"
    )
    assert engine != texts[ENGINE]
    (tree / ENGINE).write_text(engine)
    sites = sites_of(tree)
    assert sites["MoRIIOWriter._prepare_transfer_plan"]["verdict"] == "drifted"
    assert patch_of(status_json(tree))["verdict"] == "drifted"


def test_legacy_and_k3patch_forms_together_are_drift(tmp_path):
    tree = copy_fixture(LEGACY, tmp_path)
    common = (tree / COMMON).read_text()
    (tree / COMMON).write_text(
        common.replace(
            "    retried: int = 0\n",
            "    retried: int = 0\n    group_block_ids: list[list[int]] | None = None\n",
            1,
        )
    )
    before = source_hashes(tree)
    patch = patch_of(status_json(tree))
    assert patch["verdict"] == "drifted"
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 1
    assert source_hashes(tree) == before


def test_half_legacy_package_is_drift(tmp_path):
    # The older script patched moriio_common.py and moriio_connector.py but not the engine.
    tree = copy_fixture(LEGACY, tmp_path)
    shutil.copy2(FIXTURES / FORK / ENGINE, tree / ENGINE)
    patch = patch_of(status_json(tree))
    verdicts = {s["file"]: s["verdict"] for s in patch["sites"]}
    assert verdicts == {gr.COMMON: "satisfied", gr.CONNECTOR: "satisfied", gr.ENGINE: "drifted"}


def test_composes_with_the_chunk_gate_patch_in_either_order(tmp_path):
    if "moriio-chunk-gate" not in {p.id for p in all_patches()}:
        pytest.skip("moriio-chunk-gate is not registered")
    together = copy_fixture(FORK, tmp_path, "together")
    assert run_cli("apply", "--vllm", str(together)).returncode == 0
    mine_first = copy_fixture(FORK, tmp_path, "mine-first")
    assert run_cli("apply", "--vllm", str(mine_first), *ONLY).returncode == 0
    assert run_cli("apply", "--vllm", str(mine_first)).returncode == 0
    gate_first = copy_fixture(FORK, tmp_path, "gate-first")
    gate_only = run_cli("apply", "--vllm", str(gate_first), "--only", "moriio-chunk-gate")
    assert gate_only.returncode == 0
    assert run_cli("apply", "--vllm", str(gate_first)).returncode == 0
    for tree in (together, mine_first, gate_first):
        data = status_json(tree, "--only", "moriio-group-routing", "--only", "moriio-chunk-gate")
        assert {p["verdict"] for p in data["patches"]} == {"applied"}
        assert source_hashes(tree) == source_hashes(together)


# --------------------------------------------------------------------------------------------
# Behaviour: the tree's own code, driven on CPU (the probe's driver), in the tree's interpreter.

DRIVER = textwrap.dedent(
    """
    import dataclasses, importlib.util, json, sys, types

    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    package = types.ModuleType("k3patch")
    package.__path__ = []
    sys.modules["k3patch"] = package
    load("k3patch.model", sys.argv[1])
    patch = load("k3patch_group_routing_under_test", sys.argv[2])
    layout = getattr(patch, sys.argv[3])
    result = patch.drive_write(layout, sys.argv[4] == "chunked",
                               decode_sends_groups=sys.argv[5] == "groups")
    print("RESULT " + json.dumps(dataclasses.asdict(result)))
    """
)


def drive(python: str, tree: Path, layout: str, chunked: bool, groups: bool = True) -> dict:
    proc = subprocess.run(
        [
            python,
            "-c",
            DRIVER,
            model.__file__,
            str(patch_module_file(gr.PATCH)),
            layout,
            "chunked" if chunked else "single",
            "groups" if groups else "no-groups",
        ],
        capture_output=True,
        text=True,
        cwd=tree.parent,
        env={**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"},
    )
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line, proc.stderr[-3000:]
    data = json.loads(line[len("RESULT ") :])
    data["routes"] = {k: (v[0], v[1]) for k, v in (data["routes"] or {}).items()}
    return data


def expected(layout: gr.Layout, chunked: bool) -> dict[str, tuple[list[int], list[int]]]:
    return gr.expected_routes(layout, chunked)


@pytest.fixture(scope="module")
def fork_trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("trees")
    pending = base / "pending"
    shutil.copytree(FIXTURES / FORK, pending)
    applied = base / "applied"
    shutil.copytree(FIXTURES / FORK, applied)
    assert run_cli("apply", "--vllm", str(applied), *ONLY).returncode == 0
    return pending, applied


def test_the_fork_sends_mla_kv_to_group_zero(fork_trees, verify_python):
    """The bug, reproduced on the fork's own code: K3's MLA layers (group 3) are written into
    group 0's block ids (a KDA group) on both nodes; every KDA layer into group 1's."""
    pending, _ = fork_trees
    result = drive(verify_python, pending, "K3_LAYOUT", chunked=False)
    assert result["emitted"] and result["messages"] == 1
    groups = {name: g for g, (_, names) in enumerate(gr.K3_LAYOUT) for name in names}
    for layer, route in result["routes"].items():
        if layer.endswith(".mla"):
            assert groups[layer] == 3
            assert route == ([1], [101]), f"{layer}: {route}"  # group 0's blocks
        else:
            assert route == ([11], [111]), f"{layer}: {route}"  # group 1's blocks
    assert result["routes"] != expected(gr.K3_LAYOUT, False)


def test_the_patched_plan_routes_every_layer_to_its_own_group(fork_trees, verify_python):
    _, applied = fork_trees
    result = drive(verify_python, applied, "K3_LAYOUT", chunked=False)
    assert result["errors"] == {}
    assert result["attention_group"] == 3
    assert result["routes"] == expected(gr.K3_LAYOUT, False)
    assert result["routes"]["model.layers.6.mla"] == ([31], [131])
    assert result["routes"]["model.layers.0.kda"] == ([1], [101])
    assert result["routes"]["model.layers.5.kda"] == ([21], [121])


@pytest.mark.parametrize("chunked", [False, True])
def test_a_two_group_model_behaves_exactly_as_before(fork_trees, verify_python, chunked):
    pending, applied = fork_trees
    before = drive(verify_python, pending, "TWO_GROUP_LAYOUT", chunked)
    after = drive(verify_python, applied, "TWO_GROUP_LAYOUT", chunked)
    assert before["emitted"] and after["emitted"]
    assert after["attention_group"] == 0
    assert after["routes"] == before["routes"] == expected(gr.TWO_GROUP_LAYOUT, chunked)


def test_blocks_of_later_chunks_reach_the_mla_transfer(tmp_path, verify_python):
    # The fork's block-count gate never releases a K3 save over two chunks (it counts group 0,
    # a KDA group that does not grow), so this stands in a compute-progress gate (what
    # moriio-chunk-gate installs) and checks the MLA group's second block is carried.
    tree = copy_fixture(FORK, tmp_path)
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    text = (tree / CONNECTOR).read_text()
    progress = "req.num_computed_tokens + scheduler_output.num_scheduled_tokens[req_id]"
    text = text.replace(
        "len(self._reqs_need_pending_save[req_id][1]) * self.block_size\n"
        "                        >= req.num_prompt_tokens",
        f"{progress}\n                        >= req.num_prompt_tokens",
    ).replace(
        "if req.num_prompt_tokens > len(block_ids) * self.block_size:",
        f"if {progress} < req.num_prompt_tokens:",
    )
    (tree / CONNECTOR).write_text(text)
    result = drive(verify_python, tree, "K3_LAYOUT", chunked=True)
    assert result["emitted"]
    assert result["routes"] == expected(gr.K3_LAYOUT, True)
    assert result["routes"]["model.layers.7.mla"] == ([31, 32], [131, 132])


def test_a_decode_node_without_the_fix_is_refused_loudly(fork_trees, verify_python):
    _, applied = fork_trees
    result = drive(verify_python, applied, "K3_LAYOUT", chunked=False, groups=False)
    assert result["routes"] == {}
    layers = [name for _, names in gr.K3_LAYOUT for name in names]
    assert sorted(result["errors"]) == sorted(layers)
    assert all("MoRIIOError" in e and "decode node" in e for e in result["errors"].values())


def test_verify_runs_the_probe_on_the_patched_fork(fork_trees, verify_python):
    _, applied = fork_trees
    proc = run_cli("verify", "--vllm", str(applied), "--python", verify_python, "--json", *ONLY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check = json.loads(proc.stdout)["verify"]["patches"][0]
    assert [m["status"] for m in check["modules"]] == ["ok", "ok", "ok"]
    assert check["probe"]["ok"] is True
    checks = check["probe"]["checks"]
    assert "K3: model.layers.6.mla (group 3) -> local [31] remote [131]" in checks
    assert "K3, decode without group lists: all 8 layers refuse" in checks


def test_the_probe_fails_when_the_plan_falls_back_to_group_zero(tmp_path, verify_python):
    # The probe is only worth something if it can fail: patched code whose plan was edited
    # back to group 0 (it reads drifted; the probe is run on it directly).
    from k3patch import verify as verify_mod
    from k3patch.tree import locate

    texts = applied_texts(tmp_path)
    tree = copy_fixture(FORK, tmp_path)
    for rel, text in texts.items():
        (tree / rel).write_text(text)
    engine = texts[ENGINE].replace(
        "_k3_sel = self.worker.kv_group_of_layer[task.layer_name]", "_k3_sel = 0"
    )
    (tree / ENGINE).write_text(engine)
    result = verify_mod._run_child(
        verify_python,
        locate(tree),
        {
            "model": model.__file__,
            "patches": {gr.PATCH.id: str(patch_module_file(gr.PATCH))},
            "modules": list(gr.PATCH.modules),
            "probes": [gr.PATCH.id],
        },
    )
    probe = result["probes"][gr.PATCH.id]
    assert probe["ok"] is False
    assert "expected local [11] remote [111]" in probe["summary"]
    assert "K3: model.layers.6.mla (group 3) -> local [1] remote [101]" in probe["checks"]
