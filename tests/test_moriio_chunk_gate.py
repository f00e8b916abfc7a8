"""moriio-chunk-gate: shapes A-D on real wheels, the fork and the older script's fixed form on
fixtures, upstream's fix on 0.32/0.33; the full pending -> apply -> applied -> revert cycle;
that only the two gate statements change; and that every unknown gate form is drift. Tables
(tests/patch_table.py): tree -> verdict and defects, the rewrite as (before, after) Change rows
with must-not-touch rows on the real 0.29.0, 0.31.0 and fork d trees, and the shape table."""

from __future__ import annotations

import ast
import difflib
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import forktree
import pytest
from conftest import built_fork_tree, pristine_tree, run_cli, slow_after, tree_hashes
from conftest import sites_of as _sites_of
from conftest import status_json as _status_json
from cycle import assert_full_cycle
from patch_table import Change, assert_rewrite, assert_untouched

from k3patch.astkit import find_def
from k3patch.codemod import Codemods
from k3patch.patches import moriio_chunk_gate as gate
from k3patch.patches.moriio_chunk_gate import gates
from k3patch.patches.moriio_chunk_gate import sites as gate_sites
from k3patch.sources import Sources
from k3patch.verdicts import Verdict

ONLY = ["--only", "moriio-chunk-gate"]
REL = "vllm/" + gate.FILE
SHAPE_OF = {
    "0.23.0": "A (0.14.1-0.23.0)",
    "0.27.1": "B (0.24.0-0.27.1)",
    "0.28.0": "C (0.28.0-0.29.0)",
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


def classify_text(text: str) -> dict[str, object]:
    sources = Sources(lambda rel: text.encode() if rel == gate.FILE else None)
    return {r.site: r for r in gate.PATCH.classify(sources)}


def rewritten(text: str) -> str:
    """The connector after the patch's codemod of its pending sites, as the engine runs it
    (`text` itself when nothing is pending)."""
    sources = Sources(lambda rel: text.encode() if rel == gate.FILE else None)
    pending = [r for r in gate.PATCH.classify(sources) if r.verdict is Verdict.PENDING]
    if not pending:
        return text
    files = Codemods(sources)
    gate.PATCH.rewrite(sources, pending, files)
    return files.texts()[gate.FILE]


# --------------------------------------------------------------------------------------------
# Real wheels: A (0.23.0), B (0.27.1), C (0.29.0), D (0.31.0) are pending and go through the
# whole cycle; 0.33.0 carries upstream's fix.


@pytest.mark.wheel
@pytest.mark.parametrize("version", slow_after(["0.23.0", "0.27.1", "0.28.0", "0.29.0", "0.31.0"]))
def test_full_cycle_on_real_wheel(make_tree, version):
    cycle = assert_full_cycle(make_tree(version), gate.PATCH.id, written=[REL])
    assert cycle.pending["vllm"]["version"] == version
    for result in cycle.pending["patches"][0]["sites"]:
        assert (result["verdict"], result["shape"]) == ("pending", SHAPE_OF[version]), result
    assert [s["verdict"] for s in cycle.applied["patches"][0]["sites"]] == ["applied"] * 2


@pytest.mark.wheel
@pytest.mark.parametrize("version", ["0.32.0", "0.33.0", "0.34.0"])
def test_upstream_fix_is_satisfied_and_nothing_is_written(make_tree, version):
    site = make_tree(version)
    before = tree_hashes(site)
    data = status_json(site)
    assert data["_rc"] == 0
    assert data["patches"][0]["verdict"] == "satisfied"
    for result in data["patches"][0]["sites"]:
        assert result["shape"] == "upstream fix (_is_final_prefill_chunk, 0.32.0 and later)"
    proc = run_cli("apply", "--vllm", str(site), *ONLY)
    assert proc.returncode == 0
    assert tree_hashes(site) == before
    assert not (site / "vllm" / ".k3patch").exists()


def _gate_lines(text: str) -> set[int]:
    """1-based lines of the two gate headers and their named temporaries in `text`."""
    context = gates.Context.of(ast.parse(text))
    lines: set[int] = set()
    for site in (gate.G1, gate.G2):
        found, _ = gates.locate(context, site)
        assert found is not None
        for temp in found.temps:
            lines.update(range(temp.lineno, (temp.end_lineno or temp.lineno) + 1))
        lines.update(range(found.node.lineno, found.node.body[0].lineno))
    return lines


def _allowed_insertions() -> set[str]:
    texts = [gate.G1_TEMPLATE, gate.G2_TEMPLATE]
    return {line.strip() for t in texts for line in t.splitlines() if line.strip()} - {"pass"}


@pytest.mark.wheel
@pytest.mark.parametrize("version", slow_after(["0.23.0", "0.27.1", "0.29.0", "0.31.0"]))
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
    method = find_def(ast.parse(text), f"{gate.CLASS}.{gate.METHOD}")
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


UPSTREAM_RETURN = "return req.num_computed_tokens + num_scheduled >= req.num_prompt_tokens"


@pytest.mark.wheel
@pytest.mark.parametrize(
    "new",
    [
        "return len(req.block_ids) >= req.num_prompt_tokens",
        # Inverted, equal, unequal, off by one, sides swapped, a slack: all wrong, all drift.
        "return req.num_computed_tokens + num_scheduled < req.num_prompt_tokens",
        "return req.num_computed_tokens + num_scheduled == req.num_prompt_tokens",
        "return req.num_computed_tokens + num_scheduled != req.num_prompt_tokens",
        "return req.num_computed_tokens + num_scheduled > req.num_prompt_tokens",
        "return req.num_prompt_tokens >= req.num_computed_tokens + num_scheduled",
        "return req.num_computed_tokens + num_scheduled >= req.num_prompt_tokens - 2",
        "return req.num_computed_tokens + num_scheduled + 1 >= req.num_prompt_tokens",
        "return req.num_computed_tokens >= req.num_prompt_tokens",
        # The same inequality written the other way round: no declared shape (0.32.0-0.34.0
        # write it one way), so drift, never a guess at what it means.
        "return req.num_prompt_tokens <= num_scheduled + req.num_computed_tokens",
    ],
)
def test_upstream_helper_in_another_shape_is_drift(make_tree, new):
    site = make_tree("0.33.0")
    target = site / REL
    text = target.read_text()
    assert text.count(UPSTREAM_RETURN) == 1
    target.write_text(text.replace(UPSTREAM_RETURN, new))
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
# The operators' real trees (tests/forktree: the 0.28.0 wheel + the recipe's older scripts).
# a, b, c never ran the older chunk-gate script: shape C gates in the fork's surroundings.
# d ran it (K3_EXTRA_FIXES=1): its real form is pending, with both defects named.

LEGACY_PENDING = "older k3-chunk-gate script (legacy, defective)"
LEGACY_DEFECTS = (
    "fires up to K3_CHUNK_GATE_SLACK (default 2) tokens early",
    "falls back to the block-count gate (the original bug) when its progress map lacks the request",
)
FORK_VERDICTS = {
    "a": ("the fork (shape C gates)", ()),
    "b": ("the fork (shape C gates)", ()),
    "c": ("the fork (shape C gates)", ()),
    "a-comments": ("the fork (shape C gates)", ()),
    "a-nodebug": ("the fork (shape C gates)", ()),
    "d": (LEGACY_PENDING, LEGACY_DEFECTS),
}
APPLIED_SHAPE = {name: "k3patch" for name in FORK_VERDICTS} | {
    "d": "k3patch (the older k3-chunk-gate form, repaired in place)"
}


@pytest.mark.wheel
@pytest.mark.parametrize("name", sorted(FORK_VERDICTS))
def test_fork_tree_verdicts(fork_tree, name):
    shape, defects = FORK_VERDICTS[name]
    data = status_json(fork_tree(name))
    assert data["_rc"] == 1
    assert data["patches"][0]["verdict"] == "pending"
    for result in data["patches"][0]["sites"]:
        assert (result["verdict"], result["shape"]) == ("pending", shape), result
        for defect in defects:
            assert defect in result["detail"]


def test_legacy_defects_read_as_issue_12_names_them():
    assert gate_sites.LEGACY_DEFECTS == (
        "fires up to K3_CHUNK_GATE_SLACK (default 2) tokens early",
        "falls back to the block-count gate (the original bug) when its progress map lacks "
        "the request",
    )


@pytest.mark.wheel
@pytest.mark.parametrize("name", slow_after(sorted(FORK_VERDICTS)))
def test_fork_tree_cycle(fork_tree, name):
    site = fork_tree(name)

    def while_applied(status: dict) -> None:
        text = (site / REL).read_text()
        # The older scripts' own block-id code is not this patch's to touch.
        before = (built_fork_tree(name) / REL).read_text()
        for kept in ("block_ids = new_block_ids[0]", "self._reqs_save_mamba.get(req_id, [])"):
            assert text.count(kept) == before.count(kept) >= 1

    cycle = assert_full_cycle(site, gate.PATCH.id, written=[REL], while_applied=while_applied)
    for result in cycle.applied["patches"][0]["sites"]:
        assert (result["verdict"], result["shape"]) == ("applied", APPLIED_SHAPE[name]), result


@pytest.mark.wheel
def test_legacy_repair_is_in_place_and_changes_only_the_decisions(fork_tree):
    site = fork_tree("d")
    target = site / REL
    before = target.read_text()
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    after = target.read_text()
    old = before.splitlines()
    matcher = difflib.SequenceMatcher(a=old, b=after.splitlines(), autojunk=False)
    removed = [
        ln for tag, i1, i2, _, _ in matcher.get_opcodes() if tag != "equal" for ln in old[i1:i2]
    ]
    # The three decisions (G1, the sweep, G2) and the two block-count fallbacks go, nothing
    # else: the helper, the progress map and the debug lines stay.
    assert sorted(ln.strip() for ln in removed) == sorted(
        [
            "_k3done2 = _k3_prefill_done(self, req_id, req)  # k3-chunk-gate",
            "if _k3done2 is None:",
            "_k3done2 = (",
            "len(self._reqs_need_pending_save[req_id][1]) * self.block_size",
            ">= req.num_prompt_tokens",
            ")",
            "_k3sw_done = _k3_prefill_done(self, _k3sw_rid, _k3sw_req)",
            "_k3done = _k3_prefill_done(self, req_id, req)",
            "if _k3done is None:",
            "_k3done = not (req.num_prompt_tokens > len(block_ids) * self.block_size)",
        ]
    )
    assert after.count("def _k3_prefill_done(") == 1
    assert "self._k3_prog = {}" in after
    assert after.count("K3_CHUNK_GATE_SLACK") == before.count("K3_CHUNK_GATE_SLACK") == 1
    module = ast.parse(after)
    method = find_def(module, f"{gate.CLASS}.{gate.METHOD}")
    assert method is not None
    # Nothing decides through the helper any more: its only caller is gone.
    calls = [
        n
        for n in ast.walk(method)
        if isinstance(n, ast.Call) and getattr(n.func, "id", "") == gate_sites.LEGACY_HELPER
    ]
    assert calls == []


def _edit_d(fork_tree, old: str, new: str) -> Path:
    """Tree d with every `old` replaced by `new` (the map is set twice: at the top of the
    producer branch and in its `except`)."""
    site = fork_tree("d")
    target = site / REL
    text = target.read_text()
    assert text.count(old) in (1, 2), old
    target.write_text(text.replace(old, new))
    return site


# Edits of tree d (the older script's real form) that leave no form the script writes: each is
# drift, and nothing is written.
LEGACY_DRIFT = [
    # The helper's comparison inverted, off by one, or slack made larger.
    (
        "(cb + st) >= (int(req.num_prompt_tokens) - slack)",
        "(cb + st) < (int(req.num_prompt_tokens) - slack)",
        ("drifted", "drifted", "is not the script's"),
    ),
    (
        "(cb + st) >= (int(req.num_prompt_tokens) - slack)",
        "(cb + st) > (int(req.num_prompt_tokens) - slack)",
        ("drifted", "drifted", "is not the script's"),
    ),
    # The progress map never set: the helper always answers None.
    ("self._k3_prog = {}\n", "self._k3_other = {}\n", ("drifted", "drifted", "_k3_prog")),
    # G1's decision inverted where its body sends.
    (
        "            if _k3done2:\n",
        "            if not _k3done2:\n",
        ("drifted", "pending", "inverted"),
    ),
    # G2's gate turned round: it would defer the final chunk.
    (
        "            if not _k3done:\n",
        "            if _k3done:\n",
        ("pending", "drifted", "inverted"),
    ),
    # A decision that is neither the helper nor progress.
    (
        "_k3done = _k3_prefill_done(self, req_id, req)",
        "_k3done = req.num_computed_tokens < req.num_prompt_tokens",
        ("pending", "drifted", "neither"),
    ),
    # G1's fallback edited.
    (
        "                            >= req.num_prompt_tokens\n                        )\n",
        "                            > req.num_prompt_tokens\n                        )\n",
        ("drifted", "pending", "fallback"),
    ),
    # The sweep gone: a final chunk without a new block would never be sent.
    (
        "for _k3sw_rid in list(self._reqs_need_pending_save.keys()):",
        "for _k3sw_rid in []:",
        ("drifted", "pending", "sweeps"),
    ),
]


@pytest.mark.wheel
@pytest.mark.parametrize(("old", "new", "expect"), slow_after(LEGACY_DRIFT, unpack=True))
def test_legacy_edits_are_drift_and_nothing_is_written(fork_tree, old, new, expect):
    site = _edit_d(fork_tree, old, new)
    sites = sites_of(site)
    got = (sites[gate.G1]["verdict"], sites[gate.G2]["verdict"])
    assert got == expect[:2], (sites[gate.G1]["detail"], sites[gate.G2]["detail"])
    drifted = [s for s in sites.values() if s["verdict"] == "drifted"]
    assert all(expect[2] in s["detail"] for s in drifted), [s["detail"] for s in drifted]
    assert all(s["expected"] and s["found"] for s in drifted)
    before = tree_hashes(site)
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 1
    assert tree_hashes(site) == before


@pytest.mark.wheel
@pytest.mark.parametrize(
    ("old", "new"),
    slow_after(
        [
            (">= req.num_prompt_tokens\n", "> req.num_prompt_tokens\n"),
            (">= req.num_prompt_tokens\n", "== req.num_prompt_tokens\n"),
            (">= req.num_prompt_tokens\n", "<= req.num_prompt_tokens\n"),
            (">= req.num_prompt_tokens\n", ">= req.num_prompt_tokens - 2\n"),
        ],
        unpack=True,
    ),
)
def test_repaired_legacy_edited_wrongly_is_drift(fork_tree, old, new):
    site = fork_tree("d")
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    target = site / REL
    text = target.read_text()
    # The repaired G2 decision: the last progress comparison in the file.
    at = text.rindex(old)
    target.write_text(text[:at] + new + text[at + len(old) :])
    assert verdicts_of(site) == ("applied", "drifted")


@pytest.mark.wheel
def test_chunk_gate_script_without_the_maps_it_reads_is_drift(make_tree):
    # The script's sweep reads self._reqs_save_mamba and self._reqs_save_allgrp (added by the
    # mamba-blockids and group-routing scripts): alone on 0.28.0 it raises inside its try on
    # every step and a final chunk without a new block is never sent.
    site = make_tree("0.28.0")
    forktree.run_steps(site / "vllm", ["chunk_gate_fix"])
    sites = sites_of(site)
    assert sites[gate.G1]["verdict"] == "drifted"
    assert "self._reqs_save_allgrp, self._reqs_save_mamba" in sites[gate.G1]["detail"]
    assert sites[gate.G2]["verdict"] == "pending"
    assert sites[gate.G2]["shape"] == LEGACY_PENDING


@pytest.mark.wheel
def test_chunk_gate_script_without_os_is_drift(fork_tree):
    site = _edit_d(fork_tree, "\nimport os\n", "\n")
    sites = sites_of(site)
    assert verdicts_of(site) == ("drifted", "drifted")
    assert "reads os" in sites[gate.G2]["detail"]


@pytest.mark.wheel
def test_fork_is_told_by_statements_not_by_a_name(make_tree, fork_tree):
    # A bare mention of the fork's map does not make 0.28.0 the fork ...
    site = make_tree("0.28.0")
    target = site / REL
    text = target.read_text()
    anchor = "        self._reqs_need_pending_save: dict[ReqId, tuple[Request, list[int]]] = {}\n"
    assert text.count(anchor) == 1
    target.write_text(text.replace(anchor, anchor + "        self._reqs_save_mamba = {}\n"))
    assert {s["shape"] for s in sites_of(site).values()} == {"C (0.28.0-0.29.0)"}
    # ... and the fork without its map in __init__ is not the fork either.
    fork = fork_tree("a")
    target = fork / REL
    text = target.read_text()
    line = "self._reqs_save_mamba: dict[ReqId, list[int]] = {}"
    assert text.count(line) == 1
    target.write_text(text.replace(line, "self._reqs_save_mamba_unused = 0"))
    assert {s["shape"] for s in sites_of(fork).values()} == {"C (0.28.0-0.29.0)"}


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
    if (
        req.num_computed_tokens + scheduler_output.num_scheduled_tokens[req_id]
        >= req.num_prompt_tokens
    ):
        del self._reqs_need_pending_save[req_id]
"""
G1_GUARD_EDITED = G1_APPLIED.replace("    req = self._reqs_need_pending_save[req_id][0]\n", "")
INLINE = (
    "(req.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(req_id, 0) "
    ">= req.num_prompt_tokens)"
)


PROGRESS = "req.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(req_id, 0)"
G2_TEST = "req.num_prompt_tokens > len(block_ids) * self.block_size"
# G1's upstream-style gate is `if not <final>: continue`; each of these decides wrongly.
INVERTED_G1 = [
    ("`<` where `>=` belongs", f"({PROGRESS} < req.num_prompt_tokens)"),
    ("`==`", f"({PROGRESS} == req.num_prompt_tokens)"),
    ("`!=`", f"({PROGRESS} != req.num_prompt_tokens)"),
    ("`>` (off by one at the last token)", f"({PROGRESS} > req.num_prompt_tokens)"),
    ("sides swapped", f"(req.num_prompt_tokens >= {PROGRESS})"),
    ("a slack of 2", f"({PROGRESS} >= req.num_prompt_tokens - 2)"),
    ("computed tokens only", "(req.num_computed_tokens >= req.num_prompt_tokens)"),
]
# G2 defers while its test holds: it must mean "not final yet".
INVERTED_G2 = [
    ("final where it defers", f"{PROGRESS} >= req.num_prompt_tokens"),
    ("`<=` (off by one)", f"{PROGRESS} <= req.num_prompt_tokens"),
    ("sides swapped", f"req.num_prompt_tokens < {PROGRESS}"),
    ("`!=`", f"{PROGRESS} != req.num_prompt_tokens"),
]


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
    # Progress gates written inline: no release writes them, so they are no declared shape.
    ("inline progress", G1_PROGRESS.format(test=INLINE), G2_C, ("drifted", "pending")),
    (
        "G2 inline progress",
        G1_C,
        G2_C.replace("req.num_prompt_tokens > len(block_ids) * self.block_size", "not " + INLINE),
        ("pending", "drifted"),
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
    *[
        (f"G1 progress gate, {why}", G1_PROGRESS.format(test=test), G2_C, ("drifted", "pending"))
        for why, test in INVERTED_G1
    ],
    *[
        (f"G2 progress gate, {why}", G1_C, G2_C.replace(G2_TEST, test), ("pending", "drifted"))
        for why, test in INVERTED_G2
    ],
    (
        "G2 progress gate, mirrored",
        G1_C,
        G2_C.replace(G2_TEST, f"req.num_prompt_tokens > {PROGRESS}"),
        ("pending", "drifted"),
    ),
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
    new = rewritten(module_with(g1, g2))
    compile(new, "rewritten", "exec")
    after = classify_text(new)
    for site, before in zip((gate.G1, gate.G2), want, strict=True):
        expected = "applied" if before == "pending" else before
        assert after[site].verdict.value == expected


@pytest.mark.wheel
def test_a_temporary_sharing_its_line_is_drift():
    # The codemod removes the temporary's line whole, which would take `x = 0` with it.
    text, old = _connector_text("0.31.0"), "tokens_covered = ("
    assert classify_text(text)[gate.G2].verdict is Verdict.PENDING
    assert text.count(old) == 1
    result = classify_text(text.replace(old, "x = 0; " + old))[gate.G2]
    assert result.verdict is Verdict.DRIFTED
    assert "tokens_covered shares its line with another statement" in result.detail


def test_shapes_are_distinct_and_read_like_sites_md():
    prints = [s.fingerprint for shapes in gate_sites.SHAPES.values() for s in shapes]
    assert len(set(prints)) == len(prints)
    # Pre-images, k3patch's post-image, upstream's fix, and (G1) the half fix named as drift.
    want = {Verdict.PENDING, Verdict.APPLIED, Verdict.SATISFIED}
    assert {s.verdict for s in gate_sites.SHAPES[gate.G1]} == want | {Verdict.DRIFTED}
    assert {s.verdict for s in gate_sites.SHAPES[gate.G2]} == want


# --------------------------------------------------------------------------------------------
# Tables in the spirit of LibCST's CodemodTest (tests/patch_table.py), on the real trees, in
# memory: every change apply makes, written out as the diff it is; what must stay byte for byte;
# and the post-image reads applied with nothing left to do.

G1_MARKER = """\
# k3patch moriio-chunk-gate: the prompt is complete when this step's
# chunk reaches its end (compute progress, no slack), checked for every
# pending request, also when the chunk allocated no new block. A block
# count fires after chunk 1 once a block outgrows a chunk (K3: ~5,760).
if req_id in self._reqs_need_pending_save:
    req = self._reqs_need_pending_save[req_id][0]
    if (
        req.num_computed_tokens
        + scheduler_output.num_scheduled_tokens.get(req_id, 0)
"""
G2_POST = """\
# k3patch moriio-chunk-gate: not the final chunk until compute progress
# reaches the prompt; a block count fires early once a block outgrows a
# chunk (K3's ~5,760-token blocks).
if (
    req.num_computed_tokens
    + scheduler_output.num_scheduled_tokens.get(req_id, 0)
    < req.num_prompt_tokens
):
"""
G1_AT = "self._reqs_need_pending_save[req_id] = (req, updated_blocks)"
G2_AT = "kv_params = self._req_kv_params.get(req_id, req.kv_transfer_params or {})"
LEGACY_MARKER = """\
# k3patch moriio-chunk-gate: final when compute progress reaches
# the prompt; no slack (it sent up to 2 tokens early) and no
# block-count fallback (the original bug).
"""


def _progress(name: str, req: str = "req", req_id: str = "req_id") -> str:
    return (
        f"{LEGACY_MARKER}{name} = (\n    {req}.num_computed_tokens\n"
        f"    + scheduler_output.num_scheduled_tokens.get({req_id}, 0)\n"
        f"    >= {req}.num_prompt_tokens\n)\n"
    )


REWRITE_ROWS = {
    # C: G1's header is rebuilt under the guard (difflib keeps its `if (` line), G2's replaced.
    "0.29.0": [
        Change(
            gate.FILE,
            G1_AT,
            "if (\n    len(self._reqs_need_pending_save[req_id][1]) * self.block_size\n",
            G1_MARKER,
        ),
        Change(
            gate.FILE,
            G2_AT,
            "if req.num_prompt_tokens > len(block_ids) * self.block_size:\n",
            G2_POST,
        ),
    ],
    # D: the named temporaries go with the headers they fed.
    "0.31.0": [
        Change(
            gate.FILE,
            G1_AT,
            "saved_tokens = (\n    len(updated_blocks[self._full_attn_group_idx])\n"
            "    * self._full_attn_block_size\n)\nif saved_tokens >= req.num_prompt_tokens:\n",
            G1_MARKER + "        >= req.num_prompt_tokens\n    ):\n",
        ),
        Change(
            gate.FILE,
            G2_AT,
            "tokens_covered = (\n"
            "    len(block_ids[self._full_attn_group_idx]) * self._full_attn_block_size\n"
            ")\nif req.num_prompt_tokens > tokens_covered:\n",
            G2_POST,
        ),
    ],
    # Fork d: the older script's three decisions replaced in place, its fallbacks gone.
    "d": [
        Change(
            gate.FILE,
            G1_AT,
            "_k3done2 = _k3_prefill_done(self, req_id, req)  # k3-chunk-gate\n"
            "if _k3done2 is None:\n    _k3done2 = (\n"
            "        len(self._reqs_need_pending_save[req_id][1]) * self.block_size\n"
            "        >= req.num_prompt_tokens\n    )\n",
            _progress("_k3done2"),
        ),
        Change(
            gate.FILE,
            "_k3sw_req, _k3sw_bl = self._reqs_need_pending_save[_k3sw_rid]",
            "_k3sw_done = _k3_prefill_done(self, _k3sw_rid, _k3sw_req)\n",
            _progress("_k3sw_done", "_k3sw_req", "_k3sw_rid"),
        ),
        Change(
            gate.FILE,
            "# k3-chunk-gate: G2 by the progress map, the block count where it has no entry.",
            "_k3done = _k3_prefill_done(self, req_id, req)\nif _k3done is None:\n"
            "    _k3done = not (req.num_prompt_tokens > len(block_ids) * self.block_size)\n",
            _progress("_k3done"),
        ),
    ],
}
# Statements of the real trees that apply must leave byte for byte: the block accumulation and
# update_state_after_alloc's block lists, and in d the older script's helper, map and debug line.
UNTOUCHED_ROWS = {
    "0.29.0": [G1_AT, "local_block_ids=self._reqs_need_pending_save[req_id][1],"],
    "0.31.0": [G1_AT, "updated_blocks = ["],
    "d": [
        "def _k3_prefill_done(self, req_id, req):",
        "self._k3_prog = {}",
        "slack = int(_os.environ.get('K3_CHUNK_GATE_SLACK', '2'))",
        "if os.environ.get('K3_CHUNK_GATE_DEBUG', '0') == '1':",
    ],
}


def _connector_text(tree: str) -> str:
    root = built_fork_tree(tree) if tree in FORK_VERDICTS else pristine_tree(tree)
    return (root / "vllm" / gate.FILE).read_text()


@pytest.mark.wheel
@pytest.mark.parametrize("tree", sorted(REWRITE_ROWS))
def test_rewrite_table(tree):
    before = {gate.FILE: _connector_text(tree)}
    assert {r.verdict for r in classify_text(before[gate.FILE]).values()} == {Verdict.PENDING}
    after = {gate.FILE: rewritten(before[gate.FILE])}
    assert_rewrite(before, after, REWRITE_ROWS[tree])
    assert_untouched(before, after, UNTOUCHED_ROWS[tree])
    again = classify_text(after[gate.FILE])
    assert {r.verdict for r in again.values()} == {Verdict.APPLIED}
    # after -> after: nothing left to write (the idempotence half of CodemodTest).
    assert rewritten(after[gate.FILE]) == after[gate.FILE]


# The codemod of shapes A-C as libcst's CodemodTest writes one: the whole method before and
# after (D's temporaries and the older script's chains are the real-tree rows above). G1's gate
# leaves `if new_block_ids is not None:` for k3patch's guard, G2's header is replaced; bodies
# and the statements around them stay.
G1_C_AFTER = """
new_block_ids = scheduler_output.scheduled_cached_reqs.new_block_ids[i]
if new_block_ids is not None:
    block_ids = new_block_ids[0]
    if req_id not in self._reqs_need_pending_save:
        continue
    req, existing_blocks = self._reqs_need_pending_save[req_id]
    updated_blocks = list(existing_blocks) + (block_ids)
    self._reqs_need_pending_save[req_id] = (req, updated_blocks)
# k3patch moriio-chunk-gate: the prompt is complete when this step's
# chunk reaches its end (compute progress, no slack), checked for every
# pending request, also when the chunk allocated no new block. A block
# count fires after chunk 1 once a block outgrows a chunk (K3: ~5,760).
if req_id in self._reqs_need_pending_save:
    req = self._reqs_need_pending_save[req_id][0]
    if (
        req.num_computed_tokens
        + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        >= req.num_prompt_tokens
    ):
        meta.add_new_req(req_id, self._reqs_need_pending_save[req_id][1], {}, write_mode=True)
        del self._reqs_need_pending_save[req_id]
"""
G2_C_AFTER = """
kv_params = self._req_kv_params.get(req_id, req.kv_transfer_params or {})
# k3patch moriio-chunk-gate: not the final chunk until compute progress
# reaches the prompt; a block count fires early once a block outgrows a
# chunk (K3's ~5,760-token blocks).
if (
    req.num_computed_tokens
    + scheduler_output.num_scheduled_tokens.get(req_id, 0)
    < req.num_prompt_tokens
):
    self._reqs_need_pending_save[req_id] = (req, block_ids)
    continue
meta.add_new_req(req_id, block_ids, kv_params, write_mode=True)
"""


def test_codemod_before_after_and_after_to_after():
    before, after = module_with(G1_C, G2_C), module_with(G1_C_AFTER, G2_C_AFTER)
    assert rewritten(before) == after
    assert {r.verdict for r in classify_text(after).values()} == {Verdict.APPLIED}
    assert rewritten(after) == after


def _tabs_crlf(text: str) -> str:
    """`text` indented with a tab per level (continuation lines inside brackets too) and
    CRLF line ends."""
    lines = [
        "\t" * ((len(ln) - len(ln.lstrip(" "))) // 4) + ln.lstrip(" ") for ln in text.split("\n")
    ]
    return "\r\n".join(lines)


def test_codemod_keeps_tabs_and_crlf():
    before = _tabs_crlf(module_with(G1_C, G2_C))
    after = rewritten(before)
    compile(after, "rewritten", "exec")  # a space-for-tab indent would be a TabError
    assert after.count("\n") == after.count("\r\n")
    # Statements are indented with tabs only; the post-image's continuation lines add its own
    # spaces inside the brackets, after the tabs of the gate they belong to.
    for line in after.split("\r\n"):
        indent = line[: len(line) - len(line.lstrip(" \t"))]
        assert " \t" not in indent, repr(line)
        if not line.lstrip().startswith(("req.", "+ ", ">= ", "< ", "):")):
            assert " " not in indent, repr(line)
    assert after.replace("\r\n", "\n").expandtabs(4) == module_with(G1_C_AFTER, G2_C_AFTER)
    assert {r.verdict for r in classify_text(after).values()} == {Verdict.APPLIED}
