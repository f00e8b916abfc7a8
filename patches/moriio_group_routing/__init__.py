"""moriio-group-routing: MoRIIO writes each layer's KV into its own KV-cache group's blocks.

Symptom: Kimi-K3 served as a prefill/decode split over the MoRIIO connector (WRITE mode)
answers fluently but without the prompt's context.
Cause: the fork's "mamba block ids" change (the recipe's apply_kimik3_moriio_mamba_blockids.py
on vLLM 0.28.0) taught the connector two KV-cache groups, block ids `[0]` for attention and `[1]`
for Mamba. K3 has four: three KDA (Mamba) groups, then the MLA group at index 3. The prefill
node wrote every MLA layer into group 0's blocks (a KDA group's) and every KDA layer into group
1's; decode read MLA blocks nobody had written. Besides, 0.28.0 caches a request's transfer
offsets under the layer tensor's geometry alone; K3's three KDA groups share one geometry but
not their block ids, so any per-group choice made inside that cache still writes the 2nd and
3rd KDA groups into the 1st group's blocks.
Fix: the worker maps each layer to its KV-cache group (the attention group is the first that is
not a MambaSpec); every group's block ids travel end to end (the scheduler's capture plus the
blocks later prefill chunks add, ReqMeta, WriteTask, the decode node's notify message,
RemoteAllocInfo); the transfer plan indexes them with the layer's own group and caches offsets
per layer (`(task.layer_name, *geometry)`, as upstream 0.29.0 keys them). A transfer without the
lists (a peer without this fix) fails loudly; nothing falls back to group 0. A two-group model
routes as before. Both nodes need the fix. The fork's K3_MAMBA_BC debug block logs the
two-group choice and goes with it (revert brings both back). Everything k3patch adds is named
`k3patch_*` / `_k3patch_*`.
Check: `k3patch verify` drives the patched scheduler, notify message and transfer plan on CPU
with K3's layout: every layer's blocks land in its own group's blocks (probe.py).

On the operators' trees (vLLM 0.28.0 + the recipe's older scripts, tests/forktree), all pending:
(a)/(b) the fork, with or without the four comment lines under `if _k3_mamba:` or the
K3_MAMBA_BC block; (c) + the older fix (apply_kimik3_moriio_group_routing.py) alone, defective:
its all-group lists are captured at the first chunk only, and it has (d)'s defect; (d) + its
chunked companion (apply_kimik3_chunked_allgrp.py), defective: it chooses block ids inside the
geometry-keyed cache, its fallbacks are silent (a failed group map is group 0, a task without
lists takes the two-group choice), `K3_GROUP_ROUTING=0` restores the bug, and a K3_MAMBA_BC
block still reads `_k3_mamba`, which it no longer binds. Its plan anchor needs the fork's four
comment lines, so after the stored mamba-blockids script it writes nothing: that tree is (a).
`apply` rewrites each in place into k3patch's form; the older fix's plumbing stays (unused), so
revert is exact without a pristine file. Upstream 0.14.1-0.30.0 cannot run K3 over MoRIIO (not
applicable); 0.31.0 and later route per group natively (satisfied): upstream.py.
"""

from __future__ import annotations

import re
from dataclasses import replace

from k3patch.edits import SourceText, apply_edits
from k3patch.model import Patch, ProbeOutcome, SiteResult, Sources, Verdict, module_binds
from k3patch.shapes import match

from . import forms
from .forms import FIELD_NAME, FORK_FIELDS
from .sites import (
    DictKey,
    Field,
    Function,
    Insert,
    Keyword,
    LegacyGrowth,
    Param,
    Plan,
    Requires,
    Site,
    short,
    takes,
)
from .upstream import NATIVE_SHAPES, SINGLE_GROUP_SHAPE, UPSTREAM_SHAPES, function

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
NOTIFY = "k3patch_group_block_notify"
GROUP_LISTS = f"{FIELD_NAME}: list[list[int]] | None = None"

# The fork's sites, one per hop the block ids take (SITES.md section 1, "The fork").
FORK_SITES = (
    *(
        Site(f"{cls}.{FIELD_NAME}", COMMON, what, (Field(FORK_FIELDS[cls]),))
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
        "a per-request dict of every group's blocks beside the fork's `_reqs_save_mamba`",
        (
            Insert(
                forms.SCHEDULER_DICT,
                "_k3patch_save_groups",
                forms.SCHEDULER_DICT_ANCHOR,
                "`self._reqs_save_mamba = {}`",
            ),
        ),
    ),
    Site(
        f"{USAA} (prefill capture)",
        CONNECTOR,
        "the prefill scheduler captures every group's blocks, not only [1]",
        (
            Insert(
                forms.CAPTURE,
                "_k3patch_save_groups",
                ("self._reqs_save_mamba[request.request_id] = HOLE_value",),
                "`self._reqs_save_mamba[request.request_id] = ..._k3_gbi[1]...` capture",
                forms.FORK_CAPTURE,
            ),
        ),
    ),
    Site(
        f"{USAA} (decode notify)",
        CONNECTOR,
        "the decode scheduler sends every group's blocks to the prefill node",
        (
            Requires(
                "update_state_after_alloc(..., num_external_tokens)", takes("num_external_tokens")
            ),
            Insert(
                forms.NOTIFY,
                "_k3patch_group_notify",
                ("mamba_block_notify_list = HOLE_value",),
                "`mamba_block_notify_list = ..._k3_gbi_d[1]...`",
                forms.FORK_NOTIFY,
            ),
            Keyword(
                "send_notify_block",
                "mamba_block_notify_list=mamba_block_notify_list",
                f"{NOTIFY}=_k3patch_group_notify",
            ),
        ),
    ),
    Site(
        f"{SCHED}.send_notify_block",
        CONNECTOR,
        "the notify message has a `k3patch_group_block_ids` key",
        (
            Param("mamba_block_notify_list", f"{NOTIFY}: list[list[int]] | None = None"),
            DictKey("mamba_block_notify_list", FIELD_NAME, NOTIFY),
        ),
    ),
    Site(
        f"{SCHED}.build_connector_meta",
        CONNECTOR,
        "later chunks' blocks join their group; each save takes its request's group lists",
        (
            Requires(
                "build_connector_meta(self, scheduler_output) ending in `return meta`",
                lambda src, fn: (
                    fn is not None
                    and takes("scheduler_output")(src, fn)
                    and match("return meta", fn.body[-1]) is not None
                ),
            ),
            # Anchored on upstream's own `return meta`: no evidence of the fork.
            Insert(forms.SAVE_GROUPS, "_k3patch_save_groups", evidence=False),
            LegacyGrowth(USAA),
        ),
    ),
    Site(
        f"{WORKER}.__init__",
        CONNECTOR,
        "the worker maps every layer to its KV-cache group and finds the attention group",
        (
            Insert(
                forms.WORKER_MAP,
                "_k3patch_group_of_layer",
                (forms.LAYER_TO_SPEC,),
                f"`{forms.LAYER_TO_SPEC}`",
                evidence=False,
            ),
            Function("_k3patch_kv_cache_group_index", forms.GROUP_INDEX_FUNCTION),
        ),
    ),
    Site(
        f"{WORKER}.schedule_write_blocks",
        CONNECTOR,
        "every group's block ids go into the write task",
        (
            Param("mamba_local_block_ids", GROUP_LISTS),
            Keyword(
                "WriteTask",
                "mamba_local_block_ids=mamba_local_block_ids",
                f"{FIELD_NAME}={FIELD_NAME}",
            ),
        ),
    ),
    Site(
        f"{WORKER}._write_blocks_for_req",
        CONNECTOR,
        "the metadata's group lists are handed to the write",
        (
            Keyword(
                "schedule_write_blocks",
                "mamba_local_block_ids=meta.mamba_local_block_ids",
                f"{FIELD_NAME}=meta.{FIELD_NAME}",
            ),
        ),
    ),
    Site(
        "MoRIIOWrapper._handle_remote_blocks_message",
        ENGINE,
        "the prefill node keeps the decode node's group lists",
        (
            Requires("_handle_remote_blocks_message(self, data)", takes("data")),
            Keyword(
                "RemoteAllocInfo",
                "mamba_block_ids=list(mamba_block_notify_list or [])",
                f'{FIELD_NAME}=data.get("{FIELD_NAME}")',
            ),
        ),
    ),
    Site(
        "MoRIIOWriter._prepare_transfer_plan",
        ENGINE,
        "each layer's transfer indexes the per-group lists with the layer's own group, and its "
        "offsets are cached per layer",
        (
            Requires(
                "MoRIIOError bound in moriio_engine",
                lambda src, fn: module_binds(src.tree, "MoRIIOError"),
            ),
            Plan(),
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
        connector, engine = sources[CONNECTOR], sources[ENGINE]
        for shape in NATIVE_SHAPES:
            if shape.holds(connector, engine):
                return self._each_file(shape.verdict, shape.detail, shape.name)
        if any(_MENTIONS.search(sources[rel].text) for rel in FILES):
            looks = [site.result(self.id, sources[site.file]) for site in FORK_SITES]
            if any(evidence for _, evidence in looks):
                return self._classify_fork([result for result, _ in looks])
        if SINGLE_GROUP_SHAPE.holds(connector, engine):
            shape = SINGLE_GROUP_SHAPE
            return self._each_file(shape.verdict, shape.detail, shape.name)
        plan = function(engine, "MoRIIOWriter._prepare_transfer_plan")
        found = short(engine.segment(plan)) if plan else ""
        expected = (
            *(f"{s.name} ({s.verdict.value})" for s in UPSTREAM_SHAPES),
            "the fork's mamba block ids (pending)",
        )
        why = (
            "the MoRIIO package is in no shape k3patch knows (neither the fork's mamba block "
            "ids, nor a known upstream); nothing will be written"
        )
        return [
            SiteResult(
                self.id,
                UPSTREAM_SITES[rel],
                rel,
                Verdict.DRIFTED,
                "",
                why,
                plan.lineno if plan and rel == ENGINE else None,
                found if rel == ENGINE else "",
                expected,
            )
            for rel in FILES
        ]

    def _each_file(self, verdict: Verdict, detail: str, shape: str = "") -> list[SiteResult]:
        return [
            SiteResult(self.id, UPSTREAM_SITES[rel], rel, verdict, shape, detail) for rel in FILES
        ]

    def _classify_fork(self, results: list[SiteResult]) -> list[SiteResult]:
        if not any(r.verdict is Verdict.DRIFTED for r in results):
            return results
        tail = f"; the three files are one change, nothing will be written ({_state(results)})"
        drifted = Verdict.DRIFTED
        return [replace(r, detail=r.detail + tail) if r.verdict is drifted else r for r in results]

    def rewrite(self, sources: Sources, pending: list[SiteResult]) -> dict[str, str]:
        changes: dict[str, str] = {}
        for rel in FILES:
            src, text = sources[rel], SourceText(sources[rel].text)
            edits = [
                edit
                for site in FORK_SITES
                if site.file == rel and site.look(src)[0].verdict is Verdict.PENDING
                for edit in site.edits(src, text)
            ]
            if edits:
                changes[rel] = apply_edits(src.text, edits)
        return changes

    def probe(self) -> ProbeOutcome | None:
        from . import probe

        return probe.probe_routing()


def _state(results: list[SiteResult]) -> str:
    """One line naming every file's state, so a refusal says what is patched and what drifted."""
    parts = []
    for rel in FILES:
        verdicts = {r.verdict for r in results if r.file == rel}
        if Verdict.DRIFTED in verdicts:
            word = "drifted"
        elif verdicts in ({Verdict.APPLIED}, {Verdict.PENDING}):
            word = verdicts.pop().value
        else:
            word = "partly applied"
        parts.append(f"{rel.rsplit('/', 1)[-1]} {word}")
    return ", ".join(parts)


PATCH = MoriioGroupRouting()
