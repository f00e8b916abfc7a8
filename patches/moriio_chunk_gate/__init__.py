"""moriio-chunk-gate: the MoRIIO WRITE producer sends a request's KV after its final prefill chunk.

Symptom: with Kimi-K3 behind a MoRIIO WRITE-mode prefill/decode pair, the decode node answers as
if the prompt ended after 2,048 tokens (recall dies at exactly max_num_batched_tokens), and a
request whose final chunk allocates no new KV block is never sent at all and hangs.
Cause: `MoRIIOConnectorScheduler.build_connector_meta` decides "this is the final prefill chunk,
send now" by block count (`blocks * block_size >= num_prompt_tokens`), in two gates: G1 in the
loop over `scheduled_cached_reqs`, G2 in the loop over `_reqs_need_save`. K3's attention pages are
padded to the mamba page (about 5,760 tokens a block), so one block covers a whole prompt after
its first 2,048-token chunk and the KV of the later chunks never crosses. G1 also sits under
`if new_block_ids is not None:`, so a final chunk that needs no new block never reaches it.
Fix: both gates decide on compute progress, `req.num_computed_tokens +
scheduler_output.num_scheduled_tokens.get(req_id, 0) >= req.num_prompt_tokens` (bCM runs before
the scheduler advances `num_computed_tokens`, so this step's chunk is added; no slack), and G1 is
evaluated for every pending request, also when the step allocated no block. Only the two gate
statements change; the accumulated block lists are built exactly as before. vLLM 0.32.0 and later
carry the same fix (`_is_final_prefill_chunk`). A gate that compares progress with the prompt in
any other way (`<` where `>=` belongs, `==`, `!=`, `>`, sides swapped, a slack) is drift.
The older k3-chunk-gate script (apply_kimik3_chunk_gate_fix.py) decides through a helper with a
slack of K3_CHUNK_GATE_SLACK (default 2) tokens and falls back to the block count when its
per-step map lacks the request: pending, with both defects named; apply replaces its three
decisions (G1, its post-loop sweep, G2) in place by compute progress and drops the fallbacks,
without the pristine file (its helper and map stay, unused by the gates).
Verdicts on the real trees: upstream A (0.14.1-0.23.0), B (0.24.0-0.27.1), C (0.28.0-0.29.0),
D (0.30.0-0.31.0) pending; 0.32.0 and later satisfied (upstream). The operators' fork trees
(0.28.0 + the recipe's older scripts): a, b, c and the plan variants (no chunk-gate script, the
default K3_EXTRA_FIXES=0) pending, "the fork (shape C gates)"; d (K3_EXTRA_FIXES=1) pending,
"older k3-chunk-gate script (legacy, defective)"; after apply every one reads applied.
Check: `k3patch verify` drives the real `build_connector_meta` of the tree with synthetic
scheduler steps (a 2,611-token prompt in one 5,760-token block, chunks of 2,048 and 563, must
send once, with the second chunk; so must a 3-chunk prompt at its third chunk, and a prompt
whose last chunk is 2 tokens), then vLLM's own `Scheduler.schedule()` of the tree with the
MoRIIO scheduler side on CPU through the same prompts (about a second beside the imports). It
also shows that `req.num_computed_tokens` inside bCM is the count before the step's chunk, not
stale (the older script's docstring says it is).
"""

from __future__ import annotations

from k3patch.model import Patch, ProbeOutcome, Shape, SiteResult, Sources, Verdict
from k3patch.shapes import VersionRange

FILE = "distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"
MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"
CLASS = "MoRIIOConnectorScheduler"
METHOD = "build_connector_meta"
G1 = f"{METHOD} G1 (cached requests)"
G2 = f"{METHOD} G2 (_reqs_need_save)"

# --------------------------------------------------------------------------------------------
# The shapes: k3patch.shapes patterns over the body of the loop that holds the gate. `...`
# stands for any run of statements the patch neither reads nor writes (the gate's body, the
# block accumulation around it); a pattern ends where the gate must be last in its block. The
# match is on syntax trees, so formatting, parentheses and comments do not matter. Each shape's
# vLLM versions are data (`versions`); the report names the release from the surroundings.

G1_BLOCK_COUNT = Shape(
    "A-C / fork",
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
G1_APPLIED = Shape(
    "k3patch",
    Verdict.APPLIED,
    """
    ...
    if req_id in self._reqs_need_pending_save:
        req = self._reqs_need_pending_save[req_id][0]
        if (
            req.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            >= req.num_prompt_tokens
        ):
            ...
    """,
    origin="compute progress, for every pending request",
)
G2_BLOCK_COUNT = Shape(
    "A-C / fork",
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
G2_APPLIED = Shape(
    "k3patch",
    Verdict.APPLIED,
    """
    ...
    if (
        req.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        < req.num_prompt_tokens
    ):
        ...
    ...
    """,
    origin="compute progress",
)
SHAPES: dict[str, tuple[Shape, ...]] = {
    G1: (G1_BLOCK_COUNT, G1_BLOCK_COUNT_D, G1_APPLIED),
    G2: (G2_BLOCK_COUNT, G2_BLOCK_COUNT_D, G2_APPLIED),
}

# Fixed forms recognised by predicate rather than by one skeleton (SITES.md 2): a comparison of
# `num_computed_tokens + ...num_scheduled_tokens...` against `num_prompt_tokens` that decides
# exactly "final chunk" (`>=`) or "not yet" (`<`) where the gate needs it, directly or through
# upstream's `_is_final_prefill_chunk`. Any other comparison of progress with the prompt (`<`
# where `>=` belongs, `==`, `!=`, `>`, sides swapped, a slack) is drift.
UPSTREAM_HELPER = "_is_final_prefill_chunk"
SATISFIED_UPSTREAM = "upstream fix (_is_final_prefill_chunk, 0.32.0 and later)"
SATISFIED_INLINE = "upstream-style progress gate (inline)"

# The older k3-chunk-gate script (apply_kimik3_chunk_gate_fix.py), as it really writes it: a
# per-step map `self._k3_prog` filled at the top of the producer branch, a module-level helper,
# and at each gate a named decision `_k3done = _k3_prefill_done(...)`, an `if _k3done is None:`
# block-count fallback, a debug `if`, then the gate on the name; G1 also gets a sweep over the
# pending requests after its loop (a final chunk without a new block never reaches G1).
LEGACY_HELPER = "_k3_prefill_done"
LEGACY_MAP = "_k3_prog"
LEGACY_DEBUG = "K3_CHUNK_GATE_DEBUG"
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
LEGACY_PENDING = "older k3-chunk-gate script (legacy, defective)"
LEGACY_DEFECTS = (
    "fires up to K3_CHUNK_GATE_SLACK (default 2) tokens early",
    "falls back to the block-count gate (the original bug) when its progress map lacks the request",
)
LEGACY_APPLIED = "k3patch (the older k3-chunk-gate form, repaired in place)"
# The block-count fallback each site's older form keeps, as the script writes it.
LEGACY_FALLBACK = {
    G1: "len(self._reqs_need_pending_save[req_id][1]) * self.block_size >= req.num_prompt_tokens",
    G2: "not (req.num_prompt_tokens > len(block_ids) * self.block_size)",
}
# k3patch's decision in the repaired form: progress of the request the chain decides about.
LEGACY_REPAIR = (
    "{req}.num_computed_tokens\n"
    "+ scheduler_output.num_scheduled_tokens.get({req_id}, 0)\n"
    ">= {req}.num_prompt_tokens"
)
MARKER_LEGACY = (
    "# k3patch moriio-chunk-gate: final when compute progress reaches",
    "# the prompt; no slack (it sent up to 2 tokens early) and no",
    "# block-count fallback (the original bug).",
)
# Names whose appearance in an `if` test makes it a final-chunk gate.
GATE_WORDS = frozenset({"num_prompt_tokens", UPSTREAM_HELPER, LEGACY_HELPER})

# The surroundings of the gates name the upstream release they come from (the gates of A, B, C
# and the fork are the same statements).
_WRITE_MODE = "self.mode == MoRIIOMode.WRITE"
_PRODUCER = "get_role() == ROLE.PRODUCER"
_PRODUCER_BRANCH = f"{_WRITE_MODE} and {_PRODUCER}"
_NOT_PENDING_SKIP = "req_id not in self._reqs_need_pending_save"
# The fork's mamba-blockids edit (SITES.md 1), as statements: `update_state_after_alloc` files
# each saved request's mamba block ids under `self._reqs_save_mamba[request.request_id]`, a map
# that `__init__` starts empty. A name alone decides nothing.
_FORK_MAP = "_reqs_save_mamba"

# --------------------------------------------------------------------------------------------
# The post-image. Only the gate headers are new; each gate keeps its original body.

MARKER_G1 = (
    "# k3patch moriio-chunk-gate: the prompt is complete when this step's",
    "# chunk reaches its end (compute progress, no slack), checked for every",
    "# pending request, also when the chunk allocated no new block. A block",
    "# count fires after chunk 1 once a block outgrows a chunk (K3: ~5,760).",
)
MARKER_G2 = (
    "# k3patch moriio-chunk-gate: not the final chunk until compute progress",
    "# reaches the prompt; a block count fires early once a block outgrows a",
    "# chunk (K3's ~5,760-token blocks).",
)
G1_TEMPLATE = """
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
if (
    req.num_computed_tokens
    + scheduler_output.num_scheduled_tokens.get(req_id, 0)
    < req.num_prompt_tokens
):
    pass
"""


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
        from .sites import classify_sites

        return classify_sites(sources[FILE])

    def rewrite(self, sources: Sources, pending: list[SiteResult]) -> dict[str, str]:
        from .sites import rewrite_sites

        return {FILE: rewrite_sites(sources[FILE], [r.site for r in pending])}

    def probe(self) -> ProbeOutcome:
        from .probe import probe_chunk_gate

        return probe_chunk_gate()


PATCH = MoriioChunkGate()
