"""moriio-group-routing: MoRIIO writes each layer's KV into its own KV-cache group's blocks.

Symptom: Kimi-K3 served as a prefill/decode split over the MoRIIO connector (WRITE mode)
answers fluently but without the prompt's context.
Cause: the fork's "mamba block ids" change (the recipe's apply_kimik3_moriio_mamba_blockids.py
on vLLM 0.28.0) taught the connector two KV-cache groups, block ids `[0]` for attention and `[1]`
for Mamba. K3 has four: three KDA (Mamba) groups, then the MLA group at index 3. The prefill node
wrote every MLA layer into group 0's block ids, which belong to a KDA group, and every KDA layer
into group 1's; decode read MLA blocks nobody had written. A second defect sits in the same
function: 0.28.0 caches a request's transfer offsets under the layer tensor's geometry alone
(shape, stride, dtype) and reuses them for every later layer of that geometry. K3's three KDA
groups share their layer tensors (same geometry) but not their block ids, so any per-group
choice of block ids made inside that cache still writes the 2nd and 3rd KDA groups into the
1st group's blocks.
Fix: the worker maps each layer to its KV-cache group from `kv_cache_config.kv_cache_groups`
(the attention group is the first group that is not a MambaSpec); the block ids of every group
travel end to end (the scheduler's capture plus the blocks later prefill chunks add, ReqMeta,
WriteTask, the decode node's notify message, RemoteAllocInfo); the transfer plan indexes those
lists with the layer's own group and caches offsets per layer (`(task.layer_name, *geometry)`,
as upstream 0.29.0 keys them). A transfer that lacks the lists (a peer without this fix) fails
loudly; nothing falls back to group 0. A two-group [attention, mamba] model routes exactly as
before. Both nodes need the fix: the decode node sends the lists the prefill node writes into.
The fork's K3_MAMBA_BC debug block reads the two-group choice it logs; it goes with that choice
(revert brings both back). Everything k3patch adds is named `k3patch_*` / `_k3patch_*`.
Check: `k3patch verify` drives the patched scheduler, notify message and transfer plan on CPU
with K3's layout and checks that every layer's blocks land in its own group's blocks.

Verdicts on the operators' real trees (vLLM 0.28.0 + the recipe's older scripts, tests/forktree):
- (a)/(b) the fork (mamba block ids), with or without the four comment lines under
  `if _k3_mamba:` and with or without the K3_MAMBA_BC debug block: pending.
- (c) + the older group-routing fix (apply_kimik3_moriio_group_routing.py) alone, as the recipe
  runs it by default: pending, defective: the all-group block lists are captured at the first
  chunk only; later chunks' block lists are never sent. It also has (d)'s defect.
- (d) + its chunked companion (apply_kimik3_chunked_allgrp.py): pending, defective: it chooses
  the block ids inside the geometry-keyed offsets cache, so the 2nd and 3rd KDA groups are
  misrouted. Besides, its silent fallbacks (a failed group map is group 0, a task without lists
  takes the two-group choice) and `K3_GROUP_ROUTING=0` restore the bug, and where the fork had
  the K3_MAMBA_BC block, that block still reads `_k3_mamba`, which the older fix no longer binds.
  Its plan anchor needs the fork's four comment lines, so after the stored mamba-blockids script
  (which lacks them) it writes nothing at all: that tree is (a).
`apply` rewrites each of them, in place, into k3patch's form; the older fix's plumbing stays
(unused by the new plan), so no pristine file is needed and revert is exact.
Upstream: 0.14.1-0.30.0 cannot run K3 over MoRIIO at all (not applicable); 0.31.0 and later
route per group natively (satisfied).
"""

from __future__ import annotations

import ast
import enum
import functools
import itertools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from k3patch.model import (
    Patch,
    ProbeOutcome,
    SiteResult,
    SourceFile,
    Sources,
    Verdict,
    find_class,
    find_function,
    mentioned_names,
    module_binds,
    site_fingerprint,
)
from k3patch.model import source_fingerprint as _source_fingerprint

PACKAGE = "distributed/kv_transfer/kv_connector/v1/moriio"
COMMON = f"{PACKAGE}/moriio_common.py"
CONNECTOR = f"{PACKAGE}/moriio_connector.py"
ENGINE = f"{PACKAGE}/moriio_engine.py"
FILES = (COMMON, CONNECTOR, ENGINE)
MODULE_OF = {
    COMMON: "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_common",
    CONNECTOR: "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector",
    ENGINE: "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_engine",
}

# Words whose absence from all three files proves that neither the fork's statements nor
# k3patch's are there: a cheap gate that keeps upstream trees off a walk of three long ASTs. A
# hit is only a reason to look at statement shapes, never a verdict (it may be a comment).
_MENTIONS = re.compile(r"\b(?:mamba_local_block_ids|mamba_block_notify_list|k3patch_group_)")

# ---------------------------------------------------------------------------------------------
# k3patch's post-image, piece by piece. Each piece is inserted next to the fork statement it
# generalises, so a fork build that differs elsewhere in these long files is still recognised.

FIELD_NAME = "k3patch_group_block_ids"
FIELD = f"{FIELD_NAME}: list[list[int]] | None = None"
FIELD_COMMENT = "# k3patch moriio-group-routing: block ids of every KV-cache group"

SCHEDULER_DICT = """
# k3patch moriio-group-routing: every KV-cache group's blocks per request
self._k3patch_save_groups: dict[str, list[list[int]]] = {}
"""

WORKER_MAP = """
# k3patch moriio-group-routing: each layer's KV-cache group (no position
# is assumed: K3 has three KDA groups before its MLA group)
self._k3patch_group_of_layer, self._k3patch_attention_group = (
    _k3patch_kv_cache_group_index(kv_cache_config)
)
"""

GROUP_INDEX_FUNCTION = '''
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
'''

# Inserted before build_connector_meta's final `return meta`, after both chunk gates, so the
# gates themselves (moriio-chunk-gate's sites) are left exactly as they are.
SAVE_GROUPS = """
# k3patch moriio-group-routing: every KV-cache group's blocks travel with
# the request (K3's MLA group is index 3, not [0]). Blocks a later prefill
# chunk allocates join their group's list; each save leaving in this step
# takes its request's lists along.
if self._k3patch_save_groups:
    _k3patch_cached = scheduler_output.scheduled_cached_reqs
    for _k3patch_index, _k3patch_req_id in enumerate(_k3patch_cached.req_ids):
        _k3patch_new = _k3patch_cached.new_block_ids[_k3patch_index]
        if _k3patch_new is not None and _k3patch_req_id in self._k3patch_save_groups:
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
"""

# ---------------------------------------------------------------------------------------------
# The transfer plan (MoRIIOWriter._prepare_transfer_plan). Its region is the three statements
# that choose and cache the offsets: `geometry_key = ...`, `offsets = ....get(geometry_key)` and
# `if offsets is None: ...`. Only the choice inside that `if` differs between the forms.

PLAN_HEAD = """
geometry_key = _get_write_geometry_key(layer_cache)
offsets = request_info.transfer_offsets.get(geometry_key)
"""
PLAN_MISS = "offsets is None"
PLAN_TAIL = """
offsets = self.worker._compute_block_transfer_offsets(
    task.layer_name, _k3_local, _k3_remote, remote_moriio_meta
)
request_info.transfer_offsets[geometry_key] = offsets
"""

# The fork (mamba_blockids): two lists, [attention, mamba], and the mamba one for any Mamba
# layer. On K3 that sends MLA (group 3) to group 0's blocks and every KDA group to group 1's.
FORK_CHOICE = """
from vllm.v1.kv_cache_interface import MambaSpec as _K3MS_BL
_k3_mamba = isinstance(self.worker.layer_to_spec.get(task.layer_name), _K3MS_BL)
if _k3_mamba:
    _k3_local = task.mamba_local_block_ids or task.local_block_ids
    _k3_remote = request_info.mamba_block_ids or request_info.block_ids
else:
    _k3_local = task.local_block_ids
    _k3_remote = request_info.block_ids
"""

# The older fix (apply_kimik3_moriio_group_routing.py): the layer's own group when the lists
# travelled and K3_GROUP_ROUTING is on, the fork's two-group choice otherwise. Right per layer,
# but made inside the geometry-keyed cache, so the first KDA layer's offsets serve all three
# KDA groups.
LEGACY_CHOICE = """
from vllm.v1.kv_cache_interface import MambaSpec as _K3MS_BL
_k3_gr_local = getattr(task, "all_group_block_ids", None)
_k3_gr_remote = getattr(request_info, "all_group_block_ids", None)
_k3_gr_on = getattr(self.worker, "_k3_group_routing", False)
if _k3_gr_on and _k3_gr_local is not None and _k3_gr_remote is not None:
    _k3_gi = self.worker._layer_group_idx.get(task.layer_name, self.worker._attn_group_idx)
    if _k3_gi < len(_k3_gr_local) and _k3_gi < len(_k3_gr_remote):
        _k3_local = _k3_gr_local[_k3_gi]
        _k3_remote = _k3_gr_remote[_k3_gi]
    else:
        _k3_local = task.local_block_ids
        _k3_remote = request_info.block_ids
elif isinstance(self.worker.layer_to_spec.get(task.layer_name), _K3MS_BL):
    _k3_local = task.mamba_local_block_ids or task.local_block_ids
    _k3_remote = request_info.mamba_block_ids or request_info.block_ids
else:
    _k3_local = task.local_block_ids
    _k3_remote = request_info.block_ids
"""

# The fork's optional diagnostic between the choice and the offsets call:
# `import os as X` then `if X.environ.get('K3_MAMBA_BC', '0') == '1': ...` (it logs the choice).
DEBUG_TEST = "{alias}.environ.get('K3_MAMBA_BC', '0') == '1'"

# k3patch's replacement of the whole region.
K3PATCH_PLAN = """
# k3patch moriio-group-routing: each layer's KV goes to its own KV-cache
# group's blocks on both nodes (K3: KDA groups 0-2, MLA group 3), and its
# offsets are cached per layer: K3's KDA groups share one tensor geometry
# but not their block ids. Without per-group ids (a peer that lacks this
# fix) the write fails, never guesses.
_k3patch_local = task.k3patch_group_block_ids
_k3patch_remote = request_info.k3patch_group_block_ids
if _k3patch_local is None or _k3patch_remote is None:
    raise MoRIIOError(
        f"MoRIIO transfer {task.transfer_id}: no per-group block ids from "
        + ("the prefill scheduler" if _k3patch_local is None else "the decode node")
        + "; both nodes need k3patch moriio-group-routing"
    )
_k3patch_group = self.worker._k3patch_group_of_layer[task.layer_name]
geometry_key = (task.layer_name, *_get_write_geometry_key(layer_cache))
offsets = request_info.transfer_offsets.get(geometry_key)
if offsets is None:
    offsets = self.worker._compute_block_transfer_offsets(
        task.layer_name,
        _k3patch_local[_k3patch_group],
        _k3patch_remote[_k3patch_group],
        remote_moriio_meta,
    )
    request_info.transfer_offsets[geometry_key] = offsets
"""

# The older fix's companion (apply_kimik3_chunked_allgrp.py), in build_connector_meta's G1 loop:
# each chunk's new blocks join the all-group lists. Without it they stay as captured at chunk 1.
CHUNKED_ALLGRP = """
try:
    if req_id in getattr(self, '_reqs_save_allgrp', {}):
        _k3ca_cur = self._reqs_save_allgrp[req_id]
        _k3ca_new = []
        for _k3ca_gi in range(len(_k3ca_cur)):
            _k3ca_add = list(new_block_ids[_k3ca_gi]) if _k3ca_gi < len(new_block_ids) else []
            _k3ca_new.append(list(_k3ca_cur[_k3ca_gi]) + _k3ca_add)
        self._reqs_save_allgrp[req_id] = _k3ca_new
        if req_id in getattr(self, '_reqs_save_mamba', {}) and len(_k3ca_new) > 1:
            pass
except Exception:
    pass
"""
# The older fix's capture in update_state_after_alloc (its all-group lists, at the first chunk).
LEGACY_CAPTURE = "self._reqs_save_allgrp[request.request_id] = [list(g) for g in _k3_gbi]"

FORK_SHAPE = "fork: mamba block ids ([0] attention, [1] mamba)"
LEGACY_SHAPE = "older k3-group-routing fix (legacy, defective)"
LEGACY_CHUNKED_SHAPE = "older k3-group-routing fix + k3-chunked-allgrp (legacy, defective)"

GEOMETRY_DEFECT = (
    "it chooses the block ids inside the geometry-keyed offsets cache (`geometry_key = "
    "_get_write_geometry_key(layer_cache)`: shape, stride, dtype), so the offsets of the first "
    "layer of a geometry are reused for every later layer of that geometry in the request; K3's "
    "three KDA groups share one geometry, so it misroutes the 2nd and 3rd KDA groups into the "
    "1st group's blocks"
)
FIRST_CHUNK_DEFECT = (
    "the all-group block lists are captured at the first chunk only; later chunks' block lists "
    "are never sent (its companion apply_kimik3_chunked_allgrp.py, which grows them, is not "
    "applied)"
)
LEGACY_CAVEATS = (
    "its fallbacks are silent (a group map that fails to build is group 0; a task without the "
    "lists takes the two-group choice) and K3_GROUP_ROUTING=0 restores the bug"
)


# ---------------------------------------------------------------------------------------------
# Reading the AST: small helpers that keep the site declarations below readable.


def _names(node: ast.AST) -> set[str]:
    """Identifiers, attribute names, keywords, parameters and string constants under `node`."""
    return mentioned_names(node, everything=True)


def _scope(tree: ast.Module, path: tuple[str, ...]) -> ast.AST | None:
    node: ast.AST = tree
    for name in path:
        for child in getattr(node, "body", []):
            if (
                isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and child.name == name
            ):
                node = child
                break
        else:
            return None
    return node


def _bodies(node: ast.AST) -> Iterator[list[ast.stmt]]:
    """Every statement list inside a function, nested blocks included, nested defs excluded."""
    for name in ("body", "orelse", "finalbody"):
        stmts = getattr(node, name, None)
        if isinstance(stmts, list) and stmts and isinstance(stmts[0], ast.stmt):
            yield stmts
            for stmt in stmts:
                if not isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    yield from _bodies(stmt)
    for handler in getattr(node, "handlers", []):
        yield from _bodies(handler)


def _fingerprint(stmts: list[ast.stmt]) -> str:
    return site_fingerprint(stmts[0] if len(stmts) == 1 else stmts)


@functools.cache
def source_fingerprint(source: str) -> str:
    # The shapes are constants: parse each once, not once per site look.
    return _source_fingerprint(source)


@functools.cache
def _expr_fingerprint(source: str) -> str:
    return site_fingerprint(ast.parse(source.strip(), mode="eval").body)


@functools.cache
def _count_statements(source: str) -> int:
    return len(ast.parse(_dedent(source)).body)


def _dedent(source: str) -> str:
    import textwrap

    return textwrap.dedent(source).strip("\n") + "\n"


def _head(stmt: ast.stmt) -> str:
    """A cheap key of a statement (its kind and what it assigns) to skip most fingerprints."""
    if isinstance(stmt, ast.Assign):
        return "Assign " + " ".join(ast.unparse(t) for t in stmt.targets)
    if isinstance(stmt, ast.AnnAssign):
        return "AnnAssign " + ast.unparse(stmt.target)
    return type(stmt).__name__


def _is_self_attr(node: ast.AST, attr: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == attr
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def _callee(call: ast.Call) -> str:
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute):
        return call.func.attr
    return ""


def _short(text: str, lines: int = 40) -> str:
    parts = text.splitlines()
    if len(parts) <= lines:
        return text
    return "\n".join([*parts[:lines], f"... ({len(parts) - lines} more lines)"])


def _stores(node: ast.AST) -> set[str]:
    """Names bound anywhere under `node` (assignment targets, loop targets, imports, ...)."""
    out = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    for n in ast.walk(node):
        if isinstance(n, ast.Import | ast.ImportFrom):
            out |= {(a.asname or a.name).split(".")[0] for a in n.names}
    return out


# ---------------------------------------------------------------------------------------------
# Writing text: edits are computed from AST positions of the current text and applied bottom
# up, so everything outside the edited spans stays byte-identical.


# The nodes whose positions an edit is computed from. ast.AST itself carries no position (a
# module, an operator, an expression context has none); these four always do.
_Located = ast.stmt | ast.expr | ast.keyword | ast.arg


@dataclass(frozen=True)
class _Edit:
    start: int
    end: int
    text: str


class _Text:
    def __init__(self, text: str) -> None:
        self.text = text
        self.starts = [0] + [m.end() for m in re.finditer("\n", text)]

    def line(self, lineno: int) -> str:
        start = self.starts[lineno - 1]
        end = self.starts[lineno] if lineno < len(self.starts) else len(self.text)
        return self.text[start:end]

    def offset(self, lineno: int, col: int) -> int:
        # ast columns count UTF-8 bytes.
        line = self.line(lineno)
        return self.starts[lineno - 1] + len(line.encode("utf-8")[:col].decode("utf-8"))

    def after_line(self, lineno: int) -> int:
        return self.starts[lineno] if lineno < len(self.starts) else len(self.text)

    def indent_of(self, node: _Located) -> str:
        line = self.line(node.lineno)
        prefix = line[: len(line.encode("utf-8")[: node.col_offset].decode("utf-8"))]
        if prefix.strip():
            raise ValueError(f"line {node.lineno}: the statement does not start its line")
        return prefix

    def ends_line(self, node: _Located) -> bool:
        assert node.end_lineno is not None and node.end_col_offset is not None
        rest = self.text[
            self.offset(node.end_lineno, node.end_col_offset) : self.after_line(node.end_lineno)
        ]
        return not rest.strip() or rest.strip().startswith("#")


def _block(source: str, indent: str) -> str:
    lines = _dedent(source).splitlines()
    return "".join(f"{indent}{line}\n" if line.strip() else "\n" for line in lines)


def _insert_after(text: _Text, stmt: ast.stmt, source: str) -> _Edit:
    if not text.ends_line(stmt):
        raise ValueError(f"line {stmt.end_lineno}: another statement follows on the same line")
    assert stmt.end_lineno is not None
    at = text.after_line(stmt.end_lineno)
    block = _block(source, text.indent_of(stmt))
    if at == len(text.text) and not text.text.endswith("\n"):
        block = "\n" + block
    return _Edit(at, at, block)


def _insert_before(text: _Text, stmt: ast.stmt, source: str) -> _Edit:
    at = text.starts[stmt.lineno - 1]
    return _Edit(at, at, _block(source, text.indent_of(stmt)) + "\n")


def _replace(text: _Text, stmts: list[ast.stmt], source: str) -> _Edit:
    last = stmts[-1]
    if not text.ends_line(last):
        raise ValueError(f"line {last.end_lineno}: another statement follows on the same line")
    assert last.end_lineno is not None
    start = text.starts[stmts[0].lineno - 1]
    return _Edit(start, text.after_line(last.end_lineno), _block(source, text.indent_of(stmts[0])))


def _append_item(
    text: _Text, opener: _Located, first: _Located, last: _Located, item: str
) -> _Edit:
    """Add `item` after the final argument / parameter / dict entry of `opener`, which begins
    at `first` (a keyword, a parameter, a dict key) and ends at `last` (its value/default)."""
    assert last.end_lineno is not None and last.end_col_offset is not None
    at = text.offset(last.end_lineno, last.end_col_offset)
    line = text.line(first.lineno)
    before = line[: len(line.encode("utf-8")[: first.col_offset].decode("utf-8"))]
    if first.lineno > opener.lineno and not before.strip():
        # One item per line: the new one gets its own line at the same indentation. After a
        # trailing comma it goes below the line, so a comment there (the older scripts' marker
        # comments, which their own re-runs look for) stays with its item.
        rest = text.text[at : text.after_line(last.end_lineno)]
        if rest.lstrip().startswith(",") and last.end_lineno < len(text.starts):
            below = text.after_line(last.end_lineno)
            return _Edit(below, below, f"{before}{item},\n")
        return _Edit(at, at, f",\n{before}{item}")
    return _Edit(at, at, f", {item}")


def _apply(text: str, edits: list[_Edit]) -> str:
    ordered = sorted(edits, key=lambda e: (e.start, e.end), reverse=True)
    for later, earlier in itertools.pairwise(ordered):
        if earlier.end > later.start:
            raise ValueError("overlapping edits")
    for edit in ordered:
        text = text[: edit.start] + edit.text + text[edit.end :]
    return text


# ---------------------------------------------------------------------------------------------
# Site parts. A part looks at one piece of a site and says: the fork's shape (to be routed per
# group), k3patch's shape, or neither (drift). A site is pending only when all its parts are
# the fork's, applied only when all are k3patch's; any mixture is drift. A part whose anchor is
# one of the fork's own statements is `evidence`: only such a part seeing the fork's shape (or
# k3patch's) makes the package a fork package at all.


class _State(enum.Enum):
    FORK = "fork"
    APPLIED = "applied"
    DRIFT = "drift"


@dataclass(frozen=True)
class _Look:
    state: _State | None  # None: a precondition that holds, no opinion
    line: int | None = None
    found: str = ""
    expected: tuple[str, ...] = ()
    why: str = ""  # the drift reason, or for a pending form what is wrong with it
    shape: str = ""  # the form seen, when it is not the plain fork's


def _drift(
    why: str, found: str = "", expected: tuple[str, ...] = (), line: int | None = None
) -> _Look:
    return _Look(_State.DRIFT, line, found, expected, why)


class _Part:
    evidence = False

    def look(self, src: SourceFile) -> _Look:
        raise NotImplementedError

    def edits(self, src: SourceFile, text: _Text) -> list[_Edit]:
        return []


def _function(src: SourceFile, scope: tuple[str, ...]) -> ast.FunctionDef | None:
    node = _scope(src.tree, scope)
    return node if isinstance(node, ast.FunctionDef) else None


@dataclass(frozen=True)
class _Field(_Part):
    """A dataclass field: the fork's `fork` field is there; k3patch adds FIELD after the last."""

    cls: str
    fork: str  # the fork's field statement, e.g. "mamba_block_ids: list[int] | None = None"
    evidence = True

    def _fields(self, src: SourceFile) -> tuple[ast.ClassDef | None, dict[str, ast.AnnAssign]]:
        cls = find_class(src.tree, self.cls)
        if cls is None:
            return None, {}
        fields = {
            s.target.id: s
            for s in cls.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        }
        return cls, fields

    def look(self, src: SourceFile) -> _Look:
        cls, fields = self._fields(src)
        if cls is None:
            return _drift(f"class {self.cls} is absent", expected=(f"class {self.cls}",))
        mine = fields.get(FIELD_NAME)
        if mine is not None:
            if site_fingerprint(mine) == source_fingerprint(FIELD):
                return _Look(_State.APPLIED, mine.lineno)
            return _drift(
                f"{self.cls}.{FIELD_NAME} is not k3patch's field",
                src.segment(mine),
                (FIELD,),
                mine.lineno,
            )
        want = source_fingerprint(self.fork)
        name = ast.parse(self.fork).body[0]
        assert isinstance(name, ast.AnnAssign) and isinstance(name.target, ast.Name)
        candidate = fields.get(name.target.id)
        fork = [candidate] if candidate and site_fingerprint(candidate) == want else []
        if fork:
            return _Look(_State.FORK, fork[0].lineno)
        return _drift(
            f"{self.cls} has no `{self.fork}` field (the fork's mamba block ids)",
            _short(src.segment(cls)),
            (f"{self.cls}.{self.fork} (fork)", f"{self.cls}.{FIELD} (k3patch)"),
            cls.lineno,
        )

    def edits(self, src: SourceFile, text: _Text) -> list[_Edit]:
        cls, fields = self._fields(src)
        assert cls is not None
        last = max(fields.values(), key=lambda s: s.lineno)
        return [_insert_after(text, last, f"{FIELD_COMMENT}\n{FIELD}\n")]


@dataclass(frozen=True)
class _After(_Part):
    """Statements k3patch adds right after the one statement `anchor` picks out."""

    scope: tuple[str, ...]
    describe: str
    anchor: Callable[[ast.stmt], bool]
    added: Callable[[ast.stmt], str | None]
    marker: str
    evidence: bool = True  # False where the anchor is upstream's own statement

    def _find(
        self, src: SourceFile
    ) -> tuple[ast.FunctionDef | None, list[tuple[list[ast.stmt], int]]]:
        fn = _function(src, self.scope)
        if fn is None:
            return None, []
        hits = [(body, i) for body in _bodies(fn) for i, s in enumerate(body) if self.anchor(s)]
        return fn, hits

    def look(self, src: SourceFile) -> _Look:
        where = ".".join(self.scope)
        fn, hits = self._find(src)
        if fn is None:
            return _drift(f"{where} is absent", expected=(where,))
        if len(hits) != 1:
            return _drift(
                f"{where}: expected one {self.describe}, found {len(hits)}",
                _short(src.segment(fn)),
                (self.describe,),
                fn.lineno,
            )
        body, i = hits[0]
        anchor = body[i]
        want = self.added(anchor)
        if want is None:
            return _drift(
                f"{where}: {self.describe} is not in the fork's shape",
                src.segment(anchor),
                (self.describe,),
                anchor.lineno,
            )
        count = _count_statements(want)
        fingerprint = source_fingerprint(want)
        head = _head(ast.parse(_dedent(want)).body[0])
        # k3patch puts its statements right after the anchor, but a script that runs again
        # later (the recipe re-runs its scripts at every container start; xfer_probe then
        # inserts its dump after `self.layer_to_spec = ...` once more) may push them down the
        # same block: they still follow the anchor, so they still count.
        for j in range(i + 1, len(body) - count + 1):
            if _head(body[j]) == head and _fingerprint(body[j : j + count]) == fingerprint:
                return _Look(_State.APPLIED, body[j].lineno)
        if self.marker in src.text and self.marker in _names(fn):
            return _drift(
                f"{where}: `{self.marker}` is used, but not in k3patch's shape",
                _short(src.segment(fn)),
                (_dedent(want),),
                fn.lineno,
            )
        return _Look(_State.FORK, anchor.lineno)

    def edits(self, src: SourceFile, text: _Text) -> list[_Edit]:
        _, hits = self._find(src)
        body, i = hits[0]
        want = self.added(body[i])
        assert want is not None
        return [_insert_after(text, body[i], want)]


@dataclass(frozen=True)
class _BeforeReturn(_Part):
    """Statements k3patch adds right before a function's final `return`."""

    scope: tuple[str, ...]
    added: str
    marker: str

    def look(self, src: SourceFile) -> _Look:
        where = ".".join(self.scope)
        fn = _function(src, self.scope)
        if fn is None:
            return _drift(f"{where} is absent", expected=(where,))
        last = fn.body[-1]
        if not isinstance(last, ast.Return):
            return _drift(f"{where} does not end in a return", src.segment(last), line=last.lineno)
        count = _count_statements(self.added)
        before = fn.body[-1 - count : -1]
        if len(before) == count and _fingerprint(before) == source_fingerprint(self.added):
            return _Look(_State.APPLIED, before[0].lineno)
        if self.marker in src.text and self.marker in _names(fn):
            return _drift(
                f"{where}: `{self.marker}` is used, but not in k3patch's shape",
                _short(src.segment(fn)),
                (_dedent(self.added),),
                fn.lineno,
            )
        return _Look(_State.FORK, last.lineno)

    def edits(self, src: SourceFile, text: _Text) -> list[_Edit]:
        fn = _function(src, self.scope)
        assert fn is not None
        return [_insert_before(text, fn.body[-1], self.added)]


@dataclass(frozen=True)
class _Keyword(_Part):
    """A keyword k3patch adds to the one call of `callee` that passes the fork's `anchor`."""

    scope: tuple[str, ...]
    callee: str
    anchor: str
    added: Callable[[ast.Call], tuple[str, str] | None]
    evidence = True

    def _call(self, src: SourceFile) -> tuple[ast.FunctionDef | None, list[ast.Call]]:
        fn = _function(src, self.scope)
        if fn is None:
            return None, []
        calls = [
            c
            for c in ast.walk(fn)
            if isinstance(c, ast.Call)
            and _callee(c) == self.callee
            and any(k.arg == self.anchor for k in c.keywords)
        ]
        return fn, calls

    def look(self, src: SourceFile) -> _Look:
        where = ".".join(self.scope)
        fn, calls = self._call(src)
        if fn is None:
            return _drift(f"{where} is absent", expected=(where,))
        if len(calls) != 1:
            return _drift(
                f"{where}: expected one {self.callee}(..., {self.anchor}=...) call, "
                f"found {len(calls)}",
                _short(src.segment(fn)),
                (f"{self.callee}(..., {self.anchor}=...)",),
                fn.lineno,
            )
        call = calls[0]
        want = self.added(call)
        if want is None:
            return _drift(
                f"{where}: {self.anchor}= is not passed in the fork's shape",
                src.segment(call),
                line=call.lineno,
            )
        name, value = want
        keywords = {k.arg: k for k in call.keywords if k.arg}
        if name in keywords:
            if site_fingerprint(keywords[name].value) == _expr_fingerprint(value):
                return _Look(_State.APPLIED, call.lineno)
            return _drift(
                f"{where}: {name}= is passed, but not as k3patch passes it",
                src.segment(call),
                (f"{name}={value}",),
                call.lineno,
            )
        return _Look(_State.FORK, call.lineno)

    def edits(self, src: SourceFile, text: _Text) -> list[_Edit]:
        _, calls = self._call(src)
        call = calls[0]
        want = self.added(call)
        assert want is not None
        items: list[_Located] = [*call.args, *call.keywords]
        last = max(items, key=lambda n: (n.end_lineno or 0, n.end_col_offset or 0))
        return [_append_item(text, call, last, last, f"{want[0]}={want[1]}")]


@dataclass(frozen=True)
class _Param(_Part):
    """A parameter k3patch appends to a function that takes the fork's `anchor` parameter."""

    scope: tuple[str, ...]
    anchor: str
    added: str  # "name: annotation = default"
    evidence = True

    def _expected(self) -> ast.arguments:
        fn = ast.parse(f"def f({self.added}): pass").body[0]
        assert isinstance(fn, ast.FunctionDef)
        return fn.args

    def look(self, src: SourceFile) -> _Look:
        where = ".".join(self.scope)
        fn = _function(src, self.scope)
        if fn is None:
            return _drift(f"{where} is absent", expected=(where,))
        args = fn.args
        if args.vararg or args.kwarg or args.kwonlyargs:
            return _drift(
                f"{where}: unexpected *args/**kwargs/keyword-only parameters",
                src.segment(fn.args),
                line=fn.lineno,
            )
        params = [*args.posonlyargs, *args.args]
        by_name = {a.arg: a for a in params}
        want = self._expected()
        name = want.args[0].arg
        if name in by_name:
            mine = by_name[name]
            index = params.index(mine) - (len(params) - len(args.defaults))
            default = args.defaults[index] if index >= 0 else None
            same = (
                mine.annotation is not None
                and want.args[0].annotation is not None
                and site_fingerprint(mine.annotation) == site_fingerprint(want.args[0].annotation)
                and default is not None
                and site_fingerprint(default) == site_fingerprint(want.defaults[0])
            )
            if same:
                return _Look(_State.APPLIED, fn.lineno)
            return _drift(
                f"{where}: parameter {name} is not k3patch's",
                src.segment(mine),
                (self.added,),
                fn.lineno,
            )
        if self.anchor in by_name:
            return _Look(_State.FORK, fn.lineno)
        return _drift(
            f"{where} takes no `{self.anchor}` (the fork's mamba block ids)",
            _short(src.segment(fn), 12),
            (f"{where}(..., {self.anchor}=...)",),
            fn.lineno,
        )

    def edits(self, src: SourceFile, text: _Text) -> list[_Edit]:
        fn = _function(src, self.scope)
        assert fn is not None
        args = fn.args
        last_arg = [*args.posonlyargs, *args.args][-1]
        last: _Located = last_arg
        if args.defaults and args.args and args.args[-1] is last_arg:
            last = args.defaults[-1]
        return [_append_item(text, fn, last_arg, last, self.added)]


@dataclass(frozen=True)
class _DictKey(_Part):
    """A key k3patch adds to the one dict literal that carries the fork's `anchor` key."""

    scope: tuple[str, ...]
    anchor: str
    key: str
    value: str
    evidence = True

    def _dict(self, src: SourceFile) -> tuple[ast.FunctionDef | None, list[ast.Dict]]:
        fn = _function(src, self.scope)
        if fn is None:
            return None, []
        found = [
            d
            for d in ast.walk(fn)
            if isinstance(d, ast.Dict)
            and any(isinstance(k, ast.Constant) and k.value == self.anchor for k in d.keys)
        ]
        return fn, found

    def look(self, src: SourceFile) -> _Look:
        where = ".".join(self.scope)
        fn, found = self._dict(src)
        if fn is None:
            return _drift(f"{where} is absent", expected=(where,))
        if len(found) != 1:
            return _drift(
                f"{where}: expected one message dict with {self.anchor!r}, found {len(found)}",
                _short(src.segment(fn)),
                line=fn.lineno,
            )
        entries = {
            k.value: v
            for k, v in zip(found[0].keys, found[0].values, strict=True)
            if isinstance(k, ast.Constant)
        }
        if self.key in entries:
            if site_fingerprint(entries[self.key]) == _expr_fingerprint(self.value):
                return _Look(_State.APPLIED, found[0].lineno)
            return _drift(
                f"{where}: message key {self.key!r} is not k3patch's",
                src.segment(found[0]),
                (f'"{self.key}": {self.value}',),
                found[0].lineno,
            )
        return _Look(_State.FORK, found[0].lineno)

    def edits(self, src: SourceFile, text: _Text) -> list[_Edit]:
        _, found = self._dict(src)
        message = found[0]
        key = message.keys[-1]
        if key is None:  # a `**mapping` entry
            key = message.values[-1]
        return [_append_item(text, message, key, message.values[-1], f'"{self.key}": {self.value}')]


@dataclass(frozen=True)
class _Function(_Part):
    """A module-level function k3patch appends to the module."""

    name: str
    source: str

    def look(self, src: SourceFile) -> _Look:
        fn = find_function(src.tree, self.name)
        if fn is None:
            return _Look(_State.FORK)
        if site_fingerprint(fn) == source_fingerprint(self.source):
            return _Look(_State.APPLIED, fn.lineno)
        return _drift(
            f"{self.name} is not k3patch's function",
            _short(src.segment(fn)),
            (_dedent(self.source),),
            fn.lineno,
        )

    def edits(self, src: SourceFile, text: _Text) -> list[_Edit]:
        end = len(text.text)
        lead = "\n\n" if text.text.endswith("\n") else "\n\n\n"
        return [_Edit(end, end, lead + _dedent(self.source))]


@dataclass(frozen=True)
class _PlanRegion:
    kind: str  # "fork", "legacy" or "k3patch"
    stmts: list[ast.stmt]  # the statements `apply` replaces
    debug: bool  # the fork's K3_MAMBA_BC block sits between the choice and the offsets call


def _is_debug_block(stmts: list[ast.stmt]) -> bool:
    """`import os as X` + `if X.environ.get('K3_MAMBA_BC', '0') == '1': ...` that only logs:
    no else branch, and nothing bound that the offsets call or the cache store reads."""
    if len(stmts) != 2:
        return False
    imp, gate = stmts
    if not (
        isinstance(imp, ast.Import)
        and len(imp.names) == 1
        and imp.names[0].name == "os"
        and imp.names[0].asname
        and isinstance(gate, ast.If)
        and not gate.orelse
    ):
        return False
    test = DEBUG_TEST.format(alias=imp.names[0].asname)
    read_later = {"offsets", "geometry_key", "_k3_local", "_k3_remote", "task", "request_info"}
    return site_fingerprint(gate.test) == _expr_fingerprint(test) and not (
        _stores(gate) & read_later
    )


def _plan_regions(fn: ast.FunctionDef) -> list[_PlanRegion]:
    head = source_fingerprint(PLAN_HEAD)
    miss = _expr_fingerprint(PLAN_MISS)
    tail = source_fingerprint(PLAN_TAIL)
    mine = source_fingerprint(K3PATCH_PLAN)
    n_mine = _count_statements(K3PATCH_PLAN)
    choices = (
        ("fork", source_fingerprint(FORK_CHOICE), _count_statements(FORK_CHOICE)),
        ("legacy", source_fingerprint(LEGACY_CHOICE), _count_statements(LEGACY_CHOICE)),
    )
    found = []
    for body in _bodies(fn):
        for i in range(len(body)):
            if _head(body[i]) == "Assign _k3patch_local" and (
                _fingerprint(body[i : i + n_mine]) == mine
            ):
                found.append(_PlanRegion("k3patch", body[i : i + n_mine], False))
                continue
            if _head(body[i]) != "Assign geometry_key" or i + 2 >= len(body):
                continue
            check = body[i + 2]
            if _fingerprint(body[i : i + 2]) != head or not isinstance(check, ast.If):
                continue
            if check.orelse or site_fingerprint(check.test) != miss:
                continue
            inner = check.body
            for kind, choice, n in choices:
                if _fingerprint(inner[:n]) != choice:
                    continue
                rest = inner[n:]
                debug = _is_debug_block(rest[:2]) and len(rest) > 2
                if debug:
                    rest = rest[2:]
                if rest and _fingerprint(rest) == tail:
                    found.append(_PlanRegion(kind, body[i : i + 3], debug))
    return found


@dataclass(frozen=True)
class _Plan(_Part):
    """The per-layer choice of block ids and the offsets cache in the transfer plan."""

    scope: tuple[str, ...] = ("MoRIIOWriter", "_prepare_transfer_plan")
    evidence = True

    def look(self, src: SourceFile) -> _Look:
        where = ".".join(self.scope)
        fn = _function(src, self.scope)
        if fn is None:
            return _drift(f"{where} is absent", expected=(where,))
        regions = _plan_regions(fn)
        if len(regions) != 1:
            return _drift(
                f"{where}: the per-layer block-id choice is in no known shape"
                + (f" ({len(regions)} candidate regions)" if regions else ""),
                _short(src.segment(fn), 60),
                (
                    f"fork: {_dedent(PLAN_HEAD)}if {PLAN_MISS}:\n"
                    f"{_block(FORK_CHOICE, '    ')}    [K3_MAMBA_BC debug block]\n"
                    f"{_block(PLAN_TAIL, '    ')}",
                    f"older k3-group-routing fix: the same with\n{_block(LEGACY_CHOICE, '    ')}",
                    f"k3patch: {_dedent(K3PATCH_PLAN)}",
                ),
                fn.lineno,
            )
        region = regions[0]
        line = region.stmts[0].lineno
        if region.kind == "k3patch":
            return _Look(_State.APPLIED, line)
        debug = (
            "; the K3_MAMBA_BC debug block that logs that choice goes with it"
            if region.debug
            else ""
        )
        if region.kind == "fork":
            return _Look(
                _State.FORK,
                line,
                why="the fork routes by [0]/[1] (MLA into group 0's blocks, every KDA group into "
                "group 1's) and caches offsets by tensor geometry alone" + debug,
            )
        return _Look(
            _State.FORK,
            line,
            why=f"the older k3-group-routing fix: {GEOMETRY_DEFECT}; {LEGACY_CAVEATS}"
            + (
                # The older fix replaced the statement that binds `_k3_mamba` but left the
                # fork's debug block that reads it.
                "; its K3_MAMBA_BC block still reads `_k3_mamba`, which the older fix no "
                "longer binds (a NameError with K3_MAMBA_BC=1)"
                if region.debug
                else ""
            )
            + debug,
            shape=LEGACY_SHAPE,
        )

    def edits(self, src: SourceFile, text: _Text) -> list[_Edit]:
        fn = _function(src, self.scope)
        assert fn is not None
        region = _plan_regions(fn)[0]
        return [_replace(text, region.stmts, K3PATCH_PLAN)]


def _grows_allgrp_head(node: ast.Try) -> bool:
    """A cheap look at a `try:` before its fingerprint: does it open with the companion's test?"""
    first = node.body[0] if node.body else None
    return isinstance(first, ast.If) and "_reqs_save_allgrp" in ast.unparse(first.test)


@dataclass(frozen=True)
class _LegacyGrowth(_Part):
    """No opinion on the site's state; names the older fix's first-chunk defect where its
    capture is there and its chunked companion is not."""

    def look(self, src: SourceFile) -> _Look:
        usaa = _function(src, _USAA)
        bcm = _function(src, (_SCHED, "build_connector_meta"))
        if usaa is None or bcm is None:
            return _Look(None)
        capture = source_fingerprint(LEGACY_CAPTURE)
        if not any(
            _head(s) == "Assign self._reqs_save_allgrp[request.request_id]"
            and site_fingerprint(s) == capture
            for body in _bodies(usaa)
            for s in body
        ):
            return _Look(None)
        grows = source_fingerprint(CHUNKED_ALLGRP)
        tries = [s for s in ast.walk(bcm) if isinstance(s, ast.Try) and _grows_allgrp_head(s)]
        if any(site_fingerprint(s) == grows for s in tries):
            return _Look(
                None,
                why="the older fix's chunked companion grows its all-group lists per chunk",
                shape=LEGACY_CHUNKED_SHAPE,
            )
        return _Look(
            None, why=f"older k3-group-routing fix: {FIRST_CHUNK_DEFECT}", shape=LEGACY_SHAPE
        )


@dataclass(frozen=True)
class _Requires(_Part):
    """A precondition of k3patch's text (a name it uses must exist); no opinion when it holds."""

    what: str
    holds: Callable[[SourceFile], bool]

    def look(self, src: SourceFile) -> _Look:
        if self.holds(src):
            return _Look(None)
        return _drift(f"k3patch's text needs {self.what}", expected=(self.what,))


def _has_param(scope: tuple[str, ...], name: str) -> Callable[[SourceFile], bool]:
    def holds(src: SourceFile) -> bool:
        fn = _function(src, scope)
        return fn is not None and name in {a.arg for a in [*fn.args.posonlyargs, *fn.args.args]}

    return holds


@dataclass(frozen=True)
class _SiteLook:
    verdict: Verdict
    look: _Look
    notes: tuple[str, ...]  # what is wrong with a pending form, beyond the fork's bug
    shape: str  # the form seen when it is not the plain fork's
    evidence: bool  # an anchored part saw the fork's shape or k3patch's


@dataclass(frozen=True)
class _Site:
    name: str
    file: str
    parts: tuple[_Part, ...]
    what: str  # what k3patch does here, for reports

    def look(self, src: SourceFile) -> _SiteLook:
        looks = [(part, part.look(src)) for part in self.parts]
        evidence = any(
            part.evidence and look.state in (_State.FORK, _State.APPLIED) for part, look in looks
        )
        notes = tuple(look.why for _, look in looks if look.state is not _State.DRIFT and look.why)
        shape = next((look.shape for _, look in looks if look.shape), "")
        states = [look for _, look in looks if look.state is not None]
        for look in states:
            if look.state is _State.DRIFT:
                return _SiteLook(Verdict.DRIFTED, look, (), "", evidence)
        kinds = {look.state for look in states}
        line = next((look.line for look in states if look.line), None)
        if kinds == {_State.APPLIED}:
            return _SiteLook(Verdict.APPLIED, _Look(_State.APPLIED, line), (), "", evidence)
        if kinds == {_State.FORK}:
            return _SiteLook(Verdict.PENDING, _Look(_State.FORK, line), notes, shape, evidence)
        return _SiteLook(
            Verdict.DRIFTED,
            _drift("partly in k3patch's shape, partly in the fork's: edited by hand?", line=line),
            (),
            "",
            evidence,
        )


# ---------------------------------------------------------------------------------------------
# The fork's sites, one per hop the block ids take (SITES.md section 1, "The fork").

_SCHED = "MoRIIOConnectorScheduler"
_WORKER = "MoRIIOConnectorWorker"
_USAA = (_SCHED, "update_state_after_alloc")


def _assign_target(stmt: ast.stmt) -> ast.expr | None:
    if isinstance(stmt, ast.AnnAssign):
        return stmt.target
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        return stmt.targets[0]
    return None


def _is_scheduler_dict(stmt: ast.stmt) -> bool:
    # `self._reqs_save_mamba: dict[ReqId, list[int]] = {}`, annotated or not.
    target = _assign_target(stmt)
    value = getattr(stmt, "value", None)
    return (
        target is not None
        and _is_self_attr(target, "_reqs_save_mamba")
        and isinstance(value, ast.Dict)
        and not value.keys
    )


def _scheduler_dict(stmt: ast.stmt) -> str | None:
    return SCHEDULER_DICT


# The fork's capture in uSAA (do_remote_decode): the mamba group [1] of `_k3_gbi`.
FORK_CAPTURE = (
    "self._reqs_save_mamba[request.request_id] = list(_k3_gbi[1]) if len(_k3_gbi) > 1 else []"
)
FORK_NOTIFY = (
    "mamba_block_notify_list = ((list(_k3_gbi_d[1]) if len(_k3_gbi_d) > 1 else [])"
    " if num_external_tokens > 0 else [])"
)


def _is_fork_capture(stmt: ast.stmt) -> bool:
    return _head(stmt) == "Assign self._reqs_save_mamba[request.request_id]"


def _capture_all_groups(stmt: ast.stmt) -> str | None:
    if site_fingerprint(stmt) != source_fingerprint(FORK_CAPTURE):
        return None
    return (
        "# k3patch moriio-group-routing: every group's blocks, not only [0]/[1]\n"
        "self._k3patch_save_groups[request.request_id] = [\n"
        "    list(_k3patch_g) for _k3patch_g in _k3_gbi\n"
        "]\n"
    )


def _is_fork_notify(stmt: ast.stmt) -> bool:
    return _head(stmt) == "Assign mamba_block_notify_list"


def _notify_all_groups(stmt: ast.stmt) -> str | None:
    if site_fingerprint(stmt) != source_fingerprint(FORK_NOTIFY):
        return None
    return (
        "# k3patch moriio-group-routing: send every group's blocks\n"
        "_k3patch_group_notify = (\n"
        "    [list(_k3patch_g) for _k3patch_g in _k3_gbi_d] if num_external_tokens > 0 else []\n"
        ")\n"
    )


def _is_layer_to_spec(stmt: ast.stmt) -> bool:
    return (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and _is_self_attr(stmt.targets[0], "layer_to_spec")
        and site_fingerprint(stmt)
        == source_fingerprint("self.layer_to_spec = build_layer_to_spec(kv_cache_config)")
    )


def _worker_map(stmt: ast.stmt) -> str | None:
    return WORKER_MAP


def _fixed(name: str, value: str, fork: str) -> Callable[[ast.Call], tuple[str, str] | None]:
    """k3patch passes `name=value` where the fork passes its mamba list as `fork` (source)."""

    def added(call: ast.Call) -> tuple[str, str] | None:
        passed = next(k.value for k in call.keywords if k.arg and k.arg.startswith("mamba_"))
        if site_fingerprint(passed) != _expr_fingerprint(fork):
            return None
        return name, value

    return added


FORK_SITES: tuple[_Site, ...] = (
    _Site(
        f"WriteTask.{FIELD_NAME}",
        COMMON,
        (_Field("WriteTask", "mamba_local_block_ids: list[int] | None = None"),),
        "the write task carries every group's local block ids",
    ),
    _Site(
        f"RemoteAllocInfo.{FIELD_NAME}",
        COMMON,
        (_Field("RemoteAllocInfo", "mamba_block_ids: list[int] | None = None"),),
        "the decode node's block ids of every group, as the prefill node received them",
    ),
    _Site(
        f"ReqMeta.{FIELD_NAME}",
        COMMON,
        (_Field("ReqMeta", "mamba_local_block_ids: list[int] = field(default_factory=list)"),),
        "the connector metadata carries every group's block ids",
    ),
    _Site(
        f"{_SCHED}.__init__",
        CONNECTOR,
        (
            _After(
                (_SCHED, "__init__"),
                "`self._reqs_save_mamba = {}`",
                _is_scheduler_dict,
                _scheduler_dict,
                "_k3patch_save_groups",
            ),
        ),
        "a per-request dict of every group's blocks beside the fork's `_reqs_save_mamba`",
    ),
    _Site(
        f"{_SCHED}.update_state_after_alloc (prefill capture)",
        CONNECTOR,
        (
            _After(
                _USAA,
                "`self._reqs_save_mamba[request.request_id] = ..._k3_gbi[1]...` capture",
                _is_fork_capture,
                _capture_all_groups,
                "_k3patch_save_groups",
            ),
        ),
        "the prefill scheduler captures every group's blocks, not only [1]",
    ),
    _Site(
        f"{_SCHED}.update_state_after_alloc (decode notify)",
        CONNECTOR,
        (
            _Requires(
                "update_state_after_alloc(..., num_external_tokens)",
                _has_param(_USAA, "num_external_tokens"),
            ),
            _After(
                _USAA,
                "`mamba_block_notify_list = ..._k3_gbi_d[1]...`",
                _is_fork_notify,
                _notify_all_groups,
                "_k3patch_group_notify",
            ),
            _Keyword(
                _USAA,
                "send_notify_block",
                "mamba_block_notify_list",
                _fixed(
                    "k3patch_group_block_notify",
                    "_k3patch_group_notify",
                    "mamba_block_notify_list",
                ),
            ),
        ),
        "the decode scheduler sends every group's blocks to the prefill node",
    ),
    _Site(
        f"{_SCHED}.send_notify_block",
        CONNECTOR,
        (
            _Param(
                (_SCHED, "send_notify_block"),
                "mamba_block_notify_list",
                "k3patch_group_block_notify: list[list[int]] | None = None",
            ),
            _DictKey(
                (_SCHED, "send_notify_block"),
                "mamba_block_notify_list",
                "k3patch_group_block_ids",
                "k3patch_group_block_notify",
            ),
        ),
        "the notify message has a `k3patch_group_block_ids` key",
    ),
    _Site(
        f"{_SCHED}.build_connector_meta",
        CONNECTOR,
        (
            _Requires(
                "build_connector_meta(self, scheduler_output) ending in `return meta`",
                lambda src: (
                    _has_param((_SCHED, "build_connector_meta"), "scheduler_output")(src)
                    and _returns_meta(src)
                ),
            ),
            _BeforeReturn((_SCHED, "build_connector_meta"), SAVE_GROUPS, "_k3patch_save_groups"),
            _LegacyGrowth(),
        ),
        "later chunks' blocks join their group; each save takes its request's group lists",
    ),
    _Site(
        f"{_WORKER}.__init__",
        CONNECTOR,
        (
            _After(
                (_WORKER, "__init__"),
                "`self.layer_to_spec = build_layer_to_spec(kv_cache_config)`",
                _is_layer_to_spec,
                _worker_map,
                "_k3patch_group_of_layer",
                evidence=False,
            ),
            _Function("_k3patch_kv_cache_group_index", GROUP_INDEX_FUNCTION),
        ),
        "the worker maps every layer to its KV-cache group and finds the attention group",
    ),
    _Site(
        f"{_WORKER}.schedule_write_blocks",
        CONNECTOR,
        (
            _Param(
                (_WORKER, "schedule_write_blocks"),
                "mamba_local_block_ids",
                f"{FIELD_NAME}: list[list[int]] | None = None",
            ),
            _Keyword(
                (_WORKER, "schedule_write_blocks"),
                "WriteTask",
                "mamba_local_block_ids",
                _fixed(FIELD_NAME, FIELD_NAME, "mamba_local_block_ids"),
            ),
        ),
        "every group's block ids go into the write task",
    ),
    _Site(
        f"{_WORKER}._write_blocks_for_req",
        CONNECTOR,
        (
            _Keyword(
                (_WORKER, "_write_blocks_for_req"),
                "schedule_write_blocks",
                "mamba_local_block_ids",
                _fixed(FIELD_NAME, f"meta.{FIELD_NAME}", "meta.mamba_local_block_ids"),
            ),
        ),
        "the metadata's group lists are handed to the write",
    ),
    _Site(
        "MoRIIOWrapper._handle_remote_blocks_message",
        ENGINE,
        (
            _Requires(
                "_handle_remote_blocks_message(self, data)",
                _has_param(("MoRIIOWrapper", "_handle_remote_blocks_message"), "data"),
            ),
            _Keyword(
                ("MoRIIOWrapper", "_handle_remote_blocks_message"),
                "RemoteAllocInfo",
                "mamba_block_ids",
                _fixed(
                    FIELD_NAME,
                    'data.get("k3patch_group_block_ids")',
                    "list(mamba_block_notify_list or [])",
                ),
            ),
        ),
        "the prefill node keeps the decode node's group lists",
    ),
    _Site(
        "MoRIIOWriter._prepare_transfer_plan",
        ENGINE,
        (
            _Requires(
                "MoRIIOError bound in moriio_engine",
                lambda src: module_binds(src.tree, "MoRIIOError"),
            ),
            _Plan(),
        ),
        "each layer's transfer indexes the per-group lists with the layer's own group, and its "
        "offsets are cached per layer",
    ),
)


def _returns_meta(src: SourceFile) -> bool:
    fn = _function(src, (_SCHED, "build_connector_meta"))
    if fn is None:
        return False
    last = fn.body[-1]
    return (
        isinstance(last, ast.Return)
        and isinstance(last.value, ast.Name)
        and (last.value.id == "meta")
    )


# ---------------------------------------------------------------------------------------------
# Upstream shapes: named predicates over the whole package, one verdict for all three files
# (SITES.md section 1, "Upstream").

UPSTREAM_SITES = {
    COMMON: "per-group block ids",
    CONNECTOR: "layer -> KV-cache group map",
    ENGINE: "per-layer transfer routing",
}


def _upstream_033(sources: Sources) -> bool:
    """0.33.0+: `_prepare_transfer_plan` indexes the per-group lists with
    `group = self.worker.layer_to_group[task.layer_name]`."""
    fn = _function(sources[ENGINE], ("MoRIIOWriter", "_prepare_transfer_plan"))
    if fn is None:
        return False
    want = _expr_fingerprint("self.worker.layer_to_group[task.layer_name]")
    return any(
        isinstance(node, ast.Subscript)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "layer_to_group"
        and site_fingerprint(node) == want
        for node in ast.walk(fn)
    )


def _upstream_031(sources: Sources) -> bool:
    """0.31.0-0.32.0: groups split by spec (`_split_kv_cache_group_kinds`) and the worker's
    `layer_to_group = dict(kv_cache_config.transfer_group_index_by_layer)`."""
    tree = sources[CONNECTOR].tree
    init = _function(sources[CONNECTOR], (_WORKER, "__init__"))
    want = source_fingerprint(
        "self.layer_to_group = dict(kv_cache_config.transfer_group_index_by_layer)"
    )
    return (
        find_function(tree, "_split_kv_cache_group_kinds") is not None
        and init is not None
        and any(
            isinstance(s, ast.Assign)
            and _is_self_attr(s.targets[0], "layer_to_group")
            and site_fingerprint(s) == want
            for body in _bodies(init)
            for s in body
        )
    )


def _upstream_030(sources: Sources) -> bool:
    """0.30.0: HMA for sliding-window models only; any other hybrid is refused at init."""
    init = _function(sources[CONNECTOR], (_SCHED, "__init__"))
    return init is not None and "_is_hma_required" in _names(init)


def _upstream_single_group(sources: Sources) -> bool:
    """0.14.1-0.29.0: `MoRIIOConnector` is not SupportsHMA and reads `get_block_ids()[0]`."""
    cls = find_class(sources[CONNECTOR].tree, "MoRIIOConnector")
    if cls is None or "SupportsHMA" in {ast.unparse(b).split(".")[-1] for b in cls.bases}:
        return False
    return any(
        isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and node.slice.value == 0
        and ast.unparse(node.value) == "blocks.get_block_ids()"
        for node in ast.walk(sources[CONNECTOR].tree)
    )


# Positive upstream shapes, tried before the fork's: none of them can hold on a fork tree.
NATIVE_SHAPES: tuple[tuple[str, Verdict, Callable[[Sources], bool], str], ...] = (
    (
        "upstream 0.33.0+ native per-group WRITE routing",
        Verdict.SATISFIED,
        _upstream_033,
        "MoRIIOWriter._prepare_transfer_plan takes `group = self.worker.layer_to_group"
        "[task.layer_name]` and indexes `task.local_block_ids[group]` / "
        "`request_info.block_ids[group]`; groups are split by spec, not position",
    ),
    (
        "upstream 0.31.0-0.32.0 native per-group routing",
        Verdict.SATISFIED,
        _upstream_031,
        "groups are classified by spec (`_split_kv_cache_group_kinds`) and the worker maps "
        "`layer_to_group = dict(kv_cache_config.transfer_group_index_by_layer)`; READ mode "
        "routes per group, WRITE with a Mamba group is refused by register_kv_caches, never "
        "misrouted",
    ),
    (
        "upstream 0.30.0 sliding-window-only HMA",
        Verdict.NOT_APPLICABLE,
        _upstream_030,
        "MoRIIO supports hybrid KV caches for sliding-window models only (READ mode); a Mamba "
        "group is refused at scheduler init, so Kimi-K3 cannot use MoRIIO on this version",
    ),
)
# The single-group connector holds on the fork too (its READ path keeps `get_block_ids()[0]`),
# so it is tried only when no fork statement is there.
SINGLE_GROUP_SHAPE = (
    "upstream 0.14.1-0.29.0 single-group connector",
    Verdict.NOT_APPLICABLE,
    _upstream_single_group,
    "no hybrid support: MoRIIOConnector does not implement SupportsHMA, so vLLM runs it "
    "with exactly one KV-cache group (the scheduler asserts it) and it reads block ids "
    "[0] only; Kimi-K3 (four groups) cannot use MoRIIO on this version",
)
UPSTREAM_SHAPES = (*NATIVE_SHAPES, SINGLE_GROUP_SHAPE)


class MoriioGroupRouting(Patch):
    id = "moriio-group-routing"
    title = "MoRIIO routes each layer's KV to its own KV-cache group's block ids"
    files = FILES
    modules = tuple(MODULE_OF[rel] for rel in FILES)
    caveat = (
        "both MoRIIO nodes (prefill and decode) need it: the decode node sends the per-group "
        "block ids the prefill node writes into"
    )

    def classify(self, sources: Sources) -> list[SiteResult]:
        present = [rel for rel in FILES if sources[rel].exists]
        if not present:
            return [
                self.result(
                    UPSTREAM_SITES[rel],
                    rel,
                    Verdict.NOT_APPLICABLE,
                    "no MoRIIO connector in this tree (it first ships in vLLM 0.14.1)",
                )
                for rel in FILES
            ]
        if len(present) != len(FILES):
            missing = ", ".join(rel.rsplit("/", 1)[-1] for rel in FILES if rel not in present)
            return [
                self.result(
                    UPSTREAM_SITES[rel],
                    rel,
                    Verdict.DRIFTED,
                    f"the MoRIIO package is incomplete ({missing} absent); nothing will be written",
                )
                for rel in FILES
            ]
        for shape in NATIVE_SHAPES:
            if shape[2](sources):
                return self._upstream(sources, shape)
        if any(_MENTIONS.search(sources[rel].text) for rel in FILES):
            looks = [(site, site.look(sources[site.file])) for site in FORK_SITES]
            if any(look.evidence for _, look in looks):
                return self._classify_fork(looks)
        if _upstream_single_group(sources):
            return self._upstream(sources, SINGLE_GROUP_SHAPE)
        plan = _function(sources[ENGINE], ("MoRIIOWriter", "_prepare_transfer_plan"))
        return [
            SiteResult(
                self.id,
                UPSTREAM_SITES[rel],
                rel,
                Verdict.DRIFTED,
                detail="the MoRIIO package is in no shape k3patch knows (neither the fork's "
                "mamba block ids, nor a known upstream); nothing will be written",
                line=plan.lineno if plan is not None and rel == ENGINE else None,
                found=_short(sources[ENGINE].segment(plan)) if plan and rel == ENGINE else "",
                expected=(
                    *(f"{shape} ({verdict.value})" for shape, verdict, _, _ in UPSTREAM_SHAPES),
                    "the fork's mamba block ids (pending)",
                ),
            )
            for rel in FILES
        ]

    def _upstream(
        self, sources: Sources, shape: tuple[str, Verdict, Callable[[Sources], bool], str]
    ) -> list[SiteResult]:
        name, verdict, _holds, detail = shape
        return [
            SiteResult(self.id, UPSTREAM_SITES[rel], rel, verdict, name, detail) for rel in FILES
        ]

    def _classify_fork(self, looks: list[tuple[_Site, _SiteLook]]) -> list[SiteResult]:
        results = []
        for site, seen in looks:
            look = seen.look
            if seen.verdict is Verdict.PENDING:
                shape = seen.shape or FORK_SHAPE
                detail = "; ".join((site.what, *seen.notes))
            elif seen.verdict is Verdict.APPLIED:
                shape, detail = "k3patch", site.what
            else:
                shape, detail = "", look.why
            results.append(
                SiteResult(
                    self.id,
                    site.name,
                    site.file,
                    seen.verdict,
                    shape,
                    detail,
                    look.line,
                    look.found,
                    look.expected,
                )
            )
        if any(r.verdict is Verdict.DRIFTED for r in results):
            state = _package_state(results)
            results = [
                SiteResult(
                    r.patch_id,
                    r.site,
                    r.file,
                    r.verdict,
                    r.shape,
                    f"{r.detail}; the three files are one change, nothing will be written "
                    f"({state})",
                    r.line,
                    r.found,
                    r.expected,
                )
                if r.verdict is Verdict.DRIFTED
                else r
                for r in results
            ]
        return results

    def rewrite(self, sources: Sources, pending: list[SiteResult]) -> dict[str, str]:
        changes: dict[str, str] = {}
        for rel in FILES:
            src = sources[rel]
            text = _Text(src.text)
            edits = [
                edit
                for site in FORK_SITES
                if site.file == rel and site.look(src).verdict is Verdict.PENDING
                for part in site.parts
                for edit in part.edits(src, text)
            ]
            if edits:
                changes[rel] = _apply(src.text, edits)
        return changes

    def probe(self) -> ProbeOutcome | None:
        return _probe_module().probe_routing()


def _package_state(results: list[SiteResult]) -> str:
    """One line naming every file's state, so a refusal says what is patched and what drifted."""
    parts = []
    for rel in FILES:
        verdicts = {r.verdict for r in results if r.file == rel}
        if Verdict.DRIFTED in verdicts:
            word = "drifted"
        elif verdicts == {Verdict.APPLIED}:
            word = "applied"
        elif verdicts == {Verdict.PENDING}:
            word = "pending"
        else:
            word = "partly applied"
        parts.append(f"{rel.rsplit('/', 1)[-1]} {word}")
    return ", ".join(parts)


PATCH = MoriioGroupRouting()


def _probe_module() -> Any:
    """The behaviour probe, moriio_group_routing_probe.py, loaded by its path: the verify child
    loads this module by path, without k3patch installed, so no package import would find it."""
    import importlib.util
    import sys
    from pathlib import Path

    name = "k3patch.patches.moriio_group_routing_probe"
    module = sys.modules.get(name)
    if module is None:
        path = Path(__file__).with_name("moriio_group_routing_probe.py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module
