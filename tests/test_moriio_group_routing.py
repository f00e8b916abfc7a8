"""moriio-group-routing on the operators' real trees (tests/forktree: the vLLM 0.28.0 wheel plus
the recipe's older scripts), as tables (tests/patch_table.py): the verdict of every tree and the
defect it names, the exact post-image `apply` writes, what it must not touch, the texts it
refuses; then the pending -> applied -> revert cycle as one transaction over three files,
half-patched and drifted packages, formatting and marker comments, and that no bare name makes
a tree the fork. Every expectation is written here or read from the real tree, never taken from
the patch module. The routing itself (the bug on the fork's code, fixed on the patched code) is
the probe's: tests/test_moriio_group_routing_probe.py."""

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
from conftest import ROOT, run_cli, sites_of, slow_after, status_json, tree_hashes
from cycle import assert_full_cycle
from patch_table import Change, assert_rewrite, assert_sites, assert_untouched, changes

import k3patch
from k3patch.registry import all_patches, patches_dir

pytestmark = pytest.mark.wheel

ID = "moriio-group-routing"
ONLY = ["--only", ID]
PACKAGE = "distributed/kv_transfer/kv_connector/v1/moriio/"
COMMON = f"vllm/{PACKAGE}moriio_common.py"
CONNECTOR = f"vllm/{PACKAGE}moriio_connector.py"
ENGINE = f"vllm/{PACKAGE}moriio_engine.py"
FILES = (COMMON, CONNECTOR, ENGINE)
PLAN = "MoRIIOWriter._prepare_transfer_plan"
BCM = "MoRIIOConnectorScheduler.build_connector_meta"
SITE_NAMES = [
    "WriteTask.k3patch_group_block_ids",
    "RemoteAllocInfo.k3patch_group_block_ids",
    "ReqMeta.k3patch_group_block_ids",
    "MoRIIOConnectorScheduler.__init__",
    "MoRIIOConnectorScheduler.update_state_after_alloc (prefill capture)",
    "MoRIIOConnectorScheduler.update_state_after_alloc (decode notify)",
    "MoRIIOConnectorScheduler.send_notify_block",
    BCM,
    "MoRIIOConnectorWorker.__init__",
    "MoRIIOConnectorWorker.schedule_write_blocks",
    "MoRIIOConnectorWorker._write_blocks_for_req",
    "MoRIIOWrapper._handle_remote_blocks_message",
    PLAN,
]


def lines(text: str) -> str:
    return textwrap.dedent(text)


# --------------------------------------------------------------------------------------------
# Tables

FORK = "fork: mamba block ids ([0] attention, [1] mamba)"
LEGACY = "older k3-group-routing fix (legacy, defective)"
LEGACY_CHUNKED = "older k3-group-routing fix + k3-chunked-allgrp (legacy, defective)"
# tree -> (the plan site's shape, the bCM site's shape, words the plan site's detail carries,
# words the bCM site's detail carries, words neither carries). Every site reads pending.
VERDICTS: dict[str, tuple[str, str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "a": (FORK, FORK, ("[0]/[1]", "K3_MAMBA_BC"), (), ("first chunk",)),
    "b": (FORK, FORK, ("[0]/[1]", "K3_MAMBA_BC"), (), ("first chunk",)),
    "a-comments": (FORK, FORK, ("[0]/[1]", "K3_MAMBA_BC"), (), ("first chunk",)),
    # The fork's mamba list is captured once too, but a Mamba group holds one block: no
    # first-chunk defect is claimed where the older fix is not there.
    "a-nodebug": (FORK, FORK, ("[0]/[1]",), (), ("first chunk", "K3_MAMBA_BC")),
    "c": (
        LEGACY,
        LEGACY,
        (
            "misroutes the 2nd and 3rd KDA groups",
            "K3_GROUP_ROUTING=0",
            "NameError with K3_MAMBA_BC=1",
        ),
        ("captured at the first chunk only; later chunks' block lists are never sent",),
        (),
    ),
    "d": (
        LEGACY,
        LEGACY_CHUNKED,
        ("geometry-keyed offsets cache", "misroutes the 2nd and 3rd KDA groups"),
        ("chunked companion grows",),
        ("first chunk",),
    ),
}

# Every change `apply` makes to tree a-nodebug (the fork without its debug block), in file
# order: k3patch's lines after the fork's statements, and the transfer plan's region replaced.
POST_IMAGE = [
    Change(
        COMMON,
        "retried: int = 0",
        added=lines("""\
    # k3patch moriio-group-routing: block ids of every KV-cache group
    k3patch_group_block_ids: list[list[int]] | None = None
"""),
    ),
    Change(
        COMMON,
        "] = field(default_factory=dict)",
        added=lines("""\
    # k3patch moriio-group-routing: block ids of every KV-cache group
    k3patch_group_block_ids: list[list[int]] | None = None
"""),
    ),
    Change(
        COMMON,
        "mamba_local_block_ids: list[int] = field(default_factory=list)",
        added=lines("""\
    # k3patch moriio-group-routing: block ids of every KV-cache group
    k3patch_group_block_ids: list[list[int]] | None = None
"""),
    ),
    Change(
        CONNECTOR,
        "self._reqs_save_mamba: dict[ReqId, list[int]] = {}  # k3-mamba-blockids",
        added=lines("""\
    # k3patch moriio-group-routing: every KV-cache group's blocks per request
    self._k3patch_save_groups: dict[str, list[list[int]]] = {}
"""),
    ),
    Change(
        CONNECTOR,
        "mamba_block_notify_list: list[int] | None = None,  # k3-mamba-blockids",
        added=lines("""\
    k3patch_group_block_notify: list[list[int]] | None = None,
"""),
    ),
    Change(
        CONNECTOR,
        '"type": "remote_blocks",',
        added=lines("""\
    "k3patch_group_block_ids": k3patch_group_block_notify,
"""),
    ),
    Change(
        CONNECTOR,
        ")",
        added=lines("""\
    # k3patch moriio-group-routing: every group's blocks, not only [0]/[1]
    self._k3patch_save_groups[request.request_id] = [
        list(_k3patch_g) for _k3patch_g in _k3_gbi
    ]
"""),
    ),
    Change(
        CONNECTOR,
        ")",
        added=lines("""\
    # k3patch moriio-group-routing: send every group's blocks
    _k3patch_group_notify = (
        [list(_k3patch_g) for _k3patch_g in _k3_gbi_d] if num_external_tokens > 0 else []
    )
"""),
    ),
    Change(
        CONNECTOR,
        "mamba_block_notify_list=mamba_block_notify_list,  # k3-mamba-blockids",
        added=lines("""\
    k3patch_group_block_notify=_k3patch_group_notify,
"""),
    ),
    Change(
        CONNECTOR,
        "self._reqs_need_send = {}",
        added=lines("""\

    # k3patch moriio-group-routing: every KV-cache group's blocks travel with
    # the request (K3's MLA group is index 3, not [0]). Blocks a later prefill
    # chunk allocates join their group's list; each save leaving in this step
    # takes its request's lists along.
    if self._k3patch_save_groups:
        _k3patch_cached = scheduler_output.scheduled_cached_reqs
        for _k3patch_index, _k3patch_req_id in enumerate(_k3patch_cached.req_ids):
            _k3patch_new = _k3patch_cached.new_block_ids[_k3patch_index]
            if _k3patch_new is None or _k3patch_req_id not in self._k3patch_save_groups:
                continue
            if _k3patch_req_id in _k3patch_cached.resumed_req_ids:
                # Resumed after preemption: its new_block_ids are all its blocks
                # (vLLM's CachedRequestData), the lists update_state_after_alloc
                # took again this step: they replace, never join, the old lists.
                self._k3patch_save_groups[_k3patch_req_id] = [
                    list(_k3patch_added) for _k3patch_added in _k3patch_new
                ]
                continue
            self._k3patch_save_groups[_k3patch_req_id] = [
                _k3patch_group + list(_k3patch_added)
                for _k3patch_group, _k3patch_added in zip(
                    self._k3patch_save_groups[_k3patch_req_id], _k3patch_new, strict=True
                )
            ]
        for _k3patch_req_id, _k3patch_meta in meta.reqs_to_save.items():
            _k3patch_meta.k3patch_group_block_ids = self._k3patch_save_groups.pop(
                _k3patch_req_id, None
            )
"""),
    ),
    Change(
        CONNECTOR,
        "self.layer_to_spec = build_layer_to_spec(kv_cache_config)",
        added=lines("""\
    # k3patch moriio-group-routing: each layer's KV-cache group (no position
    # is assumed: K3 has three KDA groups before its MLA group)
    self._k3patch_group_of_layer, self._k3patch_attention_group = (
        _k3patch_kv_cache_group_index(kv_cache_config)
    )
"""),
    ),
    Change(
        CONNECTOR,
        "mamba_local_block_ids: list[int] | None = None,  # k3-mamba-blockids",
        added=lines("""\
    k3patch_group_block_ids: list[list[int]] | None = None,
"""),
    ),
    Change(
        CONNECTOR,
        "remote_ip=remote_ip,",
        added=lines("""\
    k3patch_group_block_ids=k3patch_group_block_ids,
"""),
    ),
    Change(
        CONNECTOR,
        "mamba_local_block_ids=meta.mamba_local_block_ids,  # k3-mamba-blockids",
        added=lines("""\
    k3patch_group_block_ids=meta.k3patch_group_block_ids,
"""),
    ),
    Change(
        CONNECTOR,
        ")",
        added=lines('''\


    def _k3patch_kv_cache_group_index(
        kv_cache_config: "KVCacheConfig",
    ) -> tuple[dict[str, int], int]:
        """k3patch moriio-group-routing: the KV-cache group of every layer, and the attention group.

        A layer's KV lives in its own group's blocks. Kimi-K3 has three KDA (Mamba) groups before
        its MLA group, so no fixed position is the attention group: it is the first group whose
        spec is not a MambaSpec.
        """
        from vllm.v1.kv_cache_interface import MambaSpec

        group_of_layer: dict[str, int] = {}
        attention_group: int | None = None
        for index, group in enumerate(kv_cache_config.kv_cache_groups):
            for layer_name in group.layer_names:
                group_of_layer[layer_name] = index
            if attention_group is None and not isinstance(group.kv_cache_spec, MambaSpec):
                attention_group = index
        if attention_group is None:
            raise ValueError("MoRIIO WRITE needs an attention KV-cache group; all groups are Mamba")
        return group_of_layer, attention_group
'''),
    ),
    Change(
        ENGINE,
        "layer_cache = self.worker.kv_caches[task.layer_name]",
        removed=lines("""\
    geometry_key = _get_write_geometry_key(layer_cache)
    offsets = request_info.transfer_offsets.get(geometry_key)
    if offsets is None:
        from vllm.v1.kv_cache_interface import MambaSpec as _K3MS_BL  # k3-mamba-blockids
        _k3_mamba = isinstance(
            self.worker.layer_to_spec.get(task.layer_name), _K3MS_BL
        )
        if _k3_mamba:
            _k3_local = task.mamba_local_block_ids or task.local_block_ids
            _k3_remote = request_info.mamba_block_ids or request_info.block_ids
        else:
            _k3_local = task.local_block_ids
            _k3_remote = request_info.block_ids
        offsets = self.worker._compute_block_transfer_offsets(
            task.layer_name,
            _k3_local,
            _k3_remote,
"""),
        added=lines("""\
    # k3patch moriio-group-routing: each layer's KV goes to its own KV-cache
    # group's blocks on both nodes (K3: KDA groups 0-2, MLA group 3). Offsets
    # are cached per group and tensor geometry: K3's KDA groups share one
    # geometry but not their block ids. Without per-group ids (a peer that
    # lacks this fix) the write fails, never guesses.
    _k3patch_local = task.k3patch_group_block_ids
    _k3patch_remote = request_info.k3patch_group_block_ids
    if _k3patch_local is None or _k3patch_remote is None:
        raise MoRIIOError(
            f"MoRIIO transfer {task.transfer_id}: no per-group block ids from "
            + ("the prefill scheduler" if _k3patch_local is None else "the decode node")
            + "; both nodes need k3patch moriio-group-routing"
        )
    _k3patch_group = self.worker._k3patch_group_of_layer[task.layer_name]
    geometry_key = (_k3patch_group, *_get_write_geometry_key(layer_cache))
    offsets = request_info.transfer_offsets.get(geometry_key)
    if offsets is None:
        offsets = self.worker._compute_block_transfer_offsets(
            task.layer_name,
            _k3patch_local[_k3patch_group],
            _k3patch_remote[_k3patch_group],
"""),
    ),
    Change(
        ENGINE,
        "mamba_block_ids=list(mamba_block_notify_list or []),  # k3-mamba-blockids",
        added=lines("""\
    k3patch_group_block_ids=data.get("k3patch_group_block_ids"),
"""),
    ),
]


# Statements of the trees that `apply` leaves byte-identical: the chunk gates
# (moriio-chunk-gate's sites), the READ path's attention-first block ids.
MUST_NOT_TOUCH = {
    "a": [
        "        if self.mode == MoRIIOMode.WRITE and get_role() == ROLE.PRODUCER:\n",
        "                list(_k3_gbi[1]) if len(_k3_gbi) > 1 else []\n",
        "                            local_block_ids = blocks.get_block_ids()[0]\n",
    ],
    # The older fix's plumbing stays (unused by k3patch's plan), so revert needs no pristine file.
    "c": [
        "        if self.mode == MoRIIOMode.WRITE and get_role() == ROLE.PRODUCER:\n",
        "            self._reqs_save_allgrp[request.request_id] = [  # k3-group-routing\n",
        "                            local_block_ids = blocks.get_block_ids()[0]\n",
    ],
    "d": [
        "        if self.mode == MoRIIOMode.WRITE and get_role() == ROLE.PRODUCER:\n",
        "self._reqs_save_allgrp[req_id] = _k3ca_new\n",
    ],
}


def patch_of(data: dict) -> dict:
    return next(p for p in data["patches"] if p["id"] == ID)


def sites(tree: Path) -> dict[str, dict]:
    return sites_of(tree, *ONLY)


def source_hashes(tree: Path) -> dict[str, str]:
    return {rel: h for rel, h in tree_hashes(tree).items() if not rel.startswith("vllm/.k3patch")}


def applied(fork_tree, name: str) -> tuple[Path, dict[str, str], dict[str, str]]:
    """Tree `name` after `apply --only moriio-group-routing`, with its texts before and after."""
    tree = fork_tree(name)
    before = {rel: (tree / rel).read_text() for rel in FILES}
    proc = run_cli("apply", "--vllm", str(tree), *ONLY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tree, before, {rel: (tree / rel).read_text() for rel in FILES}


def diff_lines(before: str, after: str, sign: str) -> list[str]:
    return [
        line[2:]
        for line in difflib.ndiff(before.splitlines(), after.splitlines())
        if line.startswith(sign + " ")
    ]


def plan_function(text: str) -> ast.FunctionDef:
    writer = next(
        n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "MoRIIOWriter"
    )
    return next(
        n
        for n in writer.body
        if isinstance(n, ast.FunctionDef) and n.name == "_prepare_transfer_plan"
    )


# --------------------------------------------------------------------------------------------
# The tables on the real trees


@pytest.mark.parametrize("name", sorted(VERDICTS))
def test_real_tree_reads_pending_with_its_defect_named(fork_tree, name):
    plan_shape, bcm_shape, plan_words, bcm_words, absent = VERDICTS[name]
    data = status_json(fork_tree(name), *ONLY)
    assert data["_rc"] == 1
    patch = patch_of(data)
    assert patch["verdict"] == "pending"
    assert [s["site"] for s in patch["sites"]] == SITE_NAMES
    by_name = {s["site"]: s for s in patch["sites"]}
    # A form with a known defect is never satisfied, nor is any site of it.
    assert_sites(by_name, {"*": "pending"})
    assert by_name[PLAN]["shape"] == plan_shape
    assert by_name[BCM]["shape"] == bcm_shape
    for word in plan_words:
        assert word in by_name[PLAN]["detail"], (name, word, by_name[PLAN]["detail"])
    for word in bcm_words:
        assert word in by_name[BCM]["detail"], (name, word, by_name[BCM]["detail"])
    for word in absent:
        assert word not in by_name[PLAN]["detail"] + by_name[BCM]["detail"], (name, word)


def test_apply_writes_exactly_the_post_image(fork_tree):
    _tree, before, after = applied(fork_tree, "a-nodebug")
    assert_rewrite(before, after, POST_IMAGE)


@pytest.mark.parametrize("name", slow_after(["a", "b", "a-comments", "c", "d"]))
def test_every_tree_gains_the_same_lines(fork_tree, name):
    # Wherever the fork's statements sit, k3patch adds the same lines after them; only the
    # plan region's old text differs (the debug block, the older fix's choice).
    _tree, before, after = applied(fork_tree, name)
    found = [c for rel in FILES for c in changes(rel, before[rel], after[rel])]
    assert [c.added for c in found] == [c.added for c in POST_IMAGE]
    assert [c.file for c in found if c.removed] == [ENGINE]


@pytest.mark.parametrize("name", slow_after(sorted(MUST_NOT_TOUCH)))
def test_what_apply_must_not_touch(fork_tree, name):
    _tree, before, after = applied(fork_tree, name)
    assert_untouched(before, after, MUST_NOT_TOUCH[name])


def test_the_builder_trees_differ_where_the_verdicts_say(fork_tree):
    # The plan variants are three different texts of one fork; (c) and (d) carry the older
    # fix, (d) also its chunked companion.
    engine = {name: (fork_tree(name) / ENGINE).read_text() for name in VERDICTS}
    connector = {name: (fork_tree(name) / CONNECTOR).read_text() for name in ("c", "d")}
    assert len({engine["a"], engine["a-comments"], engine["a-nodebug"]}) == 3
    assert "K3_MAMBA_BC" in engine["a"] and "K3_MAMBA_BC" not in engine["a-nodebug"]
    assert "_k3_gr_local" in engine["c"] and "_k3_gr_local" not in engine["a"]
    assert "_k3ca_cur" in connector["d"] and "_k3ca_cur" not in connector["c"]


# --------------------------------------------------------------------------------------------
# The transaction: apply, idempotence, exact revert, from every state


@pytest.mark.parametrize("name", slow_after(sorted(VERDICTS)))
def test_apply_from_every_state_then_again_then_revert(fork_tree, name):
    cycle = assert_full_cycle(fork_tree(name), ID, written=FILES)
    after = {s["site"]: s for s in cycle.applied["patches"][0]["sites"]}
    assert list(after) == SITE_NAMES
    assert {s["verdict"] for s in after.values()} == {"applied"}, [
        (s["site"], s["verdict"], s["detail"]) for s in after.values() if s["verdict"] != "applied"
    ]
    assert {s["shape"] for s in after.values()} == {"k3patch"}


@pytest.mark.parametrize("name", slow_after(["a", "a-nodebug", "c", "d"]))
def test_the_plan_becomes_k3patchs_form_with_offsets_cached_per_group(fork_tree, name):
    _tree, before, after = applied(fork_tree, name)
    fn = plan_function(after[ENGINE])
    source = ast.unparse(fn)
    assert "geometry_key = (_k3patch_group, *_get_write_geometry_key(layer_cache))" in source
    assert "self.worker._k3patch_group_of_layer[task.layer_name]" in source
    # Nothing of the old choice (fork or older fix) or of its debug block is left, and nothing
    # falls back: no try, no getattr default, no group 0.
    for gone in ("_k3_mamba", "_k3_gr_local", "K3_MAMBA_BC", "_K3MS_BL", "mamba_block_ids"):
        assert gone not in source, gone
    assert not any(isinstance(n, ast.Try) for n in ast.walk(fn))
    assert "getattr" not in source
    # Only the plan region of the engine changes; the rest of it is byte-identical.
    tail = "            request_info.transfer_offsets[geometry_key] = offsets\n"
    head_before = "        geometry_key = _get_write_geometry_key(layer_cache)\n"
    head_after = (
        "        # k3patch moriio-group-routing: each layer's KV goes to its own KV-cache\n"
    )
    old, new = before[ENGINE], after[ENGINE]
    assert old.count(head_before) == old.count(tail) == 1
    assert new.count(head_after) == new.count(tail) == 1
    assert old[: old.index(head_before)] == new[: new.index(head_after)]
    region = old[old.index(head_before) : old.index(tail) + len(tail)].splitlines()
    removed = diff_lines(old, new, "-")
    assert removed and all(line in region for line in removed), removed


@pytest.mark.parametrize("name", slow_after(["a", "c", "d"]))
def test_the_connector_and_common_only_gain_lines(fork_tree, name):
    # Everything the trees have in these two files stays: the chunk gates (moriio-chunk-gate's
    # sites), the older fix's plumbing and its chunked companion, the probes and pod hosts.
    _tree, before, after = applied(fork_tree, name)
    for rel in (COMMON, CONNECTOR):
        assert diff_lines(before[rel], after[rel], "-") == [], rel
    gate = "        if self.mode == MoRIIOMode.WRITE and get_role() == ROLE.PRODUCER:\n"
    assert gate in after[CONNECTOR]
    added = "\n".join(line for rel in FILES for line in diff_lines(before[rel], after[rel], "+"))
    assert "except" not in added


def test_every_name_k3patch_inserts_carries_its_prefix(fork_tree):
    # A bare word in someone else's code can never be mistaken for k3patch's.
    _tree, before, after = applied(fork_tree, "a")
    for rel in FILES:
        old = _bound(ast.parse(before[rel]))
        new = _bound(ast.parse(after[rel]))
        inserted = new - old
        assert inserted, rel
        assert all("k3patch" in name for name in inserted), (rel, sorted(inserted))


def _bound(tree: ast.AST) -> set[str]:
    """Every name a module binds or passes by name: assignments, fields, parameters, keywords,
    functions, dict keys, attributes assigned, comprehension variables. A function of
    k3patch's own counts by its name (its locals are its own scope); keywords passed to a
    builtin (`zip(..., strict=True)`) are the builtin's names."""
    import builtins

    out: set[str] = set()
    todo: list[ast.AST] = [tree]
    while todo:
        n = todo.pop()
        if isinstance(n, ast.FunctionDef):
            out.add(n.name)
            if "k3patch" in n.name:
                continue
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
            out.add(n.attr)
        elif isinstance(n, ast.arg):
            out.add(n.arg)
        elif isinstance(n, ast.Call):
            if not (isinstance(n.func, ast.Name) and hasattr(builtins, n.func.id)):
                out |= {k.arg for k in n.keywords if k.arg}
        elif isinstance(n, ast.Dict):
            out |= {k.value for k in n.keys if isinstance(k, ast.Constant)}
        todo.extend(ast.iter_child_nodes(n))
    return out


# --------------------------------------------------------------------------------------------
# Half-patched and drifted packages: the three files are one change


def test_half_patched_package_reads_pending_and_apply_completes_it(fork_tree):
    _done, _before, after = applied(fork_tree, "a")
    tree = fork_tree("a")
    (tree / CONNECTOR).write_text(after[CONNECTOR])
    (tree / ENGINE).write_text(after[ENGINE])
    by_file = {
        rel: {s["verdict"] for s in sites(tree).values() if s["file"] == rel[5:]} for rel in FILES
    }
    assert by_file == {COMMON: {"pending"}, CONNECTOR: {"applied"}, ENGINE: {"applied"}}
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    for rel, text in after.items():
        assert (tree / rel).read_text() == text, rel


# (tree, what is replaced, by what): plan texts in no shape k3patch knows. Each is refused:
# the plan site reads drifted, apply exits 1 and writes nothing.
MUTATED_PLANS = [
    # The fork's choice with the Mamba lists swapped in for attention.
    (
        "a",
        "            else:\n                _k3_local = task.local_block_ids\n",
        "            else:\n                _k3_local = task.mamba_local_block_ids\n",
    ),
    # The K3_MAMBA_BC block rebinding what the offsets call reads: not only a log any more.
    (
        "a",
        "                _k3k = 'M' if _k3_mamba else 'A'\n",
        "                _k3k = 'M' if _k3_mamba else 'A'\n                _k3_local = []\n",
    ),
    # The older fix's plan indexing a fixed group.
    (
        "c",
        "                    _k3_local = _k3_gr_local[_k3_gi]\n",
        "                    _k3_local = _k3_gr_local[0]\n",
    ),
]


@pytest.mark.parametrize("name,old,new", MUTATED_PLANS)
def test_a_plan_in_no_known_shape_is_refused(fork_tree, name, old, new):
    tree = fork_tree(name)
    text = (tree / ENGINE).read_text()
    assert text.count(old) == 1
    (tree / ENGINE).write_text(text.replace(old, new))
    before = tree_hashes(tree)
    plan = sites(tree)[PLAN]
    assert plan["verdict"] == "drifted"
    assert "no known shape" in plan["detail"]
    assert "moriio_engine.py drifted" in plan["detail"]
    assert any(e.startswith("fork:") for e in plan["expected"])
    assert patch_of(status_json(tree, *ONLY))["verdict"] == "drifted"
    proc = run_cli("apply", "--vllm", str(tree), *ONLY)
    assert proc.returncode == 1
    assert tree_hashes(tree) == before, "a drifted package was partly written"


@pytest.mark.parametrize("applied_first", [False, True])
def test_a_second_definition_is_drift_not_a_guess(fork_tree, applied_first):
    # A later `class MoRIIOWriter` is the live one: patching (or reading) the first would patch
    # dead code and still say applied.
    tree = applied(fork_tree, "a")[0] if applied_first else fork_tree("a")
    path = tree / ENGINE
    path.write_text(path.read_text() + "\n\nclass MoRIIOWriter:\n    pass\n")
    before = tree_hashes(tree)
    patch = patch_of(status_json(tree, *ONLY))
    assert patch["verdict"] == "drifted"
    drifted = [s for s in patch["sites"] if s["verdict"] == "drifted"]
    assert drifted and all("MoRIIOWriter is bound 2 times" in s["detail"] for s in drifted)
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 1
    assert tree_hashes(tree) == before


def test_a_hand_edited_post_image_is_drift_not_applied(fork_tree):
    tree, _before, after = applied(fork_tree, "a")
    old = "        _k3patch_group = self.worker._k3patch_group_of_layer[task.layer_name]\n"
    assert after[ENGINE].count(old) == 1
    # Someone "simplifies" the patched plan back to group 0: the original bug, silently.
    (tree / ENGINE).write_text(after[ENGINE].replace(old, "        _k3patch_group = 0\n"))
    assert sites(tree)[PLAN]["verdict"] == "drifted"
    assert patch_of(status_json(tree, *ONLY))["verdict"] == "drifted"


def test_a_marker_comment_does_not_make_the_fork_read_applied(fork_tree):
    tree = fork_tree("a")
    for rel in FILES:
        path = tree / rel
        path.write_text(
            "# k3patch moriio-group-routing applied\n# k3-group-routing\n" + path.read_text()
        )
    assert patch_of(status_json(tree, *ONLY))["verdict"] == "pending"


def test_no_bare_name_makes_an_upstream_tree_the_fork(make_tree):
    # 0.28.0 as the wheel ships it, with the fork's and the older fix's names in comments, a
    # string and a stray module-level assignment: still upstream's single-group connector.
    tree = make_tree("0.28.0")
    path = tree / CONNECTOR
    path.write_text(
        path.read_text()
        + "\n# mamba_local_block_ids _reqs_save_allgrp all_group_block_ids\n"
        + "# k3patch_group_block_ids _k3patch_save_groups\n"
        + 'mamba_block_notify_list = "_layer_group_idx K3_GROUP_ROUTING"\n'
    )
    patch = patch_of(status_json(tree, *ONLY))
    assert patch["verdict"] == "not applicable"
    assert {s["shape"] for s in patch["sites"]} == {"upstream 0.14.1-0.29.0 single-group connector"}


@pytest.mark.parametrize(
    "line_length,quote", slow_after([(60, "single"), (120, "double")], unpack=True)
)
def test_formatting_never_changes_a_verdict(fork_tree, line_length, quote):
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    pending = fork_tree("c")
    done, _before, _after = applied(fork_tree, "c")
    for tree, want in ((pending, "pending"), (done, "applied")):
        for rel in FILES:
            text = (tree / rel).read_text()
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
        found = sites(tree)
        assert {s["verdict"] for s in found.values()} == {want}, [
            (s["site"], s["verdict"], s["detail"]) for s in found.values() if s["verdict"] != want
        ]


@pytest.mark.parametrize("style", slow_after(["crlf", "tabs"]))
def test_apply_writes_in_the_files_own_newlines_and_indentation(fork_tree, style):
    # A CRLF file stays CRLF, the new function's docstring included; in a tab-indented file
    # every statement k3patch adds is indented by tabs, however deep it is nested.
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    tree = fork_tree("c")
    for rel in FILES:
        path = tree / rel
        if style == "crlf":
            path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
        else:
            tabs = ["--config", "format.indent-style='tab'", str(path)]
            subprocess.run([ruff, "format", "--no-cache", "--isolated", *tabs], check=True)
    original = tree_hashes(tree)
    assert {s["verdict"] for s in sites(tree).values()} == {"pending"}
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    assert {s["verdict"] for s in sites(tree).values()} == {"applied"}
    for rel in FILES:
        data = (tree / rel).read_bytes()
        assert tree_hashes(tree)[rel] != original[rel], rel
        if style == "crlf":
            assert data.count(b"\n") == data.count(b"\r\n"), rel
            continue
        lines = data.decode().splitlines()
        for stmt in ast.walk(ast.parse(data)):
            if isinstance(stmt, ast.stmt):
                indent = lines[stmt.lineno - 1][: stmt.col_offset]
                assert set(indent) <= {"\t"}, (rel, stmt.lineno, lines[stmt.lineno - 1])
    assert run_cli("revert", "--vllm", str(tree)).returncode == 0
    assert tree_hashes(tree) == original


def test_composes_with_the_chunk_gate_patch_in_either_order(fork_tree):
    if "moriio-chunk-gate" not in {p.id for p in all_patches()}:
        pytest.skip("moriio-chunk-gate is not registered")
    both = ["--only", ID, "--only", "moriio-chunk-gate"]
    together = fork_tree("d")
    assert run_cli("apply", "--vllm", str(together), *both).returncode == 0
    mine_first = fork_tree("d")
    assert run_cli("apply", "--vllm", str(mine_first), *ONLY).returncode == 0
    assert run_cli("apply", "--vllm", str(mine_first), *both).returncode == 0
    gate_first = fork_tree("d")
    gate_only = run_cli("apply", "--vllm", str(gate_first), "--only", "moriio-chunk-gate")
    assert gate_only.returncode == 0
    assert run_cli("apply", "--vllm", str(gate_first), *both).returncode == 0
    for tree in (together, mine_first, gate_first):
        data = status_json(tree, *both)
        assert {p["verdict"] for p in data["patches"]} == {"applied"}
        assert source_hashes(tree) == source_hashes(together)


def test_a_script_that_runs_again_over_the_applied_tree_leaves_it_applied(fork_tree):
    # The recipe runs its scripts at every container start. Over an applied tree all of them
    # find their markers or miss their anchors, except xfer_probe's group dump: its anchor
    # (`self.layer_to_spec = ...`) is still there, so it inserts the dump once more, between
    # that line and k3patch's map. k3patch's statements still follow the anchor: applied.
    import forktree

    tree, _before, _after = applied(fork_tree, "c")
    dump = next(h for h in forktree.STEPS["xfer_probe"] if "group dump" in h.hunk)
    forktree.apply_hunks(tree / "vllm", [dump])
    init = sites(tree)["MoRIIOConnectorWorker.__init__"]
    assert init["verdict"] == "applied", init
    assert patch_of(status_json(tree, *ONLY))["verdict"] == "applied"


def test_the_mamba_blockids_script_half_done_on_029_is_drift_not_upstream(make_tree):
    # On 0.29.0 the mamba-blockids script writes moriio_common.py and moriio_connector.py and
    # misses its engine anchors (SITES.md section 1, pitfalls). The connector still reads
    # `get_block_ids()[0]` on its READ path, so the single-group upstream shape would hold:
    # the fork's statements must win, and the half-done package is drift.
    import forktree

    tree = make_tree("0.29.0")
    done = [h for h in forktree.STEPS["mamba_blockids"] if h.file != ENGINE[5:]]
    forktree.apply_hunks(tree / "vllm", done)
    before = tree_hashes(tree)
    patch = patch_of(status_json(tree, *ONLY))
    assert patch["verdict"] == "drifted"
    by_file = {s["file"]: s["verdict"] for s in patch["sites"] if s["verdict"] == "drifted"}
    assert set(by_file) == {ENGINE[5:]}
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 1
    assert tree_hashes(tree) == before


# --------------------------------------------------------------------------------------------
# The offsets cache: per KV-cache group and tensor geometry (issue 28 item 4). k3patch's first
# post-image keyed it per layer; operators' trees carry that form.

GROUP_KEY = "geometry_key = (_k3patch_group, *_get_write_geometry_key(layer_cache))"
LAYER_KEY = "geometry_key = (task.layer_name, *_get_write_geometry_key(layer_cache))"
# The commit before the key changed: its k3patch wrote the per-layer form.
PER_LAYER_RELEASE = "1bdcf73c38c421a482aabf47a1ad56975c5fb752"
SENDS_CHILD = """
import json, sys, types
sys.path.insert(0, sys.argv[1])
for name, where in (("k3patch", sys.argv[2]), ("k3patch.patches", sys.argv[3])):
    module = types.ModuleType(name)
    module.__path__ = [where]
    sys.modules[name] = module
from k3patch import probekit
from k3patch.patches.moriio_group_routing import batches as probe
made = []
class Counted(probekit.Calls):
    def __init__(self, answer):
        super().__init__(answer)
        made.append(self)
probekit.Calls = Counted
for seed in range(int(sys.argv[4])):
    made.clear()
    batch = probe.generate_batch(seed)
    routes, saves = probe.drive_batch(batch)
    print("K3PATCH-SENDS " + json.dumps(dict(
        seed=seed, layout=batch.layout, saves=saves,
        routes=sorted([k, name, route] for (k, name), route in routes.items()),
        wrong=probe.judge_batch(batch, routes, saves),
        calls=sum(len(c.calls) for c in made))))
"""


def test_offsets_per_group_and_geometry_send_what_per_layer_sent(fork_tree, verify_python):
    # The oracle (verify's batch probe: several requests share one prefill scheduler, decode
    # scheduler, notify listener and worker, their chunks side by side) drives the tree's real
    # plan on the same generated batches twice: keyed per group (today's post-image) and per
    # layer (the first). Every (request, layer) route (the blocks written, local and remote)
    # and every save's step must be equal, the reference model must find nothing wrong in
    # either, and per request the offsets are computed once per group (the probe's tensors:
    # one geometry per group) instead of once per layer.
    tree = fork_tree("a", full=True)
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    per_layer = tree.parent / "per-layer"
    shutil.copytree(tree, per_layer)
    engine = (tree / ENGINE).read_text()
    assert engine.count(GROUP_KEY) == 1
    (per_layer / ENGINE).write_text(engine.replace(GROUP_KEY, LAYER_KEY))
    seeds, runs = 40, {}
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    for label, site in (("group", tree), ("per-layer", per_layer)):
        args = [str(site), str(Path(k3patch.__file__).parent), str(patches_dir()), str(seeds)]
        proc = subprocess.run(
            [verify_python, "-c", SENDS_CHILD, *args], capture_output=True, text=True, env=env
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        found = [
            line.split(" ", 1)[1] for line in proc.stdout.splitlines() if "K3PATCH-SENDS " in line
        ]
        runs[label] = [json.loads(line) for line in found]
    group, layer = runs["group"], runs["per-layer"]
    assert len(group) == len(layer) == seeds
    layouts = {"K3": 4, "two-group": 2, "attention only": 1, "two attention groups": 2}
    for g, p in zip(group, layer, strict=True):
        assert g["wrong"] == p["wrong"] == [], (g["seed"], g["wrong"], p["wrong"])
        assert (g["saves"], g["routes"]) == (p["saves"], p["routes"]), g["seed"]
        requests = sum(1 for s in g["saves"] if s is not None)
        layers = sum(1 for _k, _name, _route in p["routes"])
        assert p["calls"] == layers, p["seed"]
        assert g["calls"] == requests * layouts[g["layout"]], (g["seed"], g["calls"])
    assert {g["layout"] for g in group} == set(layouts)
    assert sum(p["calls"] - g["calls"] for g, p in zip(group, layer, strict=True)) > 0


# The commit before the resume fix (issue 28 item 5): its k3patch wrote the per-group plan with
# the growth that joins a resumed request's blocks to its lists again.
RESUME_APPENDS_RELEASE = "26da2047d01cc8216459afc567d65b499096e3a3"
RELEASES = {
    "per-layer": (PER_LAYER_RELEASE, LAYER_KEY),
    "per-group": (RESUME_APPENDS_RELEASE, GROUP_KEY),
}


def _release_lib(tmp_path: Path, commit: str) -> Path:
    """k3patch as `commit` had it, importable from the returned folder."""
    if subprocess.run(["git", "cat-file", "-e", commit], cwd=ROOT).returncode:
        pytest.skip(f"this checkout's history lacks {commit[:7]} (a shallow clone)")
    archive = subprocess.run(
        ["git", "archive", commit, "k3patch", "patches"], cwd=ROOT, capture_output=True, check=True
    ).stdout
    src = tmp_path / "release"
    src.mkdir()
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    lib = tmp_path / "lib"
    # A release whose k3patch/patches is a symlink to ../patches: copied as the folder it names.
    shutil.copytree(src / "k3patch", lib / "k3patch")
    shutil.copytree(src / "patches", lib / "k3patch" / "patches", dirs_exist_ok=True)
    return lib


@pytest.mark.parametrize("release", ["per-layer", "per-group"])
@pytest.mark.parametrize("name", slow_after(["a", "c", "d"]))
def test_a_tree_an_earlier_release_applied_is_upgraded_then_reverts_exact(
    fork_tree, tmp_path, name, release
):
    # An operator's fleet has trees patched by earlier k3patch releases: the first keyed offsets
    # per layer, the second per group; both joined a resumed request's blocks to its lists
    # again (sent twice). Such a tree reads pending, naming that form; apply replaces only that
    # growth (the plan's per-layer key routes the same and stays, with its note), once; revert
    # (the earlier release's record carried over) gives back the pristine files.
    commit, key = RELEASES[release]
    lib = _release_lib(tmp_path, commit)
    tree = fork_tree(name)
    pristine = tree_hashes(tree)
    # From `lib`, so that `-m k3patch` finds that release, not the installed one.
    old = run_cli("apply", "--vllm", str(tree), *ONLY, env={"PYTHONPATH": str(lib)}, cwd=lib)
    assert old.returncode == 0, old.stdout + old.stderr
    assert key in (tree / ENGINE).read_text()
    written = source_hashes(tree)
    data = status_json(tree, *ONLY)
    patch = patch_of(data)
    assert (data["_rc"], patch["verdict"]) == (1, "pending"), patch
    by_site = {s["site"]: s for s in patch["sites"]}
    bcm = by_site[BCM]
    assert (bcm["verdict"], bcm["shape"]) == (
        "pending",
        "k3patch's earlier form: resumed requests' blocks sent twice",
    ), bcm
    assert {s["verdict"] for site, s in by_site.items() if site != BCM} == {"applied"}
    if release == "per-layer":
        assert "offsets cached per layer" in by_site[PLAN]["detail"], by_site[PLAN]["detail"]
    up = run_cli("apply", "--vllm", str(tree), *ONLY)
    assert up.returncode == 0, up.stdout + up.stderr
    upgraded = source_hashes(tree)
    assert {rel for rel in upgraded if upgraded[rel] != written[rel]} == {CONNECTOR}
    text = (tree / CONNECTOR).read_text()
    assert "_k3patch_req_id in _k3patch_cached.resumed_req_ids:" in text
    assert text.count("# k3patch moriio-group-routing: every KV-cache group's blocks travel") == 1
    data = status_json(tree, *ONLY)
    assert (data["_rc"], patch_of(data)["verdict"]) == (0, "applied"), patch_of(data)
    again = run_cli("apply", "--vllm", str(tree), *ONLY)
    assert again.returncode == 0, again.stdout + again.stderr
    assert source_hashes(tree) == upgraded, "a second apply changed the upgraded tree"
    back = run_cli("revert", "--vllm", str(tree))
    assert back.returncode == 0, back.stdout + back.stderr
    assert tree_hashes(tree) == pristine, "revert is not byte-identical"
