"""moriio-group-routing: MoRIIO writes each layer's KV into its own KV-cache group's blocks.

Symptom: Kimi-K3 split into prefill and decode over MoRIIO (WRITE mode) answers fluently but
without the prompt's context. Cause: the fork's "mamba block ids" change on vLLM 0.28.0 knows two
groups, `[0]` attention and `[1]` Mamba; K3 has three KDA (Mamba) groups, then MLA at index 3, so
MLA layers were written into a KDA group's blocks, and 0.28.0's offsets cache, keyed by tensor
geometry that K3's KDA groups share, misroutes any per-group choice made inside it. Fix: every
group's block ids travel end to end (FORK_SITES, one site per hop); the transfer plan indexes them
with the layer's group and caches offsets per group and geometry; a peer without them fails
loudly. Check: `k3patch verify` drives the patched WRITE path on CPU with K3's layout (probe.py).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from k3patch import astkit, sitemodel
from k3patch.fingerprints import dedent
from k3patch.patch import Patch, ProbeOutcome
from k3patch.shapes import match, parse_pattern, search
from k3patch.sitemodel import Function, Insert, Item, Look, Part, Site, takes
from k3patch.sources import SourceFile, Sources
from k3patch.verdicts import SiteResult, Verdict

from . import forms
from .forms import FIELD_COMMENT, FIELD_NAME, FORK_FIELDS
from .upstream import NATIVE_SHAPES, SINGLE_GROUP_SHAPE

if TYPE_CHECKING:
    from k3patch.codemod import Codemod, Codemods

# Plain constants: the no-op path reads `files` from this text without importing it.
COMMON = "distributed/kv_transfer/kv_connector/v1/moriio/moriio_common.py"
CONNECTOR = "distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"
ENGINE = "distributed/kv_transfer/kv_connector/v1/moriio/moriio_engine.py"
FILES = (COMMON, CONNECTOR, ENGINE)
ID = "moriio-group-routing"

# Without these words neither the fork's statements nor k3patch's are there: a cheap gate before
# three long ASTs (a hit, maybe a comment, is no verdict); the substring test spares the regex's
# 1 ms scan of a 115 kB file.
_WORDS = ("mamba_local_block_ids", "mamba_block_notify_list", "k3patch_group_")
_MENTIONS = re.compile(r"\b(?:" + "|".join(_WORDS) + ")")


def _mentions(text: str) -> bool:
    return any(word in text for word in _WORDS) and _MENTIONS.search(text) is not None


def keyword(callee: str, added: str) -> Item:
    """k3patch's keyword argument `added` beside the fork's (forms.FORK_KEYWORDS) to `callee`."""
    return Item("keyword", forms.FORK_KEYWORDS[callee], added, callee)


def _is_debug_block(imp: ast.stmt, gate: ast.stmt) -> bool:
    """`import os as X` + `if X.environ.get('K3_MAMBA_BC', '0') == '1': ...` that only logs:
    no else branch, and nothing bound that the offsets call or the cache store reads."""
    alias = imp.names[0] if isinstance(imp, ast.Import) and len(imp.names) == 1 else None
    if alias is None or alias.name != "os" or not alias.asname:
        return False
    if not isinstance(gate, ast.If) or gate.orelse:
        return False
    bound = astkit.stored_names([gate]) | astkit.imported_names(gate)
    read_later = {"offsets", "geometry_key", "_k3_local", "_k3_remote", "task", "request_info"}
    test = forms.DEBUG_TEST.format(alias=alias.asname)
    return match(test, gate.test) is not None and not bound & read_later


def _regions(fn: ast.FunctionDef) -> list[tuple[str, list[ast.stmt], bool]]:
    """Each known region: (its form "k3patch"/"fork"/"legacy", its statements, has K3_MAMBA_BC)."""
    found = []
    # By pattern: where k3patch's plan has no per-layer key to swap (a mutant's), it is one form.
    ours = {forms.PER_LAYER_PLAN: ("per-layer", False), forms.K3PATCH_PLAN: ("k3patch", False)}
    for pattern, (kind, debug) in {**ours, **{v: k for k, v in forms.PLANS.items()}}.items():
        for block, i, holes in search(pattern, fn):
            if not debug or _is_debug_block(holes["HOLE_debug_import"], holes["HOLE_debug_gate"]):
                found.append((kind, block[i : i + len(parse_pattern(pattern))], debug))
    return found


@dataclass(frozen=True)
class Plan(Part):
    """The per-layer choice of block ids and the offsets cache in the transfer plan."""

    evidence = True

    def look(self, src: SourceFile, node: ast.FunctionDef, site: Site) -> Look | SiteResult:
        found = _regions(node)
        if len(found) != 1:
            why = f"{site.scope}: the per-layer block-id choice is in no known shape"
            expected = (
                f"fork: {forms.PLANS['fork', True]}",
                f"older k3-group-routing fix: {forms.PLANS['legacy', True]}",
                f"k3patch: {dedent(forms.K3PATCH_PLAN)}",
            )
            why += f" ({len(found)} candidate regions)" if found else ""
            text = sitemodel.clip_lines(src.segment(node), 60)
            return SiteResult.drift(*site.key, why, node.lineno, text, expected)
        kind, stmts, debug = found[0]
        goes, line = f"; {forms.DEBUG_GOES}" * debug, stmts[0].lineno
        if kind in ("k3patch", "per-layer"):
            return Look(Verdict.APPLIED, line, why=forms.PER_LAYER_NOTE * (kind == "per-layer"))
        if kind == "fork":
            return Look(Verdict.PENDING, line, why=forms.FORK_DEFECT + goes)
        why = f"the older k3-group-routing fix: {forms.GEOMETRY_DEFECT}; {forms.LEGACY_CAVEATS}"
        why += f"; {forms.LEGACY_DEBUG_DEFECT}{goes}" if debug else ""
        return Look(Verdict.PENDING, line, why=why, shape=forms.LEGACY_SHAPE)

    def rewrite(self, src: SourceFile, file: Codemod, node: ast.FunctionDef) -> None:
        file.replace(_regions(node)[0][1], forms.K3PATCH_PLAN)


@dataclass(frozen=True)
class LegacyGrowth(Part):
    """No opinion; a note on the older fix's capture (in `capture_in`) and its chunked growth."""

    capture_in: str

    def look(self, src: SourceFile, node: ast.FunctionDef, site: Site) -> Look:
        capture = astkit.find_def(src.tree, self.capture_in)
        if capture is None or not search(forms.LEGACY_CAPTURE, capture):
            return Look(None)
        if search(forms.CHUNKED_ALLGRP, node):
            why = "the older fix's chunked companion grows its all-group lists per chunk"
            return Look(None, why=why, shape=forms.LEGACY_CHUNKED_SHAPE)
        why = f"older k3-group-routing fix: {forms.FIRST_CHUNK_DEFECT}"
        return Look(None, why=why, shape=forms.LEGACY_SHAPE)


@dataclass(frozen=True)
class Upgradable(Insert):
    """An Insert whose earlier k3patch form (`older`, with a bug) reads pending where the new
    form would stand, and which apply replaces in place (the record keeps the wheel's original:
    the file is the one k3patch wrote, so its recorded original carries over)."""

    older: str = ""
    older_why: str = ""
    older_shape: str = ""

    def _earlier(self, fn: ast.FunctionDef) -> list[ast.stmt] | None:
        body, i = self._find(fn)[0]
        count = len(parse_pattern(self.older))
        at = i - count  # before the final return, as the new form is inserted
        if at >= 0 and match(self.older, body[at:i]) is not None:
            return body[at:i]
        return None

    def look(self, src: SourceFile, node: ast.FunctionDef, site: Site) -> Look | SiteResult:
        look = super().look(src, node, site)
        if look.verdict is not Verdict.DRIFTED or self.anchors:
            return look
        earlier = self._earlier(node)
        if earlier is None:
            return look
        return Look(Verdict.PENDING, earlier[0].lineno, why=self.older_why, shape=self.older_shape)

    def rewrite(self, src: SourceFile, file: Codemod, node: ast.FunctionDef) -> None:
        earlier = None if self.anchors else self._earlier(node)
        if earlier is None:
            super().rewrite(src, file, node)
        else:  # the comment lines above the earlier form (the same words) stay
            lines = dedent(self.added).splitlines(keepends=True)
            while lines and lines[0].lstrip().startswith("#"):
                lines.pop(0)
            file.replace(earlier, "".join(lines))


SCHED, WORKER = "MoRIIOConnectorScheduler", "MoRIIOConnectorWorker"
USAA = f"{SCHED}.update_state_after_alloc"
NOTIFY = "k3patch_group_block_notify"

in_common, in_connector, in_engine = (
    partial(Site, patch=ID, file=f, shape=forms.FORK_SHAPE) for f in FILES
)


def _field(cls: str, what: str) -> Site:
    item = Item("field", FORK_FIELDS[cls], forms.FIELD, comment=FIELD_COMMENT)
    return in_common(f"{cls}.{FIELD_NAME}", what, item, scope=cls)


FORK_SITES = (
    _field("WriteTask", "the write task carries every group's local block ids"),
    _field(
        "RemoteAllocInfo",
        "the decode node's block ids of every group, as the prefill node received them",
    ),
    _field("ReqMeta", "the connector metadata carries every group's block ids"),
    in_connector(
        f"{SCHED}.__init__",
        "a per-request dict of every group's blocks beside the fork's `_reqs_save_mamba`",
        Insert(forms.SCHEDULER_DICT, "_k3patch_save_groups", forms.SCHEDULER_DICT_ANCHOR),
    ),
    in_connector(
        f"{USAA} (prefill capture)",
        "the prefill scheduler captures every group's blocks, not only [1]",
        Insert(forms.CAPTURE, "_k3patch_save_groups", pre=forms.FORK_CAPTURE),
    ),
    in_connector(
        f"{USAA} (decode notify)",
        "the decode scheduler sends every group's blocks to the prefill node",
        Insert(forms.NOTIFY, "_k3patch_group_notify", pre=forms.FORK_NOTIFY),
        keyword("send_notify_block", f"{NOTIFY}=_k3patch_group_notify"),
        needs=("update_state_after_alloc(..., num_external_tokens)", takes("num_external_tokens")),
    ),
    in_connector(
        f"{SCHED}.send_notify_block",
        "the notify message has a `k3patch_group_block_ids` key",
        Item("param", "mamba_block_notify_list", f"{NOTIFY}: list[list[int]] | None = None"),
        Item("key", '"mamba_block_notify_list"', f'"{FIELD_NAME}": {NOTIFY}'),
    ),
    in_connector(
        f"{SCHED}.build_connector_meta",
        "later chunks' blocks join their group; each save takes its request's group lists",
        Upgradable(
            forms.SAVE_GROUPS,
            "_k3patch_save_groups",
            evidence=False,
            older=forms.SAVE_GROUPS_RESUME_APPENDS,
            older_why=forms.RESUME_APPENDS_DEFECT,
            older_shape=forms.RESUME_APPENDS_SHAPE,
        ),
        LegacyGrowth(USAA),
        needs=(
            "build_connector_meta(self, scheduler_output) ending in `return meta`",
            lambda src, fn: (
                takes("scheduler_output")(src, fn) and match("return meta", fn.body[-1]) is not None
            ),
        ),
    ),
    in_connector(
        f"{WORKER}.__init__",
        "the worker maps every layer to its KV-cache group and finds the attention group",
        Insert(forms.WORKER_MAP, "_k3patch_group_of_layer", (forms.LAYER_TO_SPEC,), evidence=False),
        Function("_k3patch_kv_cache_group_index", forms.GROUP_INDEX_FUNCTION),
    ),
    in_connector(
        f"{WORKER}.schedule_write_blocks",
        "every group's block ids go into the write task",
        Item("param", "mamba_local_block_ids", forms.FIELD),
        keyword("WriteTask", f"{FIELD_NAME}={FIELD_NAME}"),
    ),
    in_connector(
        f"{WORKER}._write_blocks_for_req",
        "the metadata's group lists are handed to the write",
        keyword("schedule_write_blocks", f"{FIELD_NAME}=meta.{FIELD_NAME}"),
    ),
    in_engine(
        "MoRIIOWrapper._handle_remote_blocks_message",
        "the prefill node keeps the decode node's group lists",
        keyword("RemoteAllocInfo", f'{FIELD_NAME}=data.get("{FIELD_NAME}")'),
        needs=("_handle_remote_blocks_message(self, data)", takes("data")),
    ),
    in_engine(
        "MoRIIOWriter._prepare_transfer_plan",
        "each layer's transfer indexes the per-group lists with the layer's own group, and its "
        "offsets are cached per group and tensor geometry",
        Plan(),
        needs=(
            "MoRIIOError bound in moriio_engine",
            lambda src, fn: astkit.module_binds(src.tree, "MoRIIOError"),
        ),
    ),
)

# One verdict for all three files on upstream trees (SITES.md section 1, "Upstream").
UPSTREAM_SITES = {
    COMMON: "per-group block ids",
    CONNECTOR: "layer -> KV-cache group map",
    ENGINE: "per-layer transfer routing",
}


class MoriioGroupRouting(Patch):
    id = ID
    title = "MoRIIO routes each layer's KV to its own KV-cache group's block ids"
    files = FILES
    modules = tuple("vllm." + rel.removesuffix(".py").replace("/", ".") for rel in FILES)
    caveat = (
        "both MoRIIO nodes (prefill and decode) need it: the decode node sends the per-group "
        "block ids the prefill node writes into"
    )

    def classify(self, sources: Sources) -> list[SiteResult]:
        present = [rel for rel in FILES if sources[rel].exists]
        if not present:
            why = "no MoRIIO connector in this tree (it first ships in vLLM 0.14.1)"
            return self._each_file(Verdict.NOT_APPLICABLE, why)
        if len(present) != len(FILES):
            missing = ", ".join(rel.rsplit("/", 1)[-1] for rel in FILES if rel not in present)
            why = f"the MoRIIO package is incomplete ({missing} absent); nothing will be written"
            return self._drifted(why)
        connector, engine = sources[CONNECTOR], sources[ENGINE]
        for shape in NATIVE_SHAPES:
            if shape.holds(connector, engine):
                return self._each_file(shape.verdict, shape.detail, shape.name)
        if any(_mentions(sources[rel].text) for rel in FILES):
            looks = [site.result(sources[site.file]) for site in FORK_SITES]
            if any(evidence for _, evidence in looks):
                return _one_change([result for result, _ in looks])
        if SINGLE_GROUP_SHAPE.holds(connector, engine):
            shape = SINGLE_GROUP_SHAPE
            return self._each_file(shape.verdict, shape.detail, shape.name)
        why = (
            "the MoRIIO package is in no shape k3patch knows (neither the fork's mamba block "
            "ids, nor a known upstream); nothing will be written"
        )
        expected = (
            *(f"{s.name} ({s.verdict.value})" for s in (*NATIVE_SHAPES, SINGLE_GROUP_SHAPE)),
            "the fork's mamba block ids (pending)",
        )
        results = self._drifted(why, expected)
        plan = astkit.find_def(engine.tree, "MoRIIOWriter._prepare_transfer_plan")
        if plan is not None:
            found = sitemodel.clip_lines(engine.segment(plan))
            results[-1] = results[-1]._replace(line=plan.lineno, found=found)
        return results

    def _each_file(self, verdict: Verdict, detail: str, shape: str = "") -> list[SiteResult]:
        return [self.result(UPSTREAM_SITES[rel], rel, verdict, detail, shape) for rel in FILES]

    def _drifted(self, why: str, expected: tuple[str, ...] = ()) -> list[SiteResult]:
        return [SiteResult.drift(ID, UPSTREAM_SITES[r], r, why, expected=expected) for r in FILES]

    def rewrite(self, sources: Sources, pending: list[SiteResult], files: Codemods) -> None:
        wanted = {r.site for r in pending}
        for site in (s for s in FORK_SITES if s.name in wanted):
            site.rewrite(sources[site.file], files[site.file])

    def probe(self) -> ProbeOutcome | None:
        from . import probe

        return probe.probe_routing()


def _one_change(results: list[SiteResult]) -> list[SiteResult]:
    """The three files are one change: a drifted site refuses all three, naming each one's state."""
    drifted = Verdict.DRIFTED
    if not any(r.verdict is drifted for r in results):
        return results
    states = []
    for rel in FILES:
        verdict = sitemodel.combined_verdict(r.verdict for r in results if r.file == rel)
        states.append(f"{rel.rsplit('/', 1)[-1]} {verdict.value if verdict else 'partly applied'}")
    tail = f"; the three files are one change, nothing will be written ({', '.join(states)})"
    return [r._replace(detail=r.detail + tail) if r.verdict is drifted else r for r in results]


PATCH = MoriioGroupRouting()
