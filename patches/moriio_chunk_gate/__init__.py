"""moriio-chunk-gate: the MoRIIO WRITE producer sends a request's KV after its final prefill chunk.

`build_connector_meta`'s two gates (SITES.md 2) call a chunk final by block count: K3's
~5,760-token blocks hold the prompt after chunk 1 (recall dies at 2,048 tokens), and G1 runs only
when a block was allocated (a request can hang). Both gates decide on compute progress, no slack.
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from k3patch.fingerprints import Shape
from k3patch.patch import Patch, ProbeOutcome
from k3patch.shapes import VersionRange
from k3patch.sources import Sources
from k3patch.verdicts import SiteResult, Verdict

if TYPE_CHECKING:
    from k3patch.codemod import Codemods

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
SHAPES = {
    G1: (G1_BLOCK_COUNT, G1_BLOCK_COUNT_D, G1_APPLIED),
    G2: (G2_BLOCK_COUNT, G2_BLOCK_COUNT_D, G2_APPLIED),
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

# The forms told by meaning, not by a skeleton: upstream's, inline, and the older script's.
SATISFIED_UPSTREAM = "upstream fix (_is_final_prefill_chunk, 0.32.0 and later)"
SATISFIED_INLINE = "upstream-style progress gate (inline)"
LEGACY_PENDING = "older k3-chunk-gate script (legacy, defective)"
LEGACY_APPLIED = "k3patch (the older k3-chunk-gate form, repaired in place)"
FIXED_FORMS = (
    f"{SATISFIED_UPSTREAM} (satisfied)",
    f"{SATISFIED_INLINE} (satisfied)",
    f"{LEGACY_PENDING} (pending)",
    f"{LEGACY_APPLIED} (applied)",
)
LOOPS = {G1: "scheduler_output.scheduled_cached_reqs", G2: "self._reqs_need_save"}
SWEEP = "self._reqs_need_pending_save"


def site_result(
    site: str, verdict: Verdict, why: str, shape: str = "", line: int | None = None, found: str = ""
) -> SiteResult:
    """A drift located at a line says what it found and what was expected."""
    drifted = verdict is Verdict.DRIFTED and line is not None
    shapes = tuple(f"{s.name} ({s.verdict.value})" for s in SHAPES[site])
    found, expected = (found, (*shapes, *FIXED_FORMS)) if drifted else ("", ())
    return SiteResult("moriio-chunk-gate", site, FILE, verdict, shape, why, line, found, expected)


class MoriioChunkGate(Patch):
    id = "moriio-chunk-gate"
    title = "MoRIIO WRITE producer sends the KV after the final prefill chunk (compute progress)"
    files = (FILE,)
    modules = (MODULE,)
    caveat = (
        "MoRIIO WRITE-mode producers only; the older k3-chunk-gate form is repaired in place "
        "(its helper and progress map stay, unused by the gates)"
    )

    def classify(self, sources: Sources) -> list[SiteResult]:
        from .gates import classify_sites

        return classify_sites(sources[FILE])

    def rewrite(self, sources: Sources, pending: list[SiteResult], files: Codemods) -> None:
        from .gates import rewrite_sites

        rewrite_sites(sources[FILE], [r.site for r in pending], files[FILE])

    def probe(self) -> ProbeOutcome:
        from .probe import probe_chunk_gate

        return probe_chunk_gate()


PATCH = MoriioChunkGate()
