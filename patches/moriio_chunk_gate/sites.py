"""moriio-chunk-gate's sites and their declared shapes (SITES.md 2): the gates' pre-images by
release, k3patch's post-images, the older k3-chunk-gate script's helper, and how a result at one
of them is reported."""

from __future__ import annotations

import textwrap

from k3patch.fingerprints import Shape
from k3patch.shapes import VersionRange
from k3patch.verdicts import SiteResult, Verdict

PATCH_ID = "moriio-chunk-gate"
FILE = "distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"
MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"
CLASS = "MoRIIOConnectorScheduler"
METHOD = "build_connector_meta"
G1 = f"{METHOD} G1 (cached requests)"
G2 = f"{METHOD} G2 (_reqs_need_save)"

# The post-image: new gate headers (`pass` stands for the gate's own body, which stays).
G1_TEMPLATE = """
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
        pass
"""
G2_TEMPLATE = """
# k3patch moriio-chunk-gate: not the final chunk until compute progress
# reaches the prompt; a block count fires early once a block outgrows a
# chunk (K3's ~5,760-token blocks).
if (
    req.num_computed_tokens
    + scheduler_output.num_scheduled_tokens.get(req_id, 0)
    < req.num_prompt_tokens
):
    pass
"""


def applied(template: str, after: str, origin: str) -> Shape:
    """k3patch's own shape of a site: the post-image itself (its `pass`: the gate's own body),
    after what precedes it in the loop and before `after`."""
    source = "...\n" + textwrap.dedent(template).replace("pass\n", "...\n") + after
    return Shape("k3patch", Verdict.APPLIED, source, origin=origin)


# Shapes over the gate loop's body (`...`: statements left alone). A-C and the fork share gates:
# a FROM_SURROUNDINGS shape is named by the release its loop is in.
FROM_SURROUNDINGS = "A-C / fork"
G1_BLOCK_COUNT = Shape(
    FROM_SURROUNDINGS,
    Verdict.PENDING,
    """
    ...
    if new_block_ids is not None:
        ...
        if len(self._reqs_need_pending_save[req_id][1]) * self.block_size >= req.num_prompt_tokens:
            ...
    """,
    origin="block count, evaluated only when the step allocated a new block",
    versions=VersionRange("0.14.1", "0.29.0"),
)
G1_BLOCK_COUNT_D = Shape(
    "D (0.30.0-0.31.0)",
    Verdict.PENDING,
    """
    ...
    if new_block_ids is not None:
        ...
        saved_tokens = len(updated_blocks[self._full_attn_group_idx]) * self._full_attn_block_size
        if saved_tokens >= req.num_prompt_tokens:
            ...
    """,
    origin="block count of the full-attention group, evaluated only when a block was allocated",
    versions=VersionRange("0.30.0", "0.31.0"),
)
G1_APPLIED = applied(G1_TEMPLATE, "", "compute progress, for every pending request")
G2_BLOCK_COUNT = Shape(
    FROM_SURROUNDINGS,
    Verdict.PENDING,
    """
    ...
    if req.num_prompt_tokens > len(block_ids) * self.block_size:
        ...
    ...
    """,
    origin="block count",
    versions=VersionRange("0.14.1", "0.29.0"),
)
G2_BLOCK_COUNT_D = Shape(
    "D (0.30.0-0.31.0)",
    Verdict.PENDING,
    """
    ...
    tokens_covered = len(block_ids[self._full_attn_group_idx]) * self._full_attn_block_size
    if req.num_prompt_tokens > tokens_covered:
        ...
    ...
    """,
    origin="block count of the full-attention group",
    versions=VersionRange("0.30.0", "0.31.0"),
)
G2_APPLIED = applied(G2_TEMPLATE, "...", "compute progress")
# Upstream's fix (0.32.0 and later): both gates ask one method, whose body UPSTREAM_HELPER_BODY
# must hold (a gate that calls a helper deciding something else is drift).
UPSTREAM_HELPER = "_is_final_prefill_chunk"
UPSTREAM_HELPER_BODY = """
HOLE_scheduled = scheduler_output.num_scheduled_tokens.get(req.request_id, 0)
return req.num_computed_tokens + HOLE_scheduled >= req.num_prompt_tokens
"""
SATISFIED_UPSTREAM = "upstream fix (_is_final_prefill_chunk, 0.32.0 and later)"
UPSTREAM_FIXED = VersionRange("0.32.0")
G1_UPSTREAM = Shape(
    SATISFIED_UPSTREAM,
    Verdict.SATISFIED,
    """
    ...
    if not self._is_final_prefill_chunk(req, scheduler_output):
        continue
    ...
    """,
    origin="gates on compute progress",
    versions=UPSTREAM_FIXED,
)
G2_UPSTREAM = Shape(
    SATISFIED_UPSTREAM,
    Verdict.SATISFIED,
    """
    ...
    if not self._is_final_prefill_chunk(req, scheduler_output):
        self._reqs_need_pending_save[req_id] = (req, block_ids)
        continue
    ...
    """,
    origin="gates on compute progress",
    versions=UPSTREAM_FIXED,
)
# A half fix, declared to say what it misses: progress, but still only under a new block.
G1_HALF_FIX = Shape(
    "progress gate under `if new_block_ids is not None:`",
    Verdict.DRIFTED,
    """
    ...
    if new_block_ids is not None:
        ...
        if HOLE_req.num_computed_tokens + HOLE_scheduled >= HOLE_req.num_prompt_tokens:
            ...
    """,
    origin=(
        "a progress gate, but still only evaluated when the step allocated a new block: a "
        "final chunk without a new block would never send"
    ),
)
SHAPES = {
    G1: (G1_BLOCK_COUNT, G1_BLOCK_COUNT_D, G1_APPLIED, G1_UPSTREAM, G1_HALF_FIX),
    G2: (G2_BLOCK_COUNT, G2_BLOCK_COUNT_D, G2_APPLIED, G2_UPSTREAM),
}

# The older k3-chunk-gate script's module-level helper, read by its decisions.
LEGACY_HELPER = "_k3_prefill_done"
LEGACY_HELPER_SHAPE = Shape(
    "k3-chunk-gate helper",
    Verdict.PENDING,
    """
    def _k3_prefill_done(self, req_id, req):
        import os as _os
        prog = getattr(self, '_k3_prog', None)
        if not prog or req_id not in prog:
            return None
        cb, st = prog[req_id]
        slack = int(_os.environ.get('K3_CHUNK_GATE_SLACK', '2'))
        return (cb + st) >= (int(req.num_prompt_tokens) - slack)
    """,
)
LEGACY_DEFECTS = (
    "fires up to K3_CHUNK_GATE_SLACK (default 2) tokens early",
    "falls back to the block-count gate (the original bug) when its progress map lacks the request",
)

# The older k3-chunk-gate script's decision chains (SITES.md 2): `NAME = LEGACY_DECISION`, its
# `if NAME is None:` fallback, debug `if`s, then the gate; k3patch repairs the decision in place.
LEGACY_DECISION = f"{LEGACY_HELPER}(self, HOLE_req_id, HOLE_req)"
REPAIRED_DECISION = (
    "HOLE_req.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(HOLE_req_id, 0)"
    " >= HOLE_req.num_prompt_tokens"
)
LEGACY_PENDING = "older k3-chunk-gate script (legacy, defective)"
LEGACY_APPLIED = "k3patch (the older k3-chunk-gate form, repaired in place)"
LEGACY_FORMS = (f"{LEGACY_PENDING} (pending)", f"{LEGACY_APPLIED} (applied)")
LOOPS = {G1: "scheduler_output.scheduled_cached_reqs", G2: "self._reqs_need_save"}
SWEEP = "self._reqs_need_pending_save"


def site_result(
    site: str, verdict: Verdict, why: str, shape: str = "", line: int | None = None, found: str = ""
) -> SiteResult:
    """A drift located at a line says what it found and what was expected."""
    if verdict is not Verdict.DRIFTED:
        return SiteResult(PATCH_ID, site, FILE, verdict, shape, why, line)
    if line is None:
        return SiteResult.drift(PATCH_ID, site, FILE, why, shape=shape)
    shapes = [
        f"{s.name} ({s.verdict.value})"
        for s in SHAPES[site]
        if s.verdict.is_good or s.verdict is Verdict.PENDING
    ]
    return SiteResult.drift(PATCH_ID, site, FILE, why, line, found, (*shapes, *LEGACY_FORMS), shape)
