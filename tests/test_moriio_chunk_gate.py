"""moriio-chunk-gate: shapes A-D on real wheels, the fork and the older script's fixed form on
fixtures, upstream's fix on 0.32/0.33; the full pending -> apply -> applied -> revert cycle;
that only the two gate statements change; and that every unknown gate form is drift."""

from __future__ import annotations

import ast
import difflib
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import FIXTURES, run_cli, sha, tree_hashes
from conftest import sites_of as _sites_of
from conftest import status_json as _status_json
from k3patch.patches import moriio_chunk_gate as gate

from k3patch.model import Sources, Verdict

ONLY = ["--only", "moriio-chunk-gate"]
REL = "vllm/" + gate.FILE
SHAPE_OF = {
    "0.23.0": "A (0.14.1-0.23.0)",
    "0.27.1": "B (0.24.0-0.27.1)",
    "0.29.0": "C (0.28.0-0.29.0)",
    "0.31.0": "D (0.30.0-0.31.0)",
}


def status_json(site: Path) -> dict:
    return _status_json(site, *ONLY)


def sites_of(site: Path) -> dict[str, dict]:
    return _sites_of(site, *ONLY)


def verdicts_of(site: Path) -> tuple[str, str]:
    sites = sites_of(site)
    return sites[gate.G1]["verdict"], sites[gate.G2]["verdict"]


def fixture_copy(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def classify_text(text: str) -> dict[str, object]:
    sources = Sources(lambda rel: text.encode() if rel == gate.FILE else None)
    return {r.site: r for r in gate.PATCH.classify(sources)}


# --------------------------------------------------------------------------------------------
# Real wheels: A (0.23.0), B (0.27.1), C (0.29.0), D (0.31.0) are pending and go through the
# whole cycle; 0.33.0 carries upstream's fix.


@pytest.mark.wheel
@pytest.mark.parametrize("version", ["0.23.0", "0.27.1", "0.29.0", "0.31.0"])
def test_full_cycle_on_real_wheel(make_tree, version):
    site = make_tree(version)
    target = site / REL
    original = tree_hashes(site)

    before = status_json(site)
    assert before["_rc"] == 1
    assert before["vllm"]["version"] == version
    assert before["patches"][0]["verdict"] == "pending"
    for result in before["patches"][0]["sites"]:
        assert result["verdict"] == "pending"
        assert result["shape"] == SHAPE_OF[version]

    check = run_cli("apply", "--vllm", str(site), "--check", *ONLY)
    assert check.returncode == 1
    assert tree_hashes(site) == original, "--check wrote something"

    first = run_cli("apply", "--vllm", str(site), *ONLY)
    assert first.returncode == 0, first.stdout + first.stderr
    assert sha(target) != original[REL]
    assert verdicts_of(site) == ("applied", "applied")

    once = tree_hashes(site)
    second = run_cli("apply", "--vllm", str(site), *ONLY)
    assert second.returncode == 0
    assert tree_hashes(site) == once, "a second apply changed bytes"

    back = run_cli("revert", "--vllm", str(site))
    assert back.returncode == 0, back.stderr
    assert tree_hashes(site) == original, "revert is not byte-identical"


@pytest.mark.wheel
@pytest.mark.parametrize("version", ["0.33.0"])
def test_upstream_fix_is_satisfied_and_nothing_is_written(make_tree, version):
    site = make_tree(version)
    before = tree_hashes(site)
    data = status_json(site)
    assert data["_rc"] == 0
    assert data["patches"][0]["verdict"] == "satisfied"
    for result in data["patches"][0]["sites"]:
        assert result["shape"] == gate.SATISFIED_UPSTREAM
    proc = run_cli("apply", "--vllm", str(site), *ONLY)
    assert proc.returncode == 0
    assert tree_hashes(site) == before
    assert not (site / "vllm" / ".k3patch").exists()


def _gate_lines(text: str) -> set[int]:
    """1-based lines of the two gate headers and their named temporaries in `text`."""
    module = ast.parse(text)
    method = gate._method(module)
    assert method is not None
    context = gate._Context.of(module, method)
    lines: set[int] = set()
    for site in (gate.G1, gate.G2):
        found, _ = gate._locate(context, site)
        assert found is not None
        for temp in found.temps:
            lines.update(range(temp.lineno, (temp.end_lineno or temp.lineno) + 1))
        lines.update(range(found.node.lineno, found.node.body[0].lineno))
    return lines


def _allowed_insertions() -> set[str]:
    texts = [gate.G1_TEMPLATE, gate.G2_TEMPLATE, *gate.MARKER_G1, *gate.MARKER_G2]
    return {line.strip() for t in texts for line in t.splitlines() if line.strip()} - {"pass"}


@pytest.mark.wheel
@pytest.mark.parametrize("version", ["0.23.0", "0.27.1", "0.29.0", "0.31.0"])
def test_only_the_gate_headers_change(make_tree, version):
    site = make_tree(version)
    target = site / REL
    before = target.read_text()
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    after = target.read_text()

    old, new = before.splitlines(), after.splitlines()
    allowed_old = _gate_lines(before)
    inserted_ok = _allowed_insertions()
    matcher = difflib.SequenceMatcher(a=old, b=new, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        removed = set(range(i1 + 1, i2 + 1))
        assert removed <= allowed_old, f"touched lines outside the gates: {sorted(removed)}"
        for line in new[j1:j2]:
            assert line.strip() in inserted_ok, f"unexpected new line: {line!r}"

    # Every other definition of the module is byte-identical: update_state_after_alloc (with
    # its `[0]` block lists), the READ paths, the worker. Inside bCM, the lines above hold the
    # rest (the accumulation with `new_block_ids[0]` or its per-group lists stays).
    def others(text: str) -> list[str]:
        return [
            ast.get_source_segment(text, node) or ""
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.FunctionDef) and node.name != gate.METHOD
        ]

    assert others(before) == others(after)
    # The only new `[0]` is the post-image's `req = self._reqs_need_pending_save[req_id][0]`.
    assert after.count("[0]") == before.count("[0]") + 1
    assert "k3patch moriio-chunk-gate" in after


@pytest.mark.wheel
def test_post_image_reads_only_names_the_method_binds(make_tree):
    # The older script's pitfall was a bare `os` the module never imports; ours adds none.
    site = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    text = (site / REL).read_text()
    added = set()
    for tmpl in (gate.G1_TEMPLATE, gate.G2_TEMPLATE):
        added |= {
            n.id
            for n in ast.walk(ast.parse(textwrap.dedent(tmpl)))
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
        }
    assert added == {"req", "req_id", "self", "scheduler_output"}
    method = gate._method(ast.parse(text))
    assert method is not None
    assert "scheduler_output" in {a.arg for a in method.args.args}


@pytest.mark.wheel
def test_reformatted_post_image_still_applied(make_tree):
    site = make_tree("0.29.0")
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    target = site / REL
    text = target.read_text()
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    subprocess.run([ruff, "format", "--line-length", "120", "--no-cache", str(target)], check=True)
    assert target.read_text() != text, "ruff changed nothing: the test proves nothing"
    target.write_text(
        target.read_text().replace("# k3patch moriio-chunk-gate:", "# (reworded comment)")
    )
    assert verdicts_of(site) == ("applied", "applied")


@pytest.mark.wheel
def test_marker_comment_on_unpatched_code_is_not_applied(make_tree):
    site = make_tree("0.31.0")
    target = site / REL
    text = target.read_text()
    for line in ("saved_tokens = (", "tokens_covered = ("):
        text = re.sub(
            rf"^( *){re.escape(line)}",
            rf"\1# k3patch moriio-chunk-gate applied\n\1{line}",
            text,
            count=1,
            flags=re.M,
        )
    assert text.count("k3patch moriio-chunk-gate applied") == 2
    target.write_text(text)
    assert verdicts_of(site) == ("pending", "pending")


@pytest.mark.wheel
@pytest.mark.parametrize(
    ("version", "old", "new", "site_name", "detail"),
    [
        # G1 compares with `>`: a known operand, an unknown decision.
        (
            "0.31.0",
            "if saved_tokens >= req.num_prompt_tokens:",
            "if saved_tokens > req.num_prompt_tokens:",
            gate.G1,
            "no shape",
        ),
        # G2 with a slack of its own.
        (
            "0.29.0",
            "if req.num_prompt_tokens > len(block_ids) * self.block_size:",
            "if req.num_prompt_tokens > len(block_ids) * self.block_size + 2:",
            gate.G2,
            "no shape",
        ),
        # A half fix: progress, but still only when a block was allocated.
        (
            "0.29.0",
            "len(self._reqs_need_pending_save[req_id][1]) * self.block_size\n",
            "req.num_computed_tokens + scheduler_output.num_scheduled_tokens[req_id]\n",
            gate.G1,
            "only evaluated when the step allocated a new block",
        ),
        # The gate's body reads what only the block branch binds: moving it would break it.
        (
            "0.29.0",
            "local_block_ids=self._reqs_need_pending_save[req_id][1],",
            "local_block_ids=updated_blocks,",
            gate.G1,
            "reads updated_blocks",
        ),
    ],
)
def test_unknown_gate_is_drift_and_nothing_is_written(
    make_tree, version, old, new, site_name, detail
):
    site = make_tree(version)
    target = site / REL
    text = target.read_text()
    assert text.count(old) >= 1
    target.write_text(text.replace(old, new, 1))
    before = tree_hashes(site)
    data = status_json(site)
    assert data["_rc"] == 1
    result = {s["site"]: s for s in data["patches"][0]["sites"]}[site_name]
    assert result["verdict"] == "drifted"
    assert detail in result["detail"]
    assert result["expected"], "a drift report must say what was expected"
    proc = run_cli("apply", "--vllm", str(site), *ONLY)
    assert proc.returncode == 1
    assert tree_hashes(site) == before


@pytest.mark.wheel
def test_upstream_helper_with_another_meaning_is_drift(make_tree):
    site = make_tree("0.33.0")
    target = site / REL
    text = target.read_text()
    old = "return req.num_computed_tokens + num_scheduled >= req.num_prompt_tokens"
    assert old in text
    target.write_text(text.replace(old, "return len(req.block_ids) >= req.num_prompt_tokens"))
    assert verdicts_of(site) == ("drifted", "drifted")


@pytest.mark.wheel
def test_no_moriio_is_not_applicable_and_no_scheduler_is_drift(make_tree):
    site = make_tree("0.31.0")
    target = site / REL
    text = target.read_text()
    target.write_text(text.replace("class MoRIIOConnectorScheduler:", "class Renamed:"))
    assert verdicts_of(site) == ("drifted", "drifted")
    target.unlink()
    data = status_json(site)
    assert data["patches"][0]["verdict"] == "not applicable"
    assert "0.14.1" in data["patches"][0]["sites"][0]["detail"]


# --------------------------------------------------------------------------------------------
# Fixtures: the fork (pending, shape C gates) and the older k3-chunk-gate script (satisfied).


def test_fork_fixture_cycle(tmp_path):
    site = fixture_copy("chunk-gate-fork", tmp_path)
    target = site / REL
    original = tree_hashes(site)
    sites = sites_of(site)
    assert [sites[s]["verdict"] for s in (gate.G1, gate.G2)] == ["pending", "pending"]
    assert sites[gate.G1]["shape"] == "the fork (shape C gates)"

    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    assert verdicts_of(site) == ("applied", "applied")
    text = target.read_text()
    # The fork's own block-id code (SITES.md 1) is not this patch's to touch.
    for kept in (
        "block_ids = new_block_ids[0]",
        "list(_k3_gbi[1]) if len(_k3_gbi) > 1 else []",
        "mamba_local_block_ids=self._reqs_save_mamba.pop(req_id, []),",
    ):
        assert text.count(kept) == (FIXTURES / "chunk-gate-fork" / REL).read_text().count(kept)
    once = tree_hashes(site)
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    assert tree_hashes(site) == once
    assert run_cli("revert", "--vllm", str(site)).returncode == 0
    assert tree_hashes(site) == original


def test_legacy_fixture_is_satisfied_and_left_alone(tmp_path):
    site = fixture_copy("chunk-gate-legacy", tmp_path)
    before = tree_hashes(site)
    data = status_json(site)
    assert data["_rc"] == 0
    for result in data["patches"][0]["sites"]:
        assert result["verdict"] == "satisfied"
        assert result["shape"] == gate.SATISFIED_LEGACY
        assert "K3_CHUNK_GATE_SLACK" in result["detail"]
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    assert tree_hashes(site) == before


@pytest.mark.parametrize(
    ("old", "new", "expect"),
    [
        # SITES.md 2: the script calls os.environ where upstream never imports os.
        ("import os\n", "", ("drifted", "drifted", "uses os")),
        # Half applied: G1 still waits for a new block, and the sweep is gone.
        (
            "            for req_id in list(self._reqs_need_pending_save):\n",
            "            for req_id in []:\n",
            ("drifted", "satisfied", "sweep"),
        ),
        (
            "        self._k3_prog = dict(",
            "        self._k3_other = dict(",
            ("drifted",) * 2 + ("_k3_prog",),
        ),
        (
            "def _k3_prefill_done(self",
            "def _k3_prefill_done_old(self",
            ("drifted",) * 2 + ("defines no",),
        ),
    ],
)
def test_legacy_pitfalls_are_drift(tmp_path, old, new, expect):
    site = fixture_copy("chunk-gate-legacy", tmp_path)
    target = site / REL
    text = target.read_text()
    assert old in text
    target.write_text(text.replace(old, new, 1))
    sites = sites_of(site)
    assert (sites[gate.G1]["verdict"], sites[gate.G2]["verdict"]) == expect[:2]
    assert expect[2] in sites[gate.G1]["detail"]
    before = tree_hashes(site)
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 1
    assert tree_hashes(site) == before


# --------------------------------------------------------------------------------------------
# The shape table, in memory: each row is a G1 or G2 loop body and the verdict it must read.

MODULE = """
class MoRIIOConnectorScheduler:
    def _is_final_prefill_chunk(self, req, scheduler_output):
        n = scheduler_output.num_scheduled_tokens.get(req.request_id, 0)
        return req.num_computed_tokens + n >= req.num_prompt_tokens

    def build_connector_meta(self, scheduler_output):
        meta = MoRIIOConnectorMetadata()
        if self.mode == MoRIIOMode.WRITE and get_role() == ROLE.PRODUCER:
            for i, req_id in enumerate(scheduler_output.scheduled_cached_reqs.req_ids):
{g1}
        for req_id, (req, block_ids) in self._reqs_need_save.items():
{g2}
        return meta
"""

G1_C = """
new_block_ids = scheduler_output.scheduled_cached_reqs.new_block_ids[i]
if new_block_ids is not None:
    block_ids = new_block_ids[0]
    if req_id not in self._reqs_need_pending_save:
        continue
    req, existing_blocks = self._reqs_need_pending_save[req_id]
    updated_blocks = list(existing_blocks) + (block_ids)
    self._reqs_need_pending_save[req_id] = (req, updated_blocks)
    if (
        len(self._reqs_need_pending_save[req_id][1]) * self.block_size
        >= req.num_prompt_tokens
    ):
        meta.add_new_req(req_id, self._reqs_need_pending_save[req_id][1], {}, write_mode=True)
        del self._reqs_need_pending_save[req_id]
"""
G2_C = """
kv_params = self._req_kv_params.get(req_id, req.kv_transfer_params or {})
if req.num_prompt_tokens > len(block_ids) * self.block_size:
    self._reqs_need_pending_save[req_id] = (req, block_ids)
    continue
meta.add_new_req(req_id, block_ids, kv_params, write_mode=True)
"""
G1_PROGRESS = """
if req_id not in self._reqs_need_pending_save:
    continue
req, existing_blocks = self._reqs_need_pending_save[req_id]
new_block_ids = scheduler_output.scheduled_cached_reqs.new_block_ids[i]
if new_block_ids is not None:
    existing_blocks = [a + b for a, b in zip(existing_blocks, new_block_ids)]
    self._reqs_need_pending_save[req_id] = (req, existing_blocks)
if not {test}:
    continue
meta.add_new_req(req_id, existing_blocks, {{}}, write_mode=True)
del self._reqs_need_pending_save[req_id]
"""
G1_NESTED = """
new_block_ids = scheduler_output.scheduled_cached_reqs.new_block_ids[i]
if new_block_ids is not None:
    req, existing_blocks = self._reqs_need_pending_save[req_id]
    self._reqs_need_pending_save[req_id] = (req, list(existing_blocks) + new_block_ids[0])
    if req.kv_transfer_params:
        if len(self._reqs_need_pending_save[req_id][1]) * self.block_size >= req.num_prompt_tokens:
            del self._reqs_need_pending_save[req_id]
"""
G1_APPLIED = """
new_block_ids = scheduler_output.scheduled_cached_reqs.new_block_ids[i]
if new_block_ids is not None:
    req, existing_blocks = self._reqs_need_pending_save[req_id]
    self._reqs_need_pending_save[req_id] = (req, list(existing_blocks) + new_block_ids[0])
if req_id in self._reqs_need_pending_save:
    req = self._reqs_need_pending_save[req_id][0]
    if (
        req.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        >= req.num_prompt_tokens
    ):
        del self._reqs_need_pending_save[req_id]
"""
G1_PROGRESS_NESTED = """
if req_id not in self._reqs_need_pending_save:
    continue
req, existing_blocks = self._reqs_need_pending_save[req_id]
if not self._has_mamba:
    if req.num_computed_tokens + scheduler_output.num_scheduled_tokens[req_id] >= req.num_prompt_tokens:
        del self._reqs_need_pending_save[req_id]
"""
G1_GUARD_EDITED = G1_APPLIED.replace("    req = self._reqs_need_pending_save[req_id][0]\n", "")
INLINE = (
    "(req.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(req_id, 0) "
    ">= req.num_prompt_tokens)"
)


def module_with(g1: str = G1_C, g2: str = G2_C) -> str:
    return MODULE.format(
        g1=textwrap.indent(textwrap.dedent(g1).strip("\n"), " " * 16),
        g2=textwrap.indent(textwrap.dedent(g2).strip("\n"), " " * 12),
    )


SHAPE_TABLE = [
    ("C gates", G1_C, G2_C, ("pending", "pending")),
    (
        "one-line G1 compare, comments",
        G1_C.replace(
            "if (\n        len(self._reqs_need_pending_save[req_id][1]) * self.block_size\n"
            "        >= req.num_prompt_tokens\n    ):",
            "if len(self._reqs_need_pending_save[req_id][1]) * self.block_size >= "
            "req.num_prompt_tokens:  # k3patch moriio-chunk-gate",
        ),
        G2_C,
        ("pending", "pending"),
    ),
    (
        "upstream helper",
        G1_PROGRESS.format(test="self._is_final_prefill_chunk(req, scheduler_output)"),
        G2_C.replace(
            "req.num_prompt_tokens > len(block_ids) * self.block_size",
            "not self._is_final_prefill_chunk(req, scheduler_output)",
        ),
        ("satisfied", "satisfied"),
    ),
    ("inline progress", G1_PROGRESS.format(test=INLINE), G2_C, ("satisfied", "pending")),
    (
        "G2 inline progress",
        G1_C,
        G2_C.replace("req.num_prompt_tokens > len(block_ids) * self.block_size", "not " + INLINE),
        ("pending", "satisfied"),
    ),
    ("progress gate under another condition", G1_PROGRESS_NESTED, G2_C, ("drifted", "pending")),
    (
        "G1 gate not last in its branch",
        G1_C + "    logger.debug('pending %s', req_id)\n",
        G2_C,
        ("drifted", "pending"),
    ),
    ("G1 gate under an extra condition", G1_NESTED, G2_C, ("drifted", "pending")),
    (
        "G1 gate with an else",
        G1_C + "    else:\n        pass\n",
        G2_C,
        ("drifted", "pending"),
    ),
    (
        "two G1 gates",
        G1_C + "if req.num_prompt_tokens == 0:\n    continue\n",
        G2_C,
        ("drifted", "pending"),
    ),
    (
        "G2 written the other way round",
        G1_C,
        G2_C.replace(
            "if req.num_prompt_tokens > len(block_ids) * self.block_size:",
            "if len(block_ids) * self.block_size < req.num_prompt_tokens:",
        ),
        ("pending", "drifted"),
    ),
    (
        "G2 block size of D without D's temporary",
        G1_C,
        G2_C.replace("self.block_size", "self._full_attn_block_size"),
        ("pending", "drifted"),
    ),
    ("k3patch's guard edited (req not rebound)", G1_GUARD_EDITED, G2_C, ("drifted", "pending")),
    ("k3patch's post-image", G1_APPLIED, G2_C, ("applied", "pending")),
]


PENDING_ROWS = [row for row in SHAPE_TABLE if "pending" in row[3]]


@pytest.mark.parametrize(("name", "g1", "g2", "want"), SHAPE_TABLE, ids=[r[0] for r in SHAPE_TABLE])
def test_shape_table(name, g1, g2, want):
    text = module_with(g1, g2)
    compile(text, "table", "exec")
    results = classify_text(text)
    got = (results[gate.G1].verdict.value, results[gate.G2].verdict.value)
    assert got == want, (results[gate.G1].detail, results[gate.G2].detail)


@pytest.mark.parametrize(
    ("name", "g1", "g2", "want"), PENDING_ROWS, ids=[r[0] for r in PENDING_ROWS]
)
def test_every_pending_row_rewrites_to_applied(name, g1, g2, want):
    text = module_with(g1, g2)
    sources = Sources(lambda rel: text.encode() if rel == gate.FILE else None)
    pending = [r for r in gate.PATCH.classify(sources) if r.verdict is Verdict.PENDING]
    new = gate.PATCH.rewrite(sources, pending)[gate.FILE]
    compile(new, "rewritten", "exec")
    after = classify_text(new)
    for site, before in zip((gate.G1, gate.G2), want, strict=True):
        expected = "applied" if before == "pending" else before
        assert after[site].verdict.value == expected


def test_shapes_are_distinct_and_read_like_sites_md():
    prints = [s.fingerprint for shapes in gate.SHAPES.values() for s in shapes]
    assert len(set(prints)) == len(prints)
    assert {s.verdict for s in gate.SHAPES[gate.G1]} == {Verdict.PENDING, Verdict.APPLIED}
