"""moriio-chunk-gate's wrong fixes: G1_TEMPLATE and G2_TEMPLATE are both what apply writes and
the applied shapes; on tree d the older script's decisions are repaired by LEGACY_TEMPLATE
(gates.py), which k3patch reads back by its meaning (a progress comparison), not by a shape."""

from __future__ import annotations

from .common import CHUNK, CHUNK_DECL, CHUNK_LEGACY, FIRST, ISSUE_28, Sub, Variant

G1_PROGRESS = """        + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        >= req.num_prompt_tokens
"""
G2_PROGRESS = """    + scheduler_output.num_scheduled_tokens.get(req_id, 0)
    < req.num_prompt_tokens
"""
SCHEDULED = "scheduler_output.num_scheduled_tokens.get(req_id, 0)"
LEGACY_SCHEDULED = "    + scheduler_output.num_scheduled_tokens.get({req_id}, 0)\n"
TREES = ("0.31.0", "fork-a")  # shape D gates, shape C gates in the fork
# Rows that bring back a block count read the fork's (shape C) names: `self.block_size` and one
# list of block ids; shape D keeps per-group lists, where the same text means something else.
FORK_ONLY = ("fork-a",)
LEGACY_TREES = ("fork-d",)


def _g1(id: str, what: str, old: str, new: str, **kw: str) -> Variant:
    return _chunk(id, what, Sub(CHUNK_DECL, old, new), **kw)


def _chunk(
    id: str,
    what: str,
    *subs: Sub,
    trees: tuple[str, ...] = TREES,
    equivalent: str = "",
    written: str = FIRST,
) -> Variant:
    return Variant(id, CHUNK, what, subs, trees, equivalent, written)


def _legacy(id: str, what: str, old: str, new: str, written: str = FIRST) -> Variant:
    return _chunk(id, what, Sub(CHUNK_LEGACY, old, new), trees=LEGACY_TREES, written=written)


VARIANTS: tuple[Variant, ...] = (
    _g1(
        "chunk-g1-gt",
        "G1 `>=` -> `>`: the save waits for progress past the prompt (never, on the final chunk)",
        G1_PROGRESS,
        G1_PROGRESS.replace(">=", ">"),
    ),
    _g1(
        "chunk-g1-eq",
        "G1 `>=` -> `==`: final only when progress lands exactly on the prompt",
        G1_PROGRESS,
        G1_PROGRESS.replace(">=", "=="),
    ),
    _g1(
        "chunk-g1-slack1",
        "G1 slack 1: `>= num_prompt_tokens - 1` (fires one token early)",
        G1_PROGRESS,
        G1_PROGRESS.replace("num_prompt_tokens\n", "num_prompt_tokens - 1\n"),
    ),
    _g1(
        "chunk-g1-slack2",
        "G1 slack 2: `>= num_prompt_tokens - 2` (the older script's default slack)",
        G1_PROGRESS,
        G1_PROGRESS.replace("num_prompt_tokens\n", "num_prompt_tokens - 2\n"),
    ),
    _g1(
        "chunk-g1-no-scheduled",
        "G1 without `num_scheduled_tokens` (progress before this step's chunk)",
        "        req.num_computed_tokens\n" + G1_PROGRESS,
        "        req.num_computed_tokens\n        >= req.num_prompt_tokens\n",
    ),
    _g1(
        "chunk-g1-new-blocks-only",
        "G1 back under `new_block_ids is not None` (a final chunk without a new block never sends)",
        "\nif req_id in self._reqs_need_pending_save:\n    req = self",
        "\nif new_block_ids is not None and req_id in self._reqs_need_pending_save:\n"
        "    req = self",
    ),
    _g1(
        "chunk-g1-default-1",
        "G1's `num_scheduled_tokens.get(req_id, 0)` default -> 1",
        G1_PROGRESS,
        G1_PROGRESS.replace("get(req_id, 0)", "get(req_id, 1)"),
        equivalent="G1 loops over scheduler_output.scheduled_cached_reqs, and every request in it "
        "has its entry in num_scheduled_tokens (vLLM's Scheduler fills both from the same "
        "scheduled set), so the default is never read",
    ),
    _chunk(
        "chunk-g2-inverted",
        "G2 `<` -> `>=` (defers the final chunk, sends the first)",
        Sub(CHUNK_DECL, G2_PROGRESS, G2_PROGRESS.replace("<", ">=")),
    ),
    _chunk(
        "chunk-g2-le",
        "G2 `<` -> `<=` (a one-chunk prompt is deferred past its only chunk)",
        Sub(CHUNK_DECL, G2_PROGRESS, G2_PROGRESS.replace("<", "<=")),
    ),
    _chunk(
        "chunk-g2-slack2",
        "G2 slack 2: `< num_prompt_tokens - 2` (a new request within 2 tokens is sent at once)",
        Sub(CHUNK_DECL, G2_PROGRESS, G2_PROGRESS.replace("tokens\n", "tokens - 2\n")),
    ),
    _chunk(
        "chunk-g2-no-scheduled",
        "G2 without `num_scheduled_tokens` (a one-chunk prompt reads as not final)",
        Sub(
            CHUNK_DECL,
            "    req.num_computed_tokens\n" + G2_PROGRESS,
            "    req.num_computed_tokens\n    < req.num_prompt_tokens\n",
        ),
    ),
    # The older script's decisions on tree d, repaired in place by LEGACY_TEMPLATE (gates.py),
    # which k3patch reads back by its meaning, not by a stored shape.
    _legacy(
        "chunk-legacy-gt",
        "the repaired decision `>=` -> `>` (tree d)",
        "    >= {req}.num_prompt_tokens\n",
        "    > {req}.num_prompt_tokens\n",
    ),
    _legacy(
        "chunk-legacy-slack2",
        "the repaired decision keeps a slack of 2 (tree d)",
        "    >= {req}.num_prompt_tokens\n",
        "    >= {req}.num_prompt_tokens - 2\n",
    ),
    _legacy(
        "chunk-legacy-no-scheduled",
        "the repaired decision without `num_scheduled_tokens` (tree d)",
        LEGACY_SCHEDULED,
        "",
    ),
    _legacy(
        "chunk-legacy-keeps-fallback",
        "the repair leaves the `if NAME is None:` block-count fallback in place (tree d)",
        "stmts = [self.decision] if self.fallback is None else [self.decision, self.fallback]",
        "stmts = [self.decision]",
    ),
    # ---- issue 28: written before its probes were extended.
    _g1(
        "chunk-g1-step-total",
        "G1 counts the whole step's tokens (`total_num_scheduled_tokens`): a chunk shared with "
        "other requests reads as final early, and the save leaves with part of the prompt",
        G1_PROGRESS,
        G1_PROGRESS.replace(SCHEDULED, "scheduler_output.total_num_scheduled_tokens"),
        written=ISSUE_28,
    ),
    _chunk(
        "chunk-g2-step-total",
        "G2 counts the whole step's tokens: a new request's first chunk, beside other requests, "
        "reads as final and is sent after chunk 1",
        Sub(
            CHUNK_DECL,
            G2_PROGRESS,
            G2_PROGRESS.replace(SCHEDULED, "scheduler_output.total_num_scheduled_tokens"),
        ),
        written=ISSUE_28,
    ),
    _chunk(
        "chunk-g2-no-computed",
        "G2 ignores tokens already computed (`scheduled < prompt`): a prefix-cache hit defers "
        "the final chunk of a new request, and a one-token request is never sent",
        Sub(
            CHUNK_DECL,
            "    req.num_computed_tokens\n" + G2_PROGRESS,
            "    scheduler_output.num_scheduled_tokens.get(req_id, 0)\n"
            "    < req.num_prompt_tokens\n",
        ),
        written=ISSUE_28,
    ),
    _g1(
        "chunk-g1-no-computed",
        "G1 compares this step's chunk alone with the prompt (`scheduled >= prompt`): a prompt "
        "that needs two chunks never reads final",
        "        req.num_computed_tokens\n" + G1_PROGRESS,
        "        scheduler_output.num_scheduled_tokens.get(req_id, 0)\n"
        "        >= req.num_prompt_tokens\n",
        written=ISSUE_28,
    ),
    _g1(
        "chunk-g1-stale-req",
        "G1 does not rebind `req` from the pending entry: a final chunk that allocates no block "
        "is judged by the request the loop saw last (or UnboundLocalError)",
        "    req = self._reqs_need_pending_save[req_id][0]\n",
        "",
        written=ISSUE_28,
    ),
    _chunk(
        "chunk-g2-prompt-token-ids",
        "G2 reads the prompt length as `len(req.prompt_token_ids)`: a prompt-embeds request "
        "(prompt_token_ids None) raises TypeError in the scheduler",
        Sub(
            CHUNK_DECL,
            G2_PROGRESS,
            G2_PROGRESS.replace("req.num_prompt_tokens", "len(req.prompt_token_ids)"),
        ),
        written=ISSUE_28,
    ),
    _g1(
        "chunk-g1-guard-any-pending",
        "G1's guard tests the pending dict's truth, not membership: a scheduled request that is "
        "not pending (no KV transfer, or already sent) raises KeyError while another is pending",
        "\nif req_id in self._reqs_need_pending_save:\n    req = self",
        "\nif self._reqs_need_pending_save:\n    req = self",
        written=ISSUE_28,
    ),
    _chunk(
        "chunk-g1-or-block-count",
        "G1 keeps the block count as an alternative (`progress >= prompt or blocks * block_size "
        ">= prompt`): the original bug, belt and braces",
        Sub(
            CHUNK_DECL,
            G1_PROGRESS,
            G1_PROGRESS + "        or len(self._reqs_need_pending_save[req_id][1]) * "
            "self.block_size\n        >= req.num_prompt_tokens\n",
        ),
        trees=FORK_ONLY,
        written=ISSUE_28,
    ),
    _chunk(
        "chunk-g2-and-block-count",
        "G2 defers only while both progress and the block count say not final: a prompt that "
        "fits one block is sent after chunk 1",
        Sub(
            CHUNK_DECL,
            G2_PROGRESS,
            G2_PROGRESS + "    and req.num_prompt_tokens > len(block_ids) * self.block_size\n",
        ),
        trees=FORK_ONLY,
        written=ISSUE_28,
    ),
    _g1(
        "chunk-g1-scheduled-by-position",
        "G1 reads this step's tokens by the loop's position (`list(num_scheduled_tokens."
        "values())[i]`): wrong where the dict's order is not the cached list's (resumed "
        "requests after new ones)",
        G1_PROGRESS,
        G1_PROGRESS.replace(SCHEDULED, "list(scheduler_output.num_scheduled_tokens.values())[i]"),
        written=ISSUE_28,
    ),
    _legacy(
        "chunk-legacy-scheduled-index",
        "the repaired decision indexes `num_scheduled_tokens[req_id]` (tree d): a pending request "
        "that sits out a step raises KeyError in the sweep's try, and the sweep skips the "
        "final saves after it",
        LEGACY_SCHEDULED,
        "    + scheduler_output.num_scheduled_tokens[{req_id}]\n",
        written=ISSUE_28,
    ),
    _legacy(
        "chunk-legacy-literal-req-id",
        "the repaired decision spells `req_id`, not the chain's own id (tree d): the sweep reads "
        "the last G1 request's scheduled tokens for every pending request",
        LEGACY_SCHEDULED,
        "    + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n",
        written=ISSUE_28,
    ),
)
