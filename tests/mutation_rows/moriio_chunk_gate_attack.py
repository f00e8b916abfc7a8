# ruff: noqa: E501  (rows hold the edits verbatim, one string per line of the tree)
"""moriio-chunk-gate's attack rows (issue 28; see attack_common.py for the two forms).

VARIANTS are in the harness's format (substitutions in G1_TEMPLATE / G2_TEMPLATE); the attacker's
other wrong fixes touch statements outside those templates (the gate's body, the pending
bookkeeping, the kv_transfer_params snapshot) or are hand ports onto an unpatched tree, which a
template substitution cannot express: they are TREE_ROWS. Duplicates of rows already in
moriio_chunk_gate.py (found after writing): cg-only-new-blocks = chunk-g1-new-blocks-only,
cg-stale-req-object = chunk-g1-stale-req; the both-gates rows below combine single-gate rows.
Measured (benchmarks/ATTACK-28.md): chunk-att-num-tokens killed by apply, the three both-gates
rows by the probes, chunk-att-fork-double-n1 SURVIVES (the probe's stand-in has
_has_mamba=False, so the fork's N-1 helper is a no-op there).
"""

from __future__ import annotations

from .attack_common import ATTACK, TreeRow
from .common import CHUNK, CHUNK_DECL, Sub, Variant

G1_PROGRESS = """        + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        >= req.num_prompt_tokens
"""
G2_PROGRESS = """    + scheduler_output.num_scheduled_tokens.get(req_id, 0)
    < req.num_prompt_tokens
"""
TREES = ("0.31.0", "fork-a")


def _both(id: str, what: str, g1: str, g2: str, trees: tuple[str, ...] = TREES) -> Variant:
    subs = (Sub(CHUNK_DECL, G1_PROGRESS, g1), Sub(CHUNK_DECL, G2_PROGRESS, g2))
    return Variant(id, CHUNK, what, subs, trees, written=ATTACK)


VARIANTS: tuple[Variant, ...] = (
    _both(
        "chunk-att-both-strict",
        "both gates off by one on the final chunk (`>` and `<=`): the prompt must be passed, "
        "not reached, so the save never leaves",
        G1_PROGRESS.replace(">=", ">"),
        G2_PROGRESS.replace("<", "<="),
    ),
    _both(
        "chunk-att-both-minus-one",
        "both gates at `num_prompt_tokens - 1` ('decode recomputes the last token'): sent on the "
        "step before the last prompt token when a chunk ends one short",
        G1_PROGRESS.replace("num_prompt_tokens\n", "num_prompt_tokens - 1\n"),
        G2_PROGRESS.replace("num_prompt_tokens\n", "num_prompt_tokens - 1\n"),
    ),
    _both(
        "chunk-att-both-stale-computed",
        "both gates believe num_computed_tokens already counts this step (the older script's "
        "docstring): the scheduled term dropped, one step late, never for a 1-token prefill",
        "        >= req.num_prompt_tokens\n",
        "    < req.num_prompt_tokens\n",
    ),
    _both(
        "chunk-att-num-tokens",
        "both gates compare with req.num_tokens (prompt + output) instead of num_prompt_tokens",
        G1_PROGRESS.replace("req.num_prompt_tokens", "req.num_tokens"),
        G2_PROGRESS.replace("req.num_prompt_tokens", "req.num_tokens"),
    ),
    _both(
        "chunk-att-fork-double-n1",
        "fork: the k3-mamba-n1 truncation applied a second time (`self._get_remote_prefill_token"
        "_count(req.num_prompt_tokens)`) to a prompt the fork already cut by one: fires at N-2",
        G1_PROGRESS.replace(
            "req.num_prompt_tokens", "self._get_remote_prefill_token_count(req.num_prompt_tokens)"
        ),
        G2_PROGRESS.replace(
            "req.num_prompt_tokens", "self._get_remote_prefill_token_count(req.num_prompt_tokens)"
        ),
        trees=("fork-a",),
    ),
)

TREE_ROWS: tuple[TreeRow, ...] = (
    TreeRow(
        id="cg-final-strict",
        patch="moriio-chunk-gate",
        what="off by one on the final chunk: '>' (the prompt must be passed, not reached); the save never leaves when the last chunk ends exactly at the prompt (it always does)",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        >= req.num_prompt_tokens\n",
                "                        > req.num_prompt_tokens\n",
            ),
            (
                "                < req.num_prompt_tokens\n",
                "                <= req.num_prompt_tokens\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="cg-final-strict",
        patch="moriio-chunk-gate",
        what="off by one on the final chunk: '>' (the prompt must be passed, not reached); the save never leaves when the last chunk ends exactly at the prompt (it always does)",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        >= req.num_prompt_tokens\n",
                "                        > req.num_prompt_tokens\n",
            ),
            (
                "                < req.num_prompt_tokens\n",
                "                <= req.num_prompt_tokens\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="cg-prompt-minus-one",
        patch="moriio-chunk-gate",
        what="'the last prompt token is recomputed by decode' so send at prompt-1: fires on the step BEFORE the last prompt token when a chunk ends exactly one token short",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        >= req.num_prompt_tokens\n",
                "                        >= req.num_prompt_tokens - 1\n",
            ),
            (
                "                < req.num_prompt_tokens\n",
                "                < req.num_prompt_tokens - 1\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="cg-prompt-minus-one",
        patch="moriio-chunk-gate",
        what="'the last prompt token is recomputed by decode' so send at prompt-1: fires on the step BEFORE the last prompt token when a chunk ends exactly one token short",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        >= req.num_prompt_tokens\n",
                "                        >= req.num_prompt_tokens - 1\n",
            ),
            (
                "                < req.num_prompt_tokens\n",
                "                < req.num_prompt_tokens - 1\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="cg-stale-computed",
        patch="moriio-chunk-gate",
        what="believes (as the older script's docstring does) that num_computed_tokens already includes this step's chunk: drops the scheduled term; fires one step late, i.e. never for a 1-output-token prefill",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        req.num_computed_tokens\n                        + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                        >= req.num_prompt_tokens\n",
                "                        req.num_computed_tokens\n                        >= req.num_prompt_tokens\n",
            ),
            (
                "                req.num_computed_tokens\n                + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                < req.num_prompt_tokens\n",
                "                req.num_computed_tokens\n                < req.num_prompt_tokens\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="cg-stale-computed",
        patch="moriio-chunk-gate",
        what="believes (as the older script's docstring does) that num_computed_tokens already includes this step's chunk: drops the scheduled term; fires one step late, i.e. never for a 1-output-token prefill",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        req.num_computed_tokens\n                        + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                        >= req.num_prompt_tokens\n",
                "                        req.num_computed_tokens\n                        >= req.num_prompt_tokens\n",
            ),
            (
                "                req.num_computed_tokens\n                + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                < req.num_prompt_tokens\n",
                "                req.num_computed_tokens\n                < req.num_prompt_tokens\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="cg-only-new-blocks",
        patch="moriio-chunk-gate",
        what="ports the compare but keeps the gate behind new_block_ids (the second defect): a final chunk that allocates no block never sends",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                if req_id in self._reqs_need_pending_save:\n                    req = self._reqs_need_pending_save[req_id][0]\n",
                "                if new_block_ids is not None and req_id in self._reqs_need_pending_save:\n                    req = self._reqs_need_pending_save[req_id][0]\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="cg-only-new-blocks",
        patch="moriio-chunk-gate",
        what="ports the compare but keeps the gate behind new_block_ids (the second defect): a final chunk that allocates no block never sends",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                if req_id in self._reqs_need_pending_save:\n                    req = self._reqs_need_pending_save[req_id][0]\n",
                "                if new_block_ids is not None and req_id in self._reqs_need_pending_save:\n                    req = self._reqs_need_pending_save[req_id][0]\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="cg-stale-req-object",
        patch="moriio-chunk-gate",
        what="drops the line that rebinds req from the pending entry: when the chunk allocated no block, req is the previous request's object (or unbound): two requests' progress mixed",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                if req_id in self._reqs_need_pending_save:\n                    req = self._reqs_need_pending_save[req_id][0]\n",
                "                if req_id in self._reqs_need_pending_save:\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="cg-stale-req-object",
        patch="moriio-chunk-gate",
        what="drops the line that rebinds req from the pending entry: when the chunk allocated no block, req is the previous request's object (or unbound): two requests' progress mixed",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                if req_id in self._reqs_need_pending_save:\n                    req = self._reqs_need_pending_save[req_id][0]\n",
                "                if req_id in self._reqs_need_pending_save:\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="cg-fork-double-n1",
        patch="moriio-chunk-gate",
        what="fork only: 'decode recomputes the last prompt token' (k3-mamba-n1) applied a second time to a prompt the fork already truncated: fires at N-2 on a hybrid model",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        >= req.num_prompt_tokens\n",
                "                        >= self._get_remote_prefill_token_count(req.num_prompt_tokens)\n",
            ),
            (
                "                < req.num_prompt_tokens\n",
                "                < self._get_remote_prefill_token_count(req.num_prompt_tokens)\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="cg-send-twice",
        patch="moriio-chunk-gate",
        what="forgets to delete the pending entry after the save: every later step that schedules the request (decode, or a resumed request after preemption) sends again; entry leaks",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(("                        del self._reqs_need_pending_save[req_id]\n", ""),),
        recorded="verify",
        recorded_detail="status: applied (rc 0); wrong in 32 of 119 checks: resumed after preemption: 4,000-token prompt recomputed over 4,098 tokens, chunks 2,048 + 2,050 (past the prompt's end) [resumed-4000]: save at chunk 2 of 2 and at the decode step after, expected chunk 2 only (G1); block 5,760: 2,049 tokens (1 chunk + 1): save at chunk 2 o",
    ),
    TreeRow(
        id="cg-send-twice",
        patch="moriio-chunk-gate",
        what="forgets to delete the pending entry after the save: every later step that schedules the request (decode, or a resumed request after preemption) sends again; entry leaks",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(("                        del self._reqs_need_pending_save[req_id]\n", ""),),
        recorded="verify",
        recorded_detail="status: applied (rc 0); wrong in 32 of 119 checks: resumed after preemption: 4,000-token prompt recomputed over 4,098 tokens, chunks 2,048 + 2,050 (past the prompt's end) [resumed-4000]: save at chunk 2 of 2 and at the decode step after, expected chunk 2 only (G1); block 5,760: 2,049 tokens (1 chunk + 1): save at chunk 2 o",
    ),
    TreeRow(
        id="cg-g2-setdefault",
        patch="moriio-chunk-gate",
        what="'do not clobber the blocks G1 accumulated': after preemption the request re-registers with new blocks, but the stale (freed) list is kept and sent from",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                self._reqs_need_pending_save[req_id] = (req, block_ids)\n                continue\n",
                "                self._reqs_need_pending_save.setdefault(req_id, (req, block_ids))\n                continue\n",
            ),
        ),
        recorded="verify",
        recorded_detail="status: applied (rc 0); wrong in 4 of 119 checks: workload seed 3: r1 sent blocks [2, 2, 1], expected its own [2, 1] (prompt 7705; computed+scheduled step 1: 0+790, step 2: 790+790, step 3: 1580+790, step 4: 2370+790, step 5: 3160+790, step 6: 3950+790, step 7: 4740+790, step 9: 0+790, step 10: 790+790, step 11: 1580+790, ",
    ),
    TreeRow(
        id="cg-g2-setdefault",
        patch="moriio-chunk-gate",
        what="'do not clobber the blocks G1 accumulated': after preemption the request re-registers with new blocks, but the stale (freed) list is kept and sent from",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                self._reqs_need_pending_save[req_id] = (req, block_ids)\n                continue\n",
                "                self._reqs_need_pending_save.setdefault(req_id, (req, block_ids))\n                continue\n",
            ),
        ),
        recorded="verify",
        recorded_detail="status: applied (rc 0); wrong in 3 of 119 checks: workload seed 3: r1 sent blocks [2, 2, 1], expected its own [2, 1] (prompt 7705; computed+scheduled step 1: 0+790, step 2: 790+790, step 3: 1580+790, step 4: 2370+790, step 5: 3160+790, step 6: 3950+790, step 7: 4740+790, step 9: 0+790, step 10: 790+790, step 11: 1580+790, ",
    ),
    TreeRow(
        id="cg-num-tokens",
        patch="moriio-chunk-gate",
        what="compares with req.num_tokens (prompt + output) instead of num_prompt_tokens: a resumed request that already produced a token waits for more than its prompt",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        >= req.num_prompt_tokens\n",
                "                        >= req.num_tokens\n",
            ),
            ("                < req.num_prompt_tokens\n", "                < req.num_tokens\n"),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="cg-num-tokens",
        patch="moriio-chunk-gate",
        what="compares with req.num_tokens (prompt + output) instead of num_prompt_tokens: a resumed request that already produced a token waits for more than its prompt",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        >= req.num_prompt_tokens\n",
                "                        >= req.num_tokens\n",
            ),
            ("                < req.num_prompt_tokens\n", "                < req.num_tokens\n"),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="cg-g1-break",
        patch="moriio-chunk-gate",
        what="'one final chunk per step': breaks out of the cached-requests loop after the first save; a second request finishing in the same step is never sent (and later ones lose growth)",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        del self._reqs_need_pending_save[req_id]\n",
                "                        del self._reqs_need_pending_save[req_id]\n                        break\n",
            ),
        ),
        recorded="verify",
        recorded_detail="status: applied (rc 0); wrong in 6 of 119 checks: workload seed 0: r3 sent blocks [14, 15, 16, 17, 18, 19, 20, 21], expected its own [14, 15, 16, 17, 18, 19, 20, 22, 21] (prompt 283; computed+scheduled step 13: 192+11, step 14: 203+14, step 15: 217+17, step 16: 234+17, step 17: 251+17, step 18: 268+15); workload seed 2: r2",
    ),
    TreeRow(
        id="cg-g1-break",
        patch="moriio-chunk-gate",
        what="'one final chunk per step': breaks out of the cached-requests loop after the first save; a second request finishing in the same step is never sent (and later ones lose growth)",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        del self._reqs_need_pending_save[req_id]\n",
                "                        del self._reqs_need_pending_save[req_id]\n                        break\n",
            ),
        ),
        recorded="verify",
        recorded_detail="status: applied (rc 0); wrong in 6 of 119 checks: workload seed 0: r3 sent blocks [14, 15, 16, 17, 18, 19, 20, 21], expected its own [14, 15, 16, 17, 18, 19, 20, 22, 21] (prompt 283; computed+scheduled step 13: 192+11, step 14: 203+14, step 15: 217+17, step 16: 234+17, step 17: 251+17, step 18: 268+15); workload seed 2: r2",
    ),
    TreeRow(
        id="cg-g2-half-ported",
        patch="moriio-chunk-gate",
        what="ports G1 only: G2 keeps the block-count gate, so a one-block prompt sends after chunk 1",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "            if (\n                req.num_computed_tokens\n                + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                < req.num_prompt_tokens\n            ):\n",
                "            tokens_covered = (\n                len(block_ids[self._full_attn_group_idx]) * self._full_attn_block_size\n            )\n            if req.num_prompt_tokens > tokens_covered:\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: pending (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="cg-g2-half-ported",
        patch="moriio-chunk-gate",
        what="ports G1 only: G2 keeps the block-count gate, so a one-block prompt sends after chunk 1",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "            if (\n                req.num_computed_tokens\n                + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                < req.num_prompt_tokens\n            ):\n",
                "            if req.num_prompt_tokens > len(block_ids) * self.block_size:\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: pending (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="hpa-correct",
        patch="moriio-chunk-gate",
        what="CONTROL: the gate hand-ported in upstream 0.32.0's shape (a method)",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                '            params["do_remote_prefill"] = False\n\n    def build_connector_meta(\n',
                '            params["do_remote_prefill"] = False\n\n    def _is_final_prefill_chunk(self, req, scheduler_output) -> bool:\n        scheduled = scheduler_output.num_scheduled_tokens.get(req.request_id, 0)\n        return req.num_computed_tokens + scheduled >= req.num_prompt_tokens\n\n    def build_connector_meta(\n',
            ),
            (
                "                    if (\n                        req.num_computed_tokens\n                        + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                        >= req.num_prompt_tokens\n                    ):\n",
                "                    if self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
            (
                "            if (\n                req.num_computed_tokens\n                + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                < req.num_prompt_tokens\n            ):\n",
                "            if not self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="hpa-correct",
        patch="moriio-chunk-gate",
        what="CONTROL: the gate hand-ported in upstream 0.32.0's shape (a method)",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                '            params["do_remote_prefill"] = False\n\n    def build_connector_meta(\n',
                '            params["do_remote_prefill"] = False\n\n    def _is_final_prefill_chunk(self, req, scheduler_output) -> bool:\n        scheduled = scheduler_output.num_scheduled_tokens.get(req.request_id, 0)\n        return req.num_computed_tokens + scheduled >= req.num_prompt_tokens\n\n    def build_connector_meta(\n',
            ),
            (
                "                    if (\n                        req.num_computed_tokens\n                        + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                        >= req.num_prompt_tokens\n                    ):\n",
                "                    if self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
            (
                "            if (\n                req.num_computed_tokens\n                + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                < req.num_prompt_tokens\n            ):\n",
                "            if not self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="hpa-transfer-id-key",
        patch="moriio-chunk-gate",
        what="scheduled tokens looked up by the MoRIIO transfer id (what the connector's maps are keyed by) instead of the request id: 0 whenever they differ, the save never leaves",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                '            params["do_remote_prefill"] = False\n\n    def build_connector_meta(\n',
                '            params["do_remote_prefill"] = False\n\n    def _is_final_prefill_chunk(self, req, scheduler_output) -> bool:\n        rid = self.request_id_to_transfer_id.get(req.request_id, req.request_id)\n        scheduled = scheduler_output.num_scheduled_tokens.get(rid, 0)\n        return req.num_computed_tokens + scheduled >= req.num_prompt_tokens\n\n    def build_connector_meta(\n',
            ),
            (
                "                    if (\n                        req.num_computed_tokens\n                        + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                        >= req.num_prompt_tokens\n                    ):\n",
                "                    if self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
            (
                "            if (\n                req.num_computed_tokens\n                + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                < req.num_prompt_tokens\n            ):\n",
                "            if not self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="hpa-transfer-id-key",
        patch="moriio-chunk-gate",
        what="scheduled tokens looked up by the MoRIIO transfer id (what the connector's maps are keyed by) instead of the request id: 0 whenever they differ, the save never leaves",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                '            params["do_remote_prefill"] = False\n\n    def build_connector_meta(\n',
                '            params["do_remote_prefill"] = False\n\n    def _is_final_prefill_chunk(self, req, scheduler_output) -> bool:\n        rid = self.request_id_to_transfer_id.get(req.request_id, req.request_id)\n        scheduled = scheduler_output.num_scheduled_tokens.get(rid, 0)\n        return req.num_computed_tokens + scheduled >= req.num_prompt_tokens\n\n    def build_connector_meta(\n',
            ),
            (
                "                    if (\n                        req.num_computed_tokens\n                        + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                        >= req.num_prompt_tokens\n                    ):\n",
                "                    if self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
            (
                "            if (\n                req.num_computed_tokens\n                + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                < req.num_prompt_tokens\n            ):\n",
                "            if not self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="hpa-memo-wrong-key",
        patch="moriio-chunk-gate",
        what="a cache keyed by the wrong thing: the answer memoised by (computed, prompt) only, so two requests of one length at the same progress share one answer whatever their chunks",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                '            params["do_remote_prefill"] = False\n\n    def build_connector_meta(\n',
                "            params[\"do_remote_prefill\"] = False\n\n    def _is_final_prefill_chunk(self, req, scheduler_output) -> bool:\n        key = (req.num_computed_tokens, req.num_prompt_tokens)\n        memo = self.__dict__.setdefault('_final_memo', {})\n        if key not in memo:\n            scheduled = scheduler_output.num_scheduled_tokens.get(req.request_id, 0)\n            memo[key] = req.num_computed_tokens + scheduled >= req.num_prompt_tokens\n        return memo[key]\n\n    def build_connector_meta(\n",
            ),
            (
                "                    if (\n                        req.num_computed_tokens\n                        + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                        >= req.num_prompt_tokens\n                    ):\n",
                "                    if self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
            (
                "            if (\n                req.num_computed_tokens\n                + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                < req.num_prompt_tokens\n            ):\n",
                "            if not self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="hpa-memo-wrong-key",
        patch="moriio-chunk-gate",
        what="a cache keyed by the wrong thing: the answer memoised by (computed, prompt) only, so two requests of one length at the same progress share one answer whatever their chunks",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                '            params["do_remote_prefill"] = False\n\n    def build_connector_meta(\n',
                "            params[\"do_remote_prefill\"] = False\n\n    def _is_final_prefill_chunk(self, req, scheduler_output) -> bool:\n        key = (req.num_computed_tokens, req.num_prompt_tokens)\n        memo = self.__dict__.setdefault('_final_memo', {})\n        if key not in memo:\n            scheduled = scheduler_output.num_scheduled_tokens.get(req.request_id, 0)\n            memo[key] = req.num_computed_tokens + scheduled >= req.num_prompt_tokens\n        return memo[key]\n\n    def build_connector_meta(\n",
            ),
            (
                "                    if (\n                        req.num_computed_tokens\n                        + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                        >= req.num_prompt_tokens\n                    ):\n",
                "                    if self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
            (
                "            if (\n                req.num_computed_tokens\n                + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                < req.num_prompt_tokens\n            ):\n",
                "            if not self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="hpa-g1-under-new-blocks",
        patch="moriio-chunk-gate",
        what="upstream's method, but G1's call still behind new_block_ids (the second defect)",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                '            params["do_remote_prefill"] = False\n\n    def build_connector_meta(\n',
                '            params["do_remote_prefill"] = False\n\n    def _is_final_prefill_chunk(self, req, scheduler_output) -> bool:\n        scheduled = scheduler_output.num_scheduled_tokens.get(req.request_id, 0)\n        return req.num_computed_tokens + scheduled >= req.num_prompt_tokens\n\n    def build_connector_meta(\n',
            ),
            (
                "                    if (\n                        req.num_computed_tokens\n                        + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                        >= req.num_prompt_tokens\n                    ):\n",
                "                    if new_block_ids is not None and self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
            (
                "            if (\n                req.num_computed_tokens\n                + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                < req.num_prompt_tokens\n            ):\n",
                "            if not self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="hpa-g1-under-new-blocks",
        patch="moriio-chunk-gate",
        what="upstream's method, but G1's call still behind new_block_ids (the second defect)",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                '            params["do_remote_prefill"] = False\n\n    def build_connector_meta(\n',
                '            params["do_remote_prefill"] = False\n\n    def _is_final_prefill_chunk(self, req, scheduler_output) -> bool:\n        scheduled = scheduler_output.num_scheduled_tokens.get(req.request_id, 0)\n        return req.num_computed_tokens + scheduled >= req.num_prompt_tokens\n\n    def build_connector_meta(\n',
            ),
            (
                "                    if (\n                        req.num_computed_tokens\n                        + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                        >= req.num_prompt_tokens\n                    ):\n",
                "                    if new_block_ids is not None and self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
            (
                "            if (\n                req.num_computed_tokens\n                + scheduler_output.num_scheduled_tokens.get(req_id, 0)\n                < req.num_prompt_tokens\n            ):\n",
                "            if not self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="o-growth-reversed",
        patch="moriio-chunk-gate",
        what="the pending block list grown in the wrong order (new chunk's blocks first): the save names its blocks out of token order",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        existing_blocks[g] + new_block_ids[g]\n",
                "                        new_block_ids[g] + existing_blocks[g]\n",
            ),
        ),
        recorded="verify",
        recorded_detail="status: applied (rc 0); wrong in 58 of 119 checks: 16-token blocks, a new block every chunk: the full block list is sent [small]: save at chunk 3 of 3, expected chunk 3 only (G1); sent blocks [256, 257, 258, 259, 260, 261, 262, 263] (313), allocated 313; block 5,760: 6,145 tokens (3 chunks + 1): save at chunk 4 of 4, expec",
    ),
    TreeRow(
        id="o-growth-reversed",
        patch="moriio-chunk-gate",
        what="the pending block list grown in the wrong order (new chunk's blocks first): the save names its blocks out of token order",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                    updated_blocks = list(existing_blocks) + (block_ids)\n",
                "                    updated_blocks = list(block_ids) + list(existing_blocks)\n",
            ),
        ),
        recorded="verify",
        recorded_detail="status: applied (rc 0); wrong in 58 of 119 checks: 16-token blocks, a new block every chunk: the full block list is sent [small]: save at chunk 3 of 3, expected chunk 3 only (G1); sent blocks [256, 257, 258, 259, 260, 261, 262, 263] (313), allocated 313; block 5,760: 6,145 tokens (3 chunks + 1): save at chunk 4 of 4, expec",
    ),
    TreeRow(
        id="o-save-chunk-blocks",
        patch="moriio-chunk-gate",
        what="the G1 save names block_ids (this chunk's new blocks, in scope on the fork) instead of the accumulated list: only the last chunk's blocks cross",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                            local_block_ids=self._reqs_need_pending_save[req_id][1],\n",
                "                            local_block_ids=block_ids,\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="o-reclaim-all",
        patch="moriio-chunk-gate",
        what="reclaims every snapshot of this step's new requests, also the deferred ones: the final chunk falls back to the live kv_transfer_params, which may have been cleared",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "        for req_id in self._reqs_need_save:\n            if req_id not in self._reqs_need_pending_save:\n                self._req_kv_params.pop(req_id, None)\n",
                "        for req_id in self._reqs_need_save:\n            self._req_kv_params.pop(req_id, None)\n",
            ),
        ),
        recorded="SURVIVED",
        recorded_detail="status: applied (rc 0); (all probes passed)",
        equivalent="nothing in vLLM 0.31.0 or the fork clears a producer's request.kv_transfer_params between update_state_after_alloc and the final chunk (grep: no `kv_transfer_params = None` or `.clear()` on it in v1/ or moriio/), so the live dict the save falls back to holds what the snapshot held",
    ),
    TreeRow(
        id="o-reclaim-all",
        patch="moriio-chunk-gate",
        what="reclaims every snapshot of this step's new requests, also the deferred ones: the final chunk falls back to the live kv_transfer_params, which may have been cleared",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "        for req_id in self._reqs_need_save:\n            if req_id not in self._reqs_need_pending_save:\n                self._req_kv_params.pop(req_id, None)\n",
                "        for req_id in self._reqs_need_save:\n            self._req_kv_params.pop(req_id, None)\n",
            ),
        ),
        recorded="SURVIVED",
        recorded_detail="status: applied (rc 0); (all probes passed)",
        equivalent="nothing in vLLM 0.31.0 or the fork clears a producer's request.kv_transfer_params between update_state_after_alloc and the final chunk (grep: no `kv_transfer_params = None` or `.clear()` on it in v1/ or moriio/), so the live dict the save falls back to holds what the snapshot held",
    ),
    TreeRow(
        id="d-sweep-no-del",
        patch="moriio-chunk-gate",
        what="repaired older-script form: the sweep sends but keeps the pending entry, so it sends again on every later step",
        tree="fork-d",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(("                    del self._reqs_need_pending_save[_k3sw_rid]\n", ""),),
        recorded="verify",
        recorded_detail="status: applied (rc 0); wrong in 41 of 119 checks: resumed after preemption: 4,000-token prompt recomputed over 4,098 tokens, chunks 2,048 + 2,050 (past the prompt's end) [resumed-4000]: save at chunk 2 of 2 and at the decode step after, expected chunk 2 only (G1); block 5,760: 2,049 tokens (1 chunk + 1): save at chunk 2 o",
    ),
    TreeRow(
        id="d-sweep-break",
        patch="moriio-chunk-gate",
        what="repaired older-script form: the sweep stops at the first pending request that is not done, skipping later ones' final saves (issue 28 names a sibling)",
        tree="fork-d",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                    if not _k3sw_done:\n                        continue\n",
                "                    if not _k3sw_done:\n                        break\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="hp-correct",
        patch="moriio-chunk-gate",
        what="CONTROL: a correct hand port in upstream 0.32.0's shape",
        tree="0.31.0",
        base="pristine",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                '            params["do_remote_prefill"] = False\n\n    def build_connector_meta(\n',
                '            params["do_remote_prefill"] = False\n\n    def _is_final_prefill_chunk(self, req, scheduler_output) -> bool:\n        """Whether this step computes the prompt\'s last token."""\n        scheduled = scheduler_output.num_scheduled_tokens.get(req.request_id, 0)\n        return req.num_computed_tokens + scheduled >= req.num_prompt_tokens\n\n    def build_connector_meta(\n',
            ),
            (
                "                if new_block_ids is not None:\n",
                "                        del self._reqs_need_pending_save[req_id]\n",
                "                if req_id not in self._reqs_need_pending_save:\n                    continue\n                req, blocks = self._reqs_need_pending_save[req_id]\n                if new_block_ids is not None:\n                    blocks = [blocks[g] + new_block_ids[g] for g in range(len(new_block_ids))]\n                    self._reqs_need_pending_save[req_id] = (req, blocks)\n                if not self._is_final_prefill_chunk(req, scheduler_output):\n                    continue\n                kv_params = self._req_kv_params.pop(req_id, req.kv_transfer_params or {})\n                meta.add_new_req(\n                    request_id=req_id,\n                    local_block_ids=blocks,\n                    kv_transfer_params=kv_params,\n                    write_mode=True,\n                )\n                del self._reqs_need_pending_save[req_id]\n",
            ),
            (
                "            tokens_covered = (\n                len(block_ids[self._full_attn_group_idx]) * self._full_attn_block_size\n            )\n            if req.num_prompt_tokens > tokens_covered:\n",
                "            if not self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
        ),
        recorded="SURVIVED",
        recorded_detail="status: satisfied (rc 0); (all probes passed)",
        equivalent="the control: a correct hand port in upstream 0.32.0's shape",
    ),
    TreeRow(
        id="hp-transfer-id-key",
        patch="moriio-chunk-gate",
        what="scheduled tokens looked up by the MoRIIO transfer id (the key of the connector's own maps) instead of the request id: 0 whenever the router's transfer_id differs; the save never leaves",
        tree="0.31.0",
        base="pristine",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                '            params["do_remote_prefill"] = False\n\n    def build_connector_meta(\n',
                '            params["do_remote_prefill"] = False\n\n    def _is_final_prefill_chunk(self, req, scheduler_output) -> bool:\n        rid = self.request_id_to_transfer_id.get(req.request_id, req.request_id)\n        scheduled = scheduler_output.num_scheduled_tokens.get(rid, 0)\n        return req.num_computed_tokens + scheduled >= req.num_prompt_tokens\n\n    def build_connector_meta(\n',
            ),
            (
                "                if new_block_ids is not None:\n",
                "                        del self._reqs_need_pending_save[req_id]\n",
                "                if req_id not in self._reqs_need_pending_save:\n                    continue\n                req, blocks = self._reqs_need_pending_save[req_id]\n                if new_block_ids is not None:\n                    blocks = [blocks[g] + new_block_ids[g] for g in range(len(new_block_ids))]\n                    self._reqs_need_pending_save[req_id] = (req, blocks)\n                if not self._is_final_prefill_chunk(req, scheduler_output):\n                    continue\n                kv_params = self._req_kv_params.pop(req_id, req.kv_transfer_params or {})\n                meta.add_new_req(\n                    request_id=req_id,\n                    local_block_ids=blocks,\n                    kv_transfer_params=kv_params,\n                    write_mode=True,\n                )\n                del self._reqs_need_pending_save[req_id]\n",
            ),
            (
                "            tokens_covered = (\n                len(block_ids[self._full_attn_group_idx]) * self._full_attn_block_size\n            )\n            if req.num_prompt_tokens > tokens_covered:\n",
                "            if not self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
        ),
        recorded="verify",
        recorded_detail="status: satisfied (rc 0); wrong in 107 of 119 checks: K3: 2,611-token prompt, one 5,760-token block, chunks 2,048 + 563 (no new block) [k3-2611]: no save in 2 chunks, expected chunk 2 only (G1); K3: 5,000-token prompt, chunks 2,048 + 2,048 + 904 [k3-3chunk]: no save in 3 chunks, expected chunk 3 only (G1); last chunk of 2 to",
    ),
    TreeRow(
        id="hp-gate-before-growth",
        patch="moriio-chunk-gate",
        what="gate checked before the chunk's new blocks are added: the save leaves on time but without the blocks the final chunk allocated (their KV never crosses)",
        tree="0.31.0",
        base="pristine",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                '            params["do_remote_prefill"] = False\n\n    def build_connector_meta(\n',
                '            params["do_remote_prefill"] = False\n\n    def _is_final_prefill_chunk(self, req, scheduler_output) -> bool:\n        """Whether this step computes the prompt\'s last token."""\n        scheduled = scheduler_output.num_scheduled_tokens.get(req.request_id, 0)\n        return req.num_computed_tokens + scheduled >= req.num_prompt_tokens\n\n    def build_connector_meta(\n',
            ),
            (
                "                if new_block_ids is not None:\n",
                "                        del self._reqs_need_pending_save[req_id]\n",
                "                if req_id not in self._reqs_need_pending_save:\n                    continue\n                req, blocks = self._reqs_need_pending_save[req_id]\n                if self._is_final_prefill_chunk(req, scheduler_output):\n                    kv_params = self._req_kv_params.pop(req_id, req.kv_transfer_params or {})\n                    meta.add_new_req(\n                        request_id=req_id,\n                        local_block_ids=blocks,\n                        kv_transfer_params=kv_params,\n                        write_mode=True,\n                    )\n                    del self._reqs_need_pending_save[req_id]\n                    continue\n                if new_block_ids is not None:\n                    blocks = [blocks[g] + new_block_ids[g] for g in range(len(new_block_ids))]\n                    self._reqs_need_pending_save[req_id] = (req, blocks)\n",
            ),
            (
                "            tokens_covered = (\n                len(block_ids[self._full_attn_group_idx]) * self._full_attn_block_size\n            )\n            if req.num_prompt_tokens > tokens_covered:\n",
                "            if not self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
        ),
        recorded="verify",
        recorded_detail="status: satisfied (rc 0); wrong in 48 of 119 checks: 16-token blocks, a new block every chunk: the full block list is sent [small]: save at chunk 3 of 3, expected chunk 3 only (G1); sent blocks [0, 1, 2, 3, 4, 5, 6, 7] (256), allocated 313; block 5,760: 6,145 tokens, mamba_n1 N-1: 6,144 (3 chunks): save at chunk 3 of 3, expe",
    ),
    TreeRow(
        id="hp-params-get",
        patch="moriio-chunk-gate",
        what="reads the kv_transfer_params snapshot with get instead of pop: one dict per chunked request stays in the scheduler forever",
        tree="0.31.0",
        base="pristine",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                '            params["do_remote_prefill"] = False\n\n    def build_connector_meta(\n',
                '            params["do_remote_prefill"] = False\n\n    def _is_final_prefill_chunk(self, req, scheduler_output) -> bool:\n        """Whether this step computes the prompt\'s last token."""\n        scheduled = scheduler_output.num_scheduled_tokens.get(req.request_id, 0)\n        return req.num_computed_tokens + scheduled >= req.num_prompt_tokens\n\n    def build_connector_meta(\n',
            ),
            (
                "                if new_block_ids is not None:\n",
                "                        del self._reqs_need_pending_save[req_id]\n",
                "                if req_id not in self._reqs_need_pending_save:\n                    continue\n                req, blocks = self._reqs_need_pending_save[req_id]\n                if new_block_ids is not None:\n                    blocks = [blocks[g] + new_block_ids[g] for g in range(len(new_block_ids))]\n                    self._reqs_need_pending_save[req_id] = (req, blocks)\n                if not self._is_final_prefill_chunk(req, scheduler_output):\n                    continue\n                kv_params = self._req_kv_params.get(req_id, req.kv_transfer_params or {})\n                meta.add_new_req(\n                    request_id=req_id,\n                    local_block_ids=blocks,\n                    kv_transfer_params=kv_params,\n                    write_mode=True,\n                )\n                del self._reqs_need_pending_save[req_id]\n",
            ),
            (
                "            tokens_covered = (\n                len(block_ids[self._full_attn_group_idx]) * self._full_attn_block_size\n            )\n            if req.num_prompt_tokens > tokens_covered:\n",
                "            if not self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
        ),
        recorded="SURVIVED",
        recorded_detail="status: satisfied (rc 0); (all probes passed)",
    ),
    TreeRow(
        id="hp-skip-resumed",
        patch="moriio-chunk-gate",
        what="an over-fix for 'fires on a resumed request': skips resumed requests entirely, so their new blocks never join and a resumed request whose last chunk is the resume step never sends",
        tree="0.31.0",
        base="pristine",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                '            params["do_remote_prefill"] = False\n\n    def build_connector_meta(\n',
                '            params["do_remote_prefill"] = False\n\n    def _is_final_prefill_chunk(self, req, scheduler_output) -> bool:\n        """Whether this step computes the prompt\'s last token."""\n        scheduled = scheduler_output.num_scheduled_tokens.get(req.request_id, 0)\n        return req.num_computed_tokens + scheduled >= req.num_prompt_tokens\n\n    def build_connector_meta(\n',
            ),
            (
                "                if new_block_ids is not None:\n",
                "                        del self._reqs_need_pending_save[req_id]\n",
                "                if req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids:\n                    continue\n                if req_id not in self._reqs_need_pending_save:\n                    continue\n                req, blocks = self._reqs_need_pending_save[req_id]\n                if new_block_ids is not None:\n                    blocks = [blocks[g] + new_block_ids[g] for g in range(len(new_block_ids))]\n                    self._reqs_need_pending_save[req_id] = (req, blocks)\n                if not self._is_final_prefill_chunk(req, scheduler_output):\n                    continue\n                kv_params = self._req_kv_params.pop(req_id, req.kv_transfer_params or {})\n                meta.add_new_req(\n                    request_id=req_id,\n                    local_block_ids=blocks,\n                    kv_transfer_params=kv_params,\n                    write_mode=True,\n                )\n                del self._reqs_need_pending_save[req_id]\n",
            ),
            (
                "            tokens_covered = (\n                len(block_ids[self._full_attn_group_idx]) * self._full_attn_block_size\n            )\n            if req.num_prompt_tokens > tokens_covered:\n",
                "            if not self._is_final_prefill_chunk(req, scheduler_output):\n",
            ),
        ),
        recorded="SURVIVED",
        recorded_detail="status: satisfied (rc 0); (all probes passed)",
        # Declared equivalent by the attacker; it is not: a resumed request whose resume chunk is
        # its last is saved by G2, but G1 no longer deletes its pre-preemption pending entry, so
        # it and its kv_transfer_params snapshot stay for the server's life (the leak check).
    ),
    TreeRow(
        id="hp-g2-defer-drops-pending",
        patch="moriio-chunk-gate",
        what="G2 defers with setdefault ('keep what G1 accumulated'): after preemption and resumption the request keeps its old, freed block list and the save names it",
        tree="0.31.0",
        base="pristine",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                '            params["do_remote_prefill"] = False\n\n    def build_connector_meta(\n',
                '            params["do_remote_prefill"] = False\n\n    def _is_final_prefill_chunk(self, req, scheduler_output) -> bool:\n        """Whether this step computes the prompt\'s last token."""\n        scheduled = scheduler_output.num_scheduled_tokens.get(req.request_id, 0)\n        return req.num_computed_tokens + scheduled >= req.num_prompt_tokens\n\n    def build_connector_meta(\n',
            ),
            (
                "                if new_block_ids is not None:\n",
                "                        del self._reqs_need_pending_save[req_id]\n",
                "                if req_id not in self._reqs_need_pending_save:\n                    continue\n                req, blocks = self._reqs_need_pending_save[req_id]\n                if new_block_ids is not None:\n                    blocks = [blocks[g] + new_block_ids[g] for g in range(len(new_block_ids))]\n                    self._reqs_need_pending_save[req_id] = (req, blocks)\n                if not self._is_final_prefill_chunk(req, scheduler_output):\n                    continue\n                kv_params = self._req_kv_params.pop(req_id, req.kv_transfer_params or {})\n                meta.add_new_req(\n                    request_id=req_id,\n                    local_block_ids=blocks,\n                    kv_transfer_params=kv_params,\n                    write_mode=True,\n                )\n                del self._reqs_need_pending_save[req_id]\n",
            ),
            (
                "            tokens_covered = (\n                len(block_ids[self._full_attn_group_idx]) * self._full_attn_block_size\n            )\n            if req.num_prompt_tokens > tokens_covered:\n",
                "            if not self._is_final_prefill_chunk(req, scheduler_output):\n                self._reqs_need_pending_save.setdefault(req_id, (req, block_ids))\n                continue\n            if False:\n",
            ),
        ),
        recorded="verify",
        recorded_detail="status: satisfied (rc 0); wrong in 4 of 119 checks: workload seed 3: r1 sent blocks [2, 2, 1], expected its own [2, 1] (prompt 7705; computed+scheduled step 1: 0+790, step 2: 790+790, step 3: 1580+790, step 4: 2370+790, step 5: 3160+790, step 6: 3950+790, step 7: 4740+790, step 9: 0+790, step 10: 790+790, step 11: 1580+790, ",
    ),
    TreeRow(
        id="o-params-get",
        patch="moriio-chunk-gate",
        what="G1 reads the kv_transfer_params snapshot with get, not pop: one dict per chunked request stays in the scheduler for the life of the process",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        kv_params = self._req_kv_params.pop(\n",
                "                        kv_params = self._req_kv_params.get(\n",
            ),
        ),
        recorded="SURVIVED",
        recorded_detail="status: applied (rc 0); (all probes passed)",
    ),
    TreeRow(
        id="o-params-get",
        patch="moriio-chunk-gate",
        what="G1 reads the kv_transfer_params snapshot with get, not pop: one dict per chunked request stays in the scheduler for the life of the process",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        kv_params = self._req_kv_params.pop(\n",
                "                        kv_params = self._req_kv_params.get(\n",
            ),
        ),
        recorded="SURVIVED",
        recorded_detail="status: applied (rc 0); (all probes passed)",
    ),
    TreeRow(
        id="o-live-params",
        patch="moriio-chunk-gate",
        what="G1 sends with the live kv_transfer_params instead of the snapshot uSAA took (the snapshot also leaks): a request whose live params were cleared saves with {} (no peer)",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        kv_params = self._req_kv_params.pop(\n                            req_id, req.kv_transfer_params or {}\n                        )\n",
                "                        kv_params = req.kv_transfer_params or {}\n",
            ),
        ),
        recorded="SURVIVED",
        recorded_detail="status: applied (rc 0); (all probes passed)",
    ),
    TreeRow(
        id="o-live-params",
        patch="moriio-chunk-gate",
        what="G1 sends with the live kv_transfer_params instead of the snapshot uSAA took (the snapshot also leaks): a request whose live params were cleared saves with {} (no peer)",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        kv_params = self._req_kv_params.pop(\n                            req_id, req.kv_transfer_params or {}\n                        )\n",
                "                        kv_params = req.kv_transfer_params or {}\n",
            ),
        ),
        recorded="SURVIVED",
        recorded_detail="status: applied (rc 0); (all probes passed)",
    ),
    TreeRow(
        id="o-no-nondisagg-skip",
        patch="moriio-chunk-gate",
        what="the non-disagg skip rewritten as a lookup with a default, ending the loop (break) instead of skipping: a plain request ahead of a disagg one in the step hides the latter",
        tree="0.31.0",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                    if req_id not in self._reqs_need_pending_save:\n                        continue\n                    req, existing_blocks = self._reqs_need_pending_save[req_id]\n",
                "                    req, existing_blocks = self._reqs_need_pending_save.get(req_id, (None, []))\n                    if req is None:\n                        break\n",
            ),
        ),
        recorded="verify",
        recorded_detail="status: applied (rc 0); wrong in 4 of 119 checks: workload seed 0: r1 saved never, expected once at step 4 (prompt 49; computed+scheduled step 1: 0+15, step 2: 15+15, step 3: 30+15, step 4: 45+4) (and 1 more); workload seed 17: r2 sent blocks [4, 5, 12, 14, 15, 8, 18], expected its own [4, 5, 7, 9, 12, 14, 15, 8, 18] (prom",
    ),
)
