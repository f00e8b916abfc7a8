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
with K3's layout and checks that every layer's blocks land in its own group's blocks (probe.py).

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
route per group natively (satisfied): upstream.py.
"""

from __future__ import annotations

import re
from dataclasses import replace

from k3patch.edits import SourceText, apply_edits
from k3patch.model import (
    Patch,
    ProbeOutcome,
    SiteResult,
    SourceFile,
    Sources,
    Verdict,
    module_binds,
)
from k3patch.shapes import match

from . import forms
from .forms import FIELD_NAME, FORK_FIELDS
from .plan import LegacyGrowth, Plan
from .sites import (
    DictKey,
    Field,
    Function,
    Insert,
    Keyword,
    Param,
    Requires,
    Site,
    SiteLook,
    function,
    has_param,
    short,
)
from .upstream import NATIVE_SHAPES, SINGLE_GROUP_SHAPE, UPSTREAM_SHAPES

PACKAGE = "distributed/kv_transfer/kv_connector/v1/moriio"
COMMON = f"{PACKAGE}/moriio_common.py"
CONNECTOR = f"{PACKAGE}/moriio_connector.py"
ENGINE = f"{PACKAGE}/moriio_engine.py"
FILES = (COMMON, CONNECTOR, ENGINE)
MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"

# Words whose absence from all three files proves that neither the fork's statements nor
# k3patch's are there: a cheap gate that keeps upstream trees off a walk of three long ASTs. A
# hit is only a reason to look at statement shapes, never a verdict (it may be a comment).
_MENTIONS = re.compile(r"\b(?:mamba_local_block_ids|mamba_block_notify_list|k3patch_group_)")

SCHED = "MoRIIOConnectorScheduler"
WORKER = "MoRIIOConnectorWorker"
USAA = f"{SCHED}.update_state_after_alloc"
NOTIFY = f"{SCHED}.send_notify_block"
BCM = f"{SCHED}.build_connector_meta"
SWB = f"{WORKER}.schedule_write_blocks"
REMOTE = "MoRIIOWrapper._handle_remote_blocks_message"


def _returns_meta(src: SourceFile) -> bool:
    fn = function(src, BCM)
    return fn is not None and match("return meta", fn.body[-1]) is not None


# The fork's sites, one per hop the block ids take (SITES.md section 1, "The fork").
FORK_SITES: tuple[Site, ...] = (
    *(
        Site(f"{cls}.{FIELD_NAME}", COMMON, (Field(cls, FORK_FIELDS[cls]),), what)
        for cls, what in (
            ("WriteTask", "the write task carries every group's local block ids"),
            (
                "RemoteAllocInfo",
                "the decode node's block ids of every group, as the prefill node received them",
            ),
            ("ReqMeta", "the connector metadata carries every group's block ids"),
        )
    ),
    Site(
        f"{SCHED}.__init__",
        CONNECTOR,
        (
            Insert(
                f"{SCHED}.__init__",
                forms.SCHEDULER_DICT,
                "_k3patch_save_groups",
                forms.SCHEDULER_DICT_ANCHOR,
                "`self._reqs_save_mamba = {}`",
            ),
        ),
        "a per-request dict of every group's blocks beside the fork's `_reqs_save_mamba`",
    ),
    Site(
        f"{USAA} (prefill capture)",
        CONNECTOR,
        (
            Insert(
                USAA,
                forms.CAPTURE,
                "_k3patch_save_groups",
                ("self._reqs_save_mamba[request.request_id] = HOLE_value",),
                "`self._reqs_save_mamba[request.request_id] = ..._k3_gbi[1]...` capture",
                forms.FORK_CAPTURE,
            ),
        ),
        "the prefill scheduler captures every group's blocks, not only [1]",
    ),
    Site(
        f"{USAA} (decode notify)",
        CONNECTOR,
        (
            Requires(
                "update_state_after_alloc(..., num_external_tokens)",
                has_param(USAA, "num_external_tokens"),
            ),
            Insert(
                USAA,
                forms.NOTIFY,
                "_k3patch_group_notify",
                ("mamba_block_notify_list = HOLE_value",),
                "`mamba_block_notify_list = ..._k3_gbi_d[1]...`",
                forms.FORK_NOTIFY,
            ),
            Keyword(
                USAA,
                "send_notify_block",
                "mamba_block_notify_list",
                "mamba_block_notify_list",
                "k3patch_group_block_notify=_k3patch_group_notify",
            ),
        ),
        "the decode scheduler sends every group's blocks to the prefill node",
    ),
    Site(
        NOTIFY,
        CONNECTOR,
        (
            Param(
                NOTIFY,
                "mamba_block_notify_list",
                "k3patch_group_block_notify: list[list[int]] | None = None",
            ),
            DictKey(
                NOTIFY,
                "mamba_block_notify_list",
                "k3patch_group_block_ids",
                "k3patch_group_block_notify",
            ),
        ),
        "the notify message has a `k3patch_group_block_ids` key",
    ),
    Site(
        BCM,
        CONNECTOR,
        (
            Requires(
                "build_connector_meta(self, scheduler_output) ending in `return meta`",
                lambda src: has_param(BCM, "scheduler_output")(src) and _returns_meta(src),
            ),
            # Anchored on upstream's own `return meta`: no evidence of the fork.
            Insert(BCM, forms.SAVE_GROUPS, "_k3patch_save_groups", evidence=False),
            LegacyGrowth(USAA, BCM),
        ),
        "later chunks' blocks join their group; each save takes its request's group lists",
    ),
    Site(
        f"{WORKER}.__init__",
        CONNECTOR,
        (
            Insert(
                f"{WORKER}.__init__",
                forms.WORKER_MAP,
                "_k3patch_group_of_layer",
                (forms.LAYER_TO_SPEC,),
                "`self.layer_to_spec = build_layer_to_spec(kv_cache_config)`",
                evidence=False,
            ),
            Function("_k3patch_kv_cache_group_index", forms.GROUP_INDEX_FUNCTION),
        ),
        "the worker maps every layer to its KV-cache group and finds the attention group",
    ),
    Site(
        SWB,
        CONNECTOR,
        (
            Param(SWB, "mamba_local_block_ids", f"{FIELD_NAME}: list[list[int]] | None = None"),
            Keyword(
                SWB,
                "WriteTask",
                "mamba_local_block_ids",
                "mamba_local_block_ids",
                f"{FIELD_NAME}={FIELD_NAME}",
            ),
        ),
        "every group's block ids go into the write task",
    ),
    Site(
        f"{WORKER}._write_blocks_for_req",
        CONNECTOR,
        (
            Keyword(
                f"{WORKER}._write_blocks_for_req",
                "schedule_write_blocks",
                "mamba_local_block_ids",
                "meta.mamba_local_block_ids",
                f"{FIELD_NAME}=meta.{FIELD_NAME}",
            ),
        ),
        "the metadata's group lists are handed to the write",
    ),
    Site(
        REMOTE,
        ENGINE,
        (
            Requires("_handle_remote_blocks_message(self, data)", has_param(REMOTE, "data")),
            Keyword(
                REMOTE,
                "RemoteAllocInfo",
                "mamba_block_ids",
                "list(mamba_block_notify_list or [])",
                f'{FIELD_NAME}=data.get("k3patch_group_block_ids")',
            ),
        ),
        "the prefill node keeps the decode node's group lists",
    ),
    Site(
        "MoRIIOWriter._prepare_transfer_plan",
        ENGINE,
        (
            Requires(
                "MoRIIOError bound in moriio_engine",
                lambda src: module_binds(src.tree, "MoRIIOError"),
            ),
            Plan("MoRIIOWriter._prepare_transfer_plan"),
        ),
        "each layer's transfer indexes the per-group lists with the layer's own group, and its "
        "offsets are cached per layer",
    ),
)

# One verdict for all three files on upstream trees (SITES.md section 1, "Upstream").
UPSTREAM_SITES = {
    COMMON: "per-group block ids",
    CONNECTOR: "layer -> KV-cache group map",
    ENGINE: "per-layer transfer routing",
}


class MoriioGroupRouting(Patch):
    id = "moriio-group-routing"
    title = "MoRIIO routes each layer's KV to its own KV-cache group's block ids"
    files = FILES
    modules = tuple(f"{MODULE}.{rel.rsplit('/', 1)[1][:-3]}" for rel in FILES)
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
            return self._each_file(Verdict.DRIFTED, why)
        for shape in NATIVE_SHAPES:
            if shape.holds(sources[CONNECTOR], sources[ENGINE]):
                return self._each_file(shape.verdict, shape.detail, shape.name)
        if any(_MENTIONS.search(sources[rel].text) for rel in FILES):
            looks = [(site, site.look(sources[site.file])) for site in FORK_SITES]
            if any(look.evidence for _, look in looks):
                return self._classify_fork(looks)
        if SINGLE_GROUP_SHAPE.holds(sources[CONNECTOR], sources[ENGINE]):
            shape = SINGLE_GROUP_SHAPE
            return self._each_file(shape.verdict, shape.detail, shape.name)
        plan = function(sources[ENGINE], "MoRIIOWriter._prepare_transfer_plan")
        return [
            SiteResult(
                self.id,
                UPSTREAM_SITES[rel],
                rel,
                Verdict.DRIFTED,
                detail="the MoRIIO package is in no shape k3patch knows (neither the fork's "
                "mamba block ids, nor a known upstream); nothing will be written",
                line=plan.lineno if plan is not None and rel == ENGINE else None,
                found=short(sources[ENGINE].segment(plan)) if plan and rel == ENGINE else "",
                expected=(
                    *(f"{s.name} ({s.verdict.value})" for s in UPSTREAM_SHAPES),
                    "the fork's mamba block ids (pending)",
                ),
            )
            for rel in FILES
        ]

    def _each_file(self, verdict: Verdict, detail: str, shape: str = "") -> list[SiteResult]:
        return [
            SiteResult(self.id, UPSTREAM_SITES[rel], rel, verdict, shape, detail) for rel in FILES
        ]

    def _classify_fork(self, looks: list[tuple[Site, SiteLook]]) -> list[SiteResult]:
        results = []
        for site, seen in looks:
            look = seen.look
            if seen.verdict is Verdict.PENDING:
                shape = seen.shape or forms.FORK_SHAPE
                detail = "; ".join((site.what, *seen.notes))
            elif seen.verdict is Verdict.APPLIED:
                shape, detail = "k3patch", site.what
            else:
                shape, detail = "", look.why
            where = (look.line, look.found, look.expected)
            results.append(
                SiteResult(self.id, site.name, site.file, seen.verdict, shape, detail, *where)
            )
        if not any(r.verdict is Verdict.DRIFTED for r in results):
            return results
        tail = (
            f"; the three files are one change, nothing will be written ({_package_state(results)})"
        )
        drifted = Verdict.DRIFTED
        return [replace(r, detail=r.detail + tail) if r.verdict is drifted else r for r in results]

    def rewrite(self, sources: Sources, pending: list[SiteResult]) -> dict[str, str]:
        changes: dict[str, str] = {}
        for rel in FILES:
            src = sources[rel]
            text = SourceText(src.text)
            edits = [
                edit
                for site in FORK_SITES
                if site.file == rel and site.look(src).verdict is Verdict.PENDING
                for part in site.parts
                for edit in part.edits(src, text)
            ]
            if edits:
                changes[rel] = apply_edits(src.text, edits)
        return changes

    def probe(self) -> ProbeOutcome | None:
        from . import probe

        return probe.probe_routing()


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
