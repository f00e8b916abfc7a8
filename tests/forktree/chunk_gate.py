"""The chunk-gate related older scripts, as their edits land on moriio_connector.py of 0.28.0:
`apply_kimik3_moriio_mamba_n1.py` (marker k3-mamba-n1), `apply_kimik3_chunk_gate_fix.py`
(marker k3-chunk-gate, only with K3_EXTRA_FIXES=1) and `apply_kimik3_moriio_save_skip_mamba.py`.

Verbatim from the scripts are only the statements k3patch matches: chunk_gate_fix's two gates
with their `_k3done = _k3_prefill_done(...)` / `if _k3done is None:` fallback and debug `if`,
the `self._k3_prog` map and its entries, and the helper's lookup and comparison. Everything else
(comments, log text, the sweep's bookkeeping, mamba_n1 and save_skip_mamba whole) is written in
our own words with the structure the scripts give it: the same names bound, the same control
flow, at the same places. None of chunk_gate_fix's anchors depends on another older script: on
the pristine 0.28.0 file and after mamba_blockids, group_routing and chunked_allgrp they match
exactly once each (mamba_blockids and group_routing add keyword arguments inside the G1 body's
`meta.add_new_req(...)`, which no anchor here covers).
"""

from __future__ import annotations

from . import Hunk, step

CONN = "distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"

N1 = "apply_kimik3_moriio_mamba_n1.py"
CG = "apply_kimik3_chunk_gate_fix.py"
SK = "apply_kimik3_moriio_save_skip_mamba.py"

# --------------------------------------------------------------------------------------------
# mamba_n1: the P side drops the last prompt token of a hybrid model's disaggregated request
# (`request.num_prompt_tokens -= 1`), the D side asks for N-1 tokens. Four hunks, each replaced
# once (the script's `str.replace(old, new, 1)`); every anchor is unique in 0.28.0.

_N1_INIT_OLD = '        self.is_producer = self.kv_transfer_config.kv_role == "kv_producer"\n'
_N1_INIT_NEW = _N1_INIT_OLD + (
    "        # k3-mamba-n1: a model with a linear-attention (KDA) config keeps recurrent\n"
    "        # state, so the prefill/decode boundary moves one token (N-1).\n"
    "        self._has_mamba = False\n"
    "        try:\n"
    "            _mc = getattr(self.vllm_config, 'model_config', None)\n"
    "            _hf = getattr(_mc, 'hf_config', None) if _mc is not None else None\n"
    "            _tc = getattr(_hf, 'text_config', None) or _hf\n"
    "            _la = getattr(_tc, 'linear_attn_config', None)\n"
    "            if _la is None and isinstance(getattr(_tc, '__dict__', None), dict):\n"
    "                _la = _tc.__dict__.get('linear_attn_config')\n"
    "            if _la:\n"
    "                self._has_mamba = True\n"
    "        except Exception:\n"
    "            self._has_mamba = False\n"
    "        import os as _k3n1os\n"
    "        if _k3n1os.environ.get('K3_MAMBA_N1_FORCE', '') in ('0', '1'):\n"
    "            self._has_mamba = _k3n1os.environ['K3_MAMBA_N1_FORCE'] == '1'\n"
    "        logger.info('[k3-mamba-n1] hybrid model: %s', self._has_mamba)\n"
)

# The scheduler's get_num_new_matched_tokens (the connector's own has a one-line signature).
_N1_HELPERS_OLD = (
    "    def get_num_new_matched_tokens(\n"
    "        self,\n"
    '        request: "Request",\n'
    "        num_computed_tokens: int,\n"
    "    ) -> tuple[int, bool]:\n"
)
_N1_HELPERS_NEW = (
    "    def _get_remote_prefill_token_count(self, num_prompt_tokens: int) -> int:\n"
    "        # k3-mamba-n1: decode recomputes the last prompt token itself.\n"
    "        if getattr(self, '_has_mamba', False) and num_prompt_tokens > 1:\n"
    "            return num_prompt_tokens - 1\n"
    "        return num_prompt_tokens\n"
    "\n"
    '    def _truncate_mamba_request_for_prefill(self, request: "Request") -> None:\n'
    "        # k3-mamba-n1: prefill stops one token short, once per request.\n"
    "        params = request.kv_transfer_params\n"
    "        if (\n"
    "            params is not None\n"
    "            and not params.get('_p_side_truncated')\n"
    "            and request.num_prompt_tokens > 1\n"
    "        ):\n"
    "            if request.prompt_token_ids is not None:\n"
    "                request.prompt_token_ids.pop()\n"
    "            elif getattr(request, 'prompt_embeds', None) is not None:\n"
    "                request.prompt_embeds = request.prompt_embeds[:-1]\n"
    "            else:\n"
    "                return\n"
    "            request._all_token_ids.pop()\n"
    "            request.num_prompt_tokens -= 1\n"
    "            request.max_tokens = 1\n"
    "            params['_p_side_truncated'] = True\n"
    "            logger.info('[k3-mamba-n1] request %s prefills N-1 tokens', request.request_id)\n"
    "\n"
) + _N1_HELPERS_OLD

_N1_PRODUCER_OLD = (
    "        if self.is_producer:\n"
    "            return 0, False\n"
    "\n"
    "        token_ids = request.prompt_token_ids or []\n"
)
_N1_PRODUCER_NEW = (
    "        # k3-mamba-n1: the producer returns right below, so truncate before that.\n"
    "        _k3_params = request.kv_transfer_params\n"
    "        if (\n"
    "            getattr(self, '_has_mamba', False)\n"
    "            and _k3_params is not None\n"
    "            and _k3_params.get('do_remote_decode')\n"
    "        ):\n"
    "            self._truncate_mamba_request_for_prefill(request)\n"
) + _N1_PRODUCER_OLD

_N1_WRITE_OLD = (
    "            # MoriiO in write mode, no remote prefill\n"
    "\n"
    "            return len(token_ids) - num_computed_tokens, True\n"
)
_N1_WRITE_NEW = (
    "            # MoriiO in write mode, no remote prefill.\n"
    "            # k3-mamba-n1: N-1 for a hybrid model, N otherwise.\n"
    "            _k3_n = self._get_remote_prefill_token_count(len(token_ids))\n"
    "            return _k3_n - num_computed_tokens, True\n"
)

step(
    "mamba_n1",
    [
        Hunk(N1, "H1 (_has_mamba in the scheduler's __init__)", CONN, _N1_INIT_OLD, _N1_INIT_NEW),
        Hunk(N1, "H2 (the two helper methods)", CONN, _N1_HELPERS_OLD, _N1_HELPERS_NEW),
        Hunk(N1, "H3a (P-side truncation)", CONN, _N1_PRODUCER_OLD, _N1_PRODUCER_NEW),
        Hunk(N1, "H3b (D-side N-1)", CONN, _N1_WRITE_OLD, _N1_WRITE_NEW),
    ],
)

# --------------------------------------------------------------------------------------------
# chunk_gate_fix. The script checks all five anchors before it writes (any miss: nothing
# written, exit 1), then makes: the helper before the first `class MoRIIOConnector` (its
# HELPER_ANCHOR, replaced once: the connector class, the first of three that start so), and
# A (the map), B (G2), C (G1), D (the sweep).

_CG_HELPER_OLD = "\nclass MoRIIOConnector(KVConnectorBase_V1):\n"
_CG_HELPER_NEW = (
    "\n"
    "def _k3_prefill_done(self, req_id, req):  # k3-chunk-gate\n"
    "    import os as _os\n"
    "    prog = getattr(self, '_k3_prog', None)\n"
    "    if not prog or req_id not in prog:\n"
    "        return None\n"
    "    cb, st = prog[req_id]\n"
    "    slack = int(_os.environ.get('K3_CHUNK_GATE_SLACK', '2'))\n"
    "    return (cb + st) >= (int(req.num_prompt_tokens) - slack)\n"
    "\n"
    "\n"
    "class MoRIIOConnector(KVConnectorBase_V1):\n"
)

_CG_MAP_OLD = (
    "            # This is the logic for checking against chunked prefill.\n"
    "            # When the last chunk is identified,\n"
    "            # It places the request metadata into the saving queue.\n"
)
_CG_MAP_NEW = (
    "            # k3-chunk-gate: per-step progress of every scheduled request, read from\n"
    "            # scheduler_output (the script trusts it over the Request objects).\n"
    "            self._k3_prog = {}\n"
    "            try:\n"
    "                _k3_nst = scheduler_output.num_scheduled_tokens\n"
    "                for _k3_nr in getattr(scheduler_output, 'scheduled_new_reqs', []) or []:\n"
    "                    _k3_rid = getattr(_k3_nr, 'req_id', None)\n"
    "                    if _k3_rid is not None:\n"
    "                        self._k3_prog[_k3_rid] = (\n"
    "                            int(getattr(_k3_nr, 'num_computed_tokens', 0)),\n"
    "                            int(_k3_nst.get(_k3_rid, 0)),\n"
    "                        )\n"
    "                _k3_cr = scheduler_output.scheduled_cached_reqs\n"
    "                for _k3_ci, _k3_crid in enumerate(_k3_cr.req_ids):\n"
    "                    self._k3_prog[_k3_crid] = (\n"
    "                        int(_k3_cr.num_computed_tokens[_k3_ci]),\n"
    "                        int(_k3_nst.get(_k3_crid, 0)),\n"
    "                    )\n"
    "            except Exception:\n"
    "                self._k3_prog = {}\n"
) + _CG_MAP_OLD

_CG_G2_OLD = "            if req.num_prompt_tokens > len(block_ids) * self.block_size:\n"
_CG_G2_NEW = (
    "            # k3-chunk-gate: G2 by the progress map, the block count where it has no entry.\n"
    "            _k3done = _k3_prefill_done(self, req_id, req)\n"
    "            if _k3done is None:\n"
    "                _k3done = not (req.num_prompt_tokens > len(block_ids) * self.block_size)\n"
    "            if os.environ.get('K3_CHUNK_GATE_DEBUG', '0') == '1':\n"
    "                import logging as _k3be_lg\n"
    "                _k3be_lg.getLogger(__name__).warning(\n"
    "                    'k3-chunk-gate G2 %s: done=%s', req_id, _k3done\n"
    "                )\n"
    "            if not _k3done:\n"
)

_CG_G1_OLD = (
    "                    if (\n"
    "                        len(self._reqs_need_pending_save[req_id][1]) * self.block_size\n"
    "                        >= req.num_prompt_tokens\n"
    "                    ):\n"
)
_CG_G1_NEW = (
    "                    _k3done2 = _k3_prefill_done(self, req_id, req)  # k3-chunk-gate\n"
    "                    if _k3done2 is None:\n"
    "                        _k3done2 = (\n"
    "                            len(self._reqs_need_pending_save[req_id][1]) * self.block_size\n"
    "                            >= req.num_prompt_tokens\n"
    "                        )\n"
    "                    if os.environ.get('K3_CHUNK_GATE_DEBUG', '0') == '1':\n"
    "                        import logging as _k3cg_lg\n"
    "                        _k3cg_lg.getLogger(__name__).warning(\n"
    "                            'k3-chunk-gate G1 %s: done=%s', req_id, _k3done2\n"
    "                        )\n"
    "                    if _k3done2:\n"
)

# The sweep goes after the G1 loop, inside the producer branch: a pending request whose final
# chunk allocated no block never reaches G1 (it sits under `if new_block_ids is not None:`).
_CG_SWEEP_OLD = (
    "                        del self._reqs_need_pending_save[req_id]\n"
    "\n"
    "        # Loop through scheduled reqs and convert to ReqMeta.\n"
)
_CG_SWEEP_NEW = (
    "                        del self._reqs_need_pending_save[req_id]\n"
    "\n"
    "            # k3-chunk-gate sweep: pending requests whose last chunk brought no block.\n"
    "            try:\n"
    "                for _k3sw_rid in list(self._reqs_need_pending_save.keys()):\n"
    "                    _k3sw_req, _k3sw_bl = self._reqs_need_pending_save[_k3sw_rid]\n"
    "                    _k3sw_done = _k3_prefill_done(self, _k3sw_rid, _k3sw_req)\n"
    "                    if os.environ.get('K3_CHUNK_GATE_DEBUG', '0') == '1':\n"
    "                        import logging as _k3sw_lg\n"
    "                        _k3sw_lg.getLogger(__name__).warning(\n"
    "                            'k3-chunk-gate sweep %s: done=%s', _k3sw_rid, _k3sw_done\n"
    "                        )\n"
    "                    if not _k3sw_done:\n"
    "                        continue\n"
    "                    _k3sw_kv = self._req_kv_params.pop(\n"
    "                        _k3sw_rid, _k3sw_req.kv_transfer_params or {}\n"
    "                    )\n"
    "                    meta.add_new_req(\n"
    "                        request_id=_k3sw_rid,\n"
    "                        local_block_ids=self._reqs_need_pending_save[_k3sw_rid][1],\n"
    "                        kv_transfer_params=_k3sw_kv,\n"
    "                        write_mode=True,\n"
    "                        mamba_local_block_ids=self._reqs_save_mamba.get(_k3sw_rid, []),\n"
    "                        all_group_block_ids=self._reqs_save_allgrp.get(_k3sw_rid, None),\n"
    "                    )\n"
    "                    del self._reqs_need_pending_save[_k3sw_rid]\n"
    "            except Exception as _k3sw_e:\n"
    "                import logging as _k3sw_lg2\n"
    "                _k3sw_lg2.getLogger(__name__).warning('k3-chunk-gate sweep: %s', _k3sw_e)\n"
    "\n"
    "        # Loop through scheduled reqs and convert to ReqMeta.\n"
)

step(
    "chunk_gate_fix",
    [
        Hunk(CG, "HELPER_CODE before HELPER_ANCHOR", CONN, _CG_HELPER_OLD, _CG_HELPER_NEW),
        Hunk(CG, "Part 1, A_OLD -> A_NEW (the progress map)", CONN, _CG_MAP_OLD, _CG_MAP_NEW),
        Hunk(CG, "Part 2a, B_OLD -> B_NEW (G2, entry defer)", CONN, _CG_G2_OLD, _CG_G2_NEW),
        Hunk(CG, "Part 2b, C_OLD -> C_NEW (G1, final detect)", CONN, _CG_G1_OLD, _CG_G1_NEW),
        Hunk(CG, "Part 2c, D_OLD -> D_NEW (post-loop sweep)", CONN, _CG_SWEEP_OLD, _CG_SWEEP_NEW),
    ],
)

# --------------------------------------------------------------------------------------------
# save_skip_mamba: the worker's save_kv_layer returns early for a mamba layer when
# MORIIO_SKIP_MAMBA=1 (the script replaces the first match; in 0.28.0 there is one).

_SK_OLD = (
    "        if self.mode == MoRIIOMode.READ:\n"
    "            return\n"
    "        remote_engine_id = None\n"
)
_SK_NEW = (
    "        if self.mode == MoRIIOMode.READ:\n"
    "            return\n"
    "        # k3-kda: MORIIO_SKIP_MAMBA=1 keeps the save hook off KDA/mamba layers\n"
    "        # (an inline RDMA write there raced the EP all2all).\n"
    "        import os as _os_k3s\n"
    '        if _os_k3s.environ.get("MORIIO_SKIP_MAMBA", "0") == "1":\n'
    "            from vllm.v1.kv_cache_interface import MambaSpec as _K3MambaSpecSK\n"
    "            if isinstance(self.layer_to_spec.get(layer_name), _K3MambaSpecSK):\n"
    "                return\n"
    "        remote_engine_id = None\n"
)

step("save_skip_mamba", [Hunk(SK, "the save_kv_layer prologue", CONN, _SK_OLD, _SK_NEW)])
