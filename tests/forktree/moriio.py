"""The MoRIIO older scripts other than the chunk-gate ones, as their edits land on the three
MoRIIO files of vLLM 0.28.0 (`moriio_common.py`, `moriio_connector.py`, `moriio_engine.py`).

Verbatim from the scripts are only what k3patch matches and what a later script's anchor needs:
the mamba-blockids statements (fields, the `_k3_gbi` capture, the notify list, the keywords, the
plan's `_k3_mamba` choice) with their `# k3-mamba-blockids` marker comments (group_routing's
anchors contain them), the four comment lines of the `_comments` variant (group_routing's plan
anchor contains them), group_routing's plan (`_k3_gr_local = getattr(...)` ... its `if/elif/else`)
and chunked_allgrp's `try:` block. Everything else (comments, log text, the K3_MAMBA_BC debug
block's body, the pod-hosts and probe blocks, group_routing's worker map) is written in our own
words with the structure the scripts give it: the same names bound, the same control flow, in
the same place.

What each script does on 0.28.0, read off the scripts and checked by running reconstructions of
them in the recipe's order on a scratch copy of the wheel:
- block_size_fix: its anchors match, but it edits `register_kv_caches` only, which k3patch does
  not read: a no-op here.
- page_pad: none of its anchors is in 0.28.0's `moriio_layout.py` (it warns and returns 0):
  a no-op in the real recipe too.
- port_offset_tpsize: every anchor matches; of its five edits two are in functions k3patch reads
  (uSAA's decode notify target port, the worker `__init__`'s side-channel port). Only those two
  are reproduced; the others are in `moriio_common.py`'s config, the release notify and the
  engine's completion notify.
- pod_hosts: every anchor matches; the decode notify host fallback (uSAA) and the write stash
  (`_write_blocks_for_req`) are reproduced, the handshake (not read) is not.
- mamba_blockids: every anchor matches once (SITES.md section 0). Three variants of its plan hunk.
- remote_tp_fix: its anchors match; it edits `_remote_tp_rank` and `_moriio_handshake` only,
  which k3patch does not read: a no-op here.
- group_routing: two-pass, all anchors or nothing. Its plan anchor (E3) contains four comment
  lines under `if _k3_mamba:` that the stored mamba-blockids script does not write, so after the
  stored script it writes nothing at all; trees (c) and (d) build on `mamba_blockids_comments`.
- chunked_allgrp: one anchor (G1's `block_ids = new_block_ids[0]`), matches.
- xfer_probe: five edits in order, each written as it goes, stopping at the first missing anchor.
  The first four match (MLA offsets in `moriio_layout.py`, the Triton MLA decode, uSAA's
  `_k3_gbi_d` dump, the worker `__init__`'s group dump); the fifth (the Mamba offsets' return)
  is not in 0.28.0, so the script exits 1 after writing four. The two in functions k3patch reads
  are reproduced.
- write_fence: its anchors match; it edits `_finalize_if_complete` and `_execute_write_task`,
  which k3patch does not read: a no-op here.
- mamba_diag: none of its anchors is in 0.28.0's `moriio_layout.py` (it says "nothing to do"):
  a no-op in the real recipe too.
"""

from __future__ import annotations

from pathlib import Path

from . import Hunk, action, step

MORIIO = "distributed/kv_transfer/kv_connector/v1/moriio"
COMMON = f"{MORIIO}/moriio_common.py"
CONN = f"{MORIIO}/moriio_connector.py"
ENGINE = f"{MORIIO}/moriio_engine.py"

BS = "apply_kimik3_moriio_block_size_fix.py"
PP = "apply_kimik3_moriio_mamba_page_pad_fix.py"
PO = "apply_kimik3_moriio_port_offset_tpsize.py"
PH = "apply_kimik3_moriio_pod_hosts.py"
MB = "apply_kimik3_moriio_mamba_blockids.py"
RT = "apply_kimik3_moriio_remote_tp_fix.py"
GR = "apply_kimik3_moriio_group_routing.py"
CA = "apply_kimik3_chunked_allgrp.py"
XP = "diagnostics/apply_kimik3_xfer_probe.py"
WF = "apply_kimik3_moriio_write_fence.py"
MD = "apply_kimik3_moriio_mamba_diag.py"

MB_MARK = "  # k3-mamba-blockids"
GR_MARK = "  # k3-group-routing"


def _no_op(why: str):
    def run(_vllm: Path) -> None:
        """Nothing: see `why`."""

    run.__doc__ = why
    return run


# --------------------------------------------------------------------------------------------
# Scripts that leave nothing k3patch reads.

action(
    "block_size_fix",
    _no_op(f"{BS}: edits register_kv_caches only (its anchors match 0.28.0); k3patch reads none"),
)
action("page_pad", _no_op(f"{PP}: no anchor of it is in 0.28.0's moriio_layout.py"))
action(
    "remote_tp_fix",
    _no_op(f"{RT}: edits _remote_tp_rank and _moriio_handshake only; k3patch reads neither"),
)
action(
    "write_fence",
    _no_op(f"{WF}: edits _finalize_if_complete and _execute_write_task; k3patch reads neither"),
)
action("mamba_diag", _no_op(f"{MD}: no anchor of it is in 0.28.0's moriio_layout.py"))


# --------------------------------------------------------------------------------------------
# port_offset_tpsize: the real TP size goes into the port offsets, so ranks (dp, tp) do not
# collide when both vary on one node.

_PO_NOTIFY_OLD = (
    "                        target_port = remote_notify_port + get_port_offset(\n"
    "                            _remote_dp_rank_for_port, tp_index\n"
    "                        )\n"
)
_PO_NOTIFY_NEW = (
    "                        # k3-portoff: flatten (dp, tp) with the real TP size\n"
    "                        target_port = remote_notify_port + get_port_offset(\n"
    "                            _remote_dp_rank_for_port, tp_index, self.tp_size\n"
    "                        )\n"
)
_PO_SIDE_OLD = (
    "        self.side_channel_port: int = (\n"
    "            self.moriio_config.handshake_port\n"
    "            + get_port_offset(self.dp_rank, self.tp_rank)\n"
    "        )\n"
)
_PO_SIDE_NEW = (
    "        # k3-portoff: the side channel port is unique per (dp, tp) only with the TP size\n"
    "        self.side_channel_port: int = (\n"
    "            self.moriio_config.handshake_port\n"
    "            + get_port_offset(self.dp_rank, self.tp_rank, self.moriio_config.tp_size)\n"
    "        )\n"
)
step(
    "port_offset_tpsize",
    [
        Hunk(PO, "connector, block-notify target (uSAA)", CONN, _PO_NOTIFY_OLD, _PO_NOTIFY_NEW),
        Hunk(PO, "connector, worker side_channel_port bind", CONN, _PO_SIDE_OLD, _PO_SIDE_NEW),
    ],
)


# --------------------------------------------------------------------------------------------
# pod_hosts: with no router-given host list, fall back to the launcher's per-pod hosts (and a
# DP-local size derived from them) so ranks on a headless node are reached.

_PH_NOTIFY_OLD = (
    "                    _notify_host = remote_host\n"
    "                    _kvp = request.kv_transfer_params or {}\n"
    '                    _remote_hosts = _kvp.get("remote_hosts") or []\n'
    "                    if _dp_local > 0 and _remote_hosts:\n"
    "                        _pod_idx = pod_index(remote_dp_rank, _dp_local)\n"
    "                        if 0 <= _pod_idx < len(_remote_hosts):\n"
    "                            _notify_host = _remote_hosts[_pod_idx]\n"
)
_PH_NOTIFY_NEW = (
    "                    _notify_host = remote_host\n"
    "                    _kvp = request.kv_transfer_params or {}\n"
    '                    _remote_hosts = _kvp.get("remote_hosts") or []\n'
    "                    # k3-podhosts: the launcher's pod list when the router gave none\n"
    '                    if not _remote_hosts and hasattr(self, "kv_transfer_config"):\n'
    "                        _k3n = self.kv_transfer_config.kv_connector_extra_config.get(\n"
    '                            "moriio_pod_hosts", ""\n'
    "                        )\n"
    "                        _remote_hosts = [\n"
    '                            h.strip() for h in str(_k3n).split(",") if h.strip()\n'
    "                        ]\n"
    "                    _k3_dpl = _dp_local\n"
    "                    if not _k3_dpl and _remote_hosts and _dp_size % len(_remote_hosts) == 0:\n"
    "                        _k3_dpl = _dp_size // len(_remote_hosts)\n"
    "                    if _k3_dpl > 0 and _remote_hosts:\n"
    "                        _pod_idx = pod_index(remote_dp_rank, _k3_dpl)\n"
    "                        if 0 <= _pod_idx < len(_remote_hosts):\n"
    "                            _notify_host = _remote_hosts[_pod_idx]\n"
    "                        _remote_dp_rank_for_port = fold_local_rank(remote_dp_rank, _k3_dpl)\n"
    "                        logger.info(\n"
    '                            "k3-podhosts: notify for rank %d goes to %s (%d per pod)",\n'
    "                            remote_dp_rank,\n"
    "                            _notify_host,\n"
    "                            _k3_dpl,\n"
    "                        )\n"
)
_PH_STASH_OLD = (
    "        if meta.multi_pod_hosts:\n"
    "            self.multi_pod_hosts = list(meta.multi_pod_hosts)\n"
    "        else:\n"
    "            self.multi_pod_hosts = [meta.remote_host]\n"
    "        if meta.remote_dp_size_local:\n"
    "            self.remote_dp_size_local = int(meta.remote_dp_size_local)\n"
    "        else:\n"
    "            self.remote_dp_size_local = int(meta.remote_dp_size)\n"
)
_PH_STASH_NEW = (
    "        # k3-podhosts: a longer launcher pod list wins over the router's single host,\n"
    "        # and the DP-local size follows from the number of pods.\n"
    "        _k3_meta_ph = list(meta.multi_pod_hosts) if meta.multi_pod_hosts else []\n"
    "        _k3_lp = (\n"
    '            self.kv_transfer_config.kv_connector_extra_config.get("moriio_pod_hosts", "")\n'
    '            if hasattr(self, "kv_transfer_config")\n'
    '            else ""\n'
    "        )\n"
    '        _k3_lp = [h.strip() for h in str(_k3_lp).split(",") if h.strip()]\n'
    "        if len(_k3_lp) > len(_k3_meta_ph):\n"
    "            self.multi_pod_hosts = _k3_lp\n"
    "        elif _k3_meta_ph:\n"
    "            self.multi_pod_hosts = _k3_meta_ph\n"
    "        else:\n"
    "            self.multi_pod_hosts = [meta.remote_host]\n"
    "        _k3_gdp = int(meta.remote_dp_size)\n"
    "        _k3_npods = max(1, len(self.multi_pod_hosts))\n"
    "        if 0 < int(meta.remote_dp_size_local) < _k3_gdp:\n"
    "            self.remote_dp_size_local = int(meta.remote_dp_size_local)\n"
    "        elif _k3_gdp % _k3_npods == 0:\n"
    "            self.remote_dp_size_local = _k3_gdp // _k3_npods\n"
    "        else:\n"
    "            self.remote_dp_size_local = _k3_gdp\n"
    "        logger.info(\n"
    '            "k3-podhosts: completion notify hosts %s, %d ranks per pod",\n'
    "            self.multi_pod_hosts,\n"
    "            self.remote_dp_size_local,\n"
    "        )\n"
)
step(
    "pod_hosts",
    [
        Hunk(PH, "notify anchor (uSAA decode notify host)", CONN, _PH_NOTIFY_OLD, _PH_NOTIFY_NEW),
        Hunk(PH, "stash anchor (_write_blocks_for_req)", CONN, _PH_STASH_OLD, _PH_STASH_NEW),
    ],
)


# --------------------------------------------------------------------------------------------
# mamba_blockids: the fork's two-group routing (attention = [0], mamba = [1]), end to end.

_MB_COMMON = [
    Hunk(
        MB,
        "patch_common, WriteTask field",
        COMMON,
        "    remote_ip: str\n    enqueue_time: float = field(default_factory=time.perf_counter)\n",
        "    remote_ip: str\n"
        f"    mamba_local_block_ids: list[int] | None = None{MB_MARK}\n"
        "    enqueue_time: float = field(default_factory=time.perf_counter)\n",
    ),
    Hunk(
        MB,
        "patch_common, RemoteAllocInfo field",
        COMMON,
        "    block_ids: list[int]\n    writes_done: int = 0\n",
        "    block_ids: list[int]\n"
        f"    mamba_block_ids: list[int] | None = None{MB_MARK}\n"
        "    writes_done: int = 0\n",
    ),
    Hunk(
        MB,
        "patch_common, ReqMeta field",
        COMMON,
        "    # Per-pod DP size; 0 means fallback to remote_dp_size.\n"
        "    remote_dp_size_local: int = 0\n",
        "    # Per-pod DP size; 0 means fallback to remote_dp_size.\n"
        "    remote_dp_size_local: int = 0\n"
        # group_routing's C3 anchor holds this comment line.
        "    # k3-mamba-blockids: mamba KV-group [1] local slot id(s) for this req.\n"
        "    mamba_local_block_ids: list[int] = field(default_factory=list)\n",
    ),
    Hunk(
        MB,
        "patch_common, add_new_req signature",
        COMMON,
        "        kv_transfer_params: dict[str, Any],\n        write_mode=False,\n    ):",
        "        kv_transfer_params: dict[str, Any],\n"
        "        write_mode=False,\n"
        f"        mamba_local_block_ids: list[int] | None = None,{MB_MARK}\n"
        "    ):",
    ),
    Hunk(
        MB,
        "patch_common, add_new_req body",
        COMMON,
        "        if write_mode:\n            self.reqs_to_save[request_id] = _req\n",
        f"        _req.mamba_local_block_ids = list(mamba_local_block_ids or []){MB_MARK}\n"
        "        if write_mode:\n"
        "            self.reqs_to_save[request_id] = _req\n",
    ),
]

_MB_NOTIFY_OLD = (
    '        block_notify_list = data.get("block_notify_list", [])\n'
    '        decode_dp_rank = data.get("decode_rank", 0)\n'
)
_MB_NOTIFY_NEW = (
    '        block_notify_list = data.get("block_notify_list", [])\n'
    f'        mamba_block_notify_list = data.get("mamba_block_notify_list", []){MB_MARK}\n'
    '        decode_dp_rank = data.get("decode_rank", 0)\n'
)
_MB_ALLOC_OLD = (
    "            self.done_remote_allocate_req_dict[transfer_id] = RemoteAllocInfo(\n"
    "                block_ids=block_notify_list, decode_dp_rank=decode_dp_rank\n"
    "            )\n"
)
_MB_ALLOC_NEW = (
    "            self.done_remote_allocate_req_dict[transfer_id] = RemoteAllocInfo(\n"
    "                block_ids=block_notify_list, decode_dp_rank=decode_dp_rank,\n"
    f"                mamba_block_ids=list(mamba_block_notify_list or []),{MB_MARK}\n"
    "            )\n"
)

_MB_PLAN_OLD = (
    "        if offsets is None:\n"
    "            offsets = self.worker._compute_block_transfer_offsets(\n"
    "                task.layer_name,\n"
    "                task.local_block_ids,\n"
    "                request_info.block_ids,\n"
    "                remote_moriio_meta,\n"
    "            )\n"
)
# group_routing's E3 anchor holds these four lines (the stored mamba-blockids script lacks them).
_MB_PLAN_COMMENTS = (
    "                # k3-mamba-blockids: mamba/KDA state lives in a SEPARATE KV-cache\n"
    "                # group whose slot ids differ from the attention group's block ids.\n"
    "                # Route the mamba-layer transfer by the mamba group's ids (falling\n"
    "                # back to attention ids for non-hybrid models).\n"
)
# The stored script's K3_MAMBA_BC block: once per kind (Mamba or attention) it logs which lists
# the layer's offsets come from and the norm of the first source slot. It reads `_k3_mamba`,
# `_k3_local` and `_k3_remote` and binds nothing the plan uses afterwards.
_MB_PLAN_DEBUG = (
    "            import os as _k3dbgos\n"
    "            if _k3dbgos.environ.get('K3_MAMBA_BC', '0') == '1':\n"
    "                _k3dbg = getattr(self, '_k3_mb_seen', None)\n"
    "                if _k3dbg is None:\n"
    "                    _k3dbg = set()\n"
    "                    self._k3_mb_seen = _k3dbg\n"
    "                _k3k = 'M' if _k3_mamba else 'A'\n"
    "                if _k3k not in _k3dbg:\n"
    "                    _k3dbg.add(_k3k)\n"
    "                    _k3srcnorm = -1.0\n"
    "                    try:\n"
    "                        if _k3_local:\n"
    "                            _k3t = self.worker.kv_caches[task.layer_name]\n"
    "                            _k3srcnorm = float(_k3t[int(_k3_local[0])].float().norm())\n"
    "                    except Exception:\n"
    "                        _k3srcnorm = -2.0\n"
    "                    logger.info(\n"
    '                        "k3 mamba-bc: %s mamba=%s local=%s remote=%s norm=%.3e",\n'
    "                        task.layer_name,\n"
    "                        _k3_mamba,\n"
    "                        (_k3_local or [])[:3],\n"
    "                        (_k3_remote or [])[:3],\n"
    "                        _k3srcnorm,\n"
    "                    )\n"
)


def _mb_plan(comments: bool, debug: bool) -> str:
    return (
        "        if offsets is None:\n"
        f"            from vllm.v1.kv_cache_interface import MambaSpec as _K3MS_BL{MB_MARK}\n"
        "            _k3_mamba = isinstance(\n"
        "                self.worker.layer_to_spec.get(task.layer_name), _K3MS_BL\n"
        "            )\n"
        "            if _k3_mamba:\n"
        + (_MB_PLAN_COMMENTS if comments else "")
        + "                _k3_local = task.mamba_local_block_ids or task.local_block_ids\n"
        "                _k3_remote = request_info.mamba_block_ids or request_info.block_ids\n"
        "            else:\n"
        "                _k3_local = task.local_block_ids\n"
        "                _k3_remote = request_info.block_ids\n"
        + (_MB_PLAN_DEBUG if debug else "")
        + "            offsets = self.worker._compute_block_transfer_offsets(\n"
        "                task.layer_name,\n"
        "                _k3_local,\n"
        "                _k3_remote,\n"
        "                remote_moriio_meta,\n"
        "            )\n"
    )


_MB_CONNECTOR = [
    Hunk(
        MB,
        "patch_connector, scheduler __init__ side dict",
        CONN,
        "        self._reqs_need_save: dict[ReqId, tuple[Request, list[int]]] = {}\n",
        "        self._reqs_need_save: dict[ReqId, tuple[Request, list[int]]] = {}\n"
        f"        self._reqs_save_mamba: dict[ReqId, list[int]] = {{}}{MB_MARK}\n",
    ),
    Hunk(
        MB,
        "patch_connector, prefill save capture (uSAA do_remote_decode)",
        CONN,
        '        if params.get("do_remote_decode"):\n'
        "            local_block_ids = blocks.get_block_ids()[0]\n",
        '        if params.get("do_remote_decode"):\n'
        "            _k3_gbi = blocks.get_block_ids()\n"
        "            local_block_ids = _k3_gbi[0]\n"
        f"            self._reqs_save_mamba[request.request_id] = ({MB_MARK}\n"
        "                list(_k3_gbi[1]) if len(_k3_gbi) > 1 else []\n"
        "            )\n",
    ),
    Hunk(
        MB,
        "patch_connector, send_notify_block signature",
        CONN,
        "        block_notify_list: list[int],\n        host=None,\n        port=None,\n    ):",
        "        block_notify_list: list[int],\n"
        "        host=None,\n"
        "        port=None,\n"
        f"        mamba_block_notify_list: list[int] | None = None,{MB_MARK}\n"
        "    ):",
    ),
    Hunk(
        MB,
        "patch_connector, send_notify_block message",
        CONN,
        '            "block_notify_list": block_notify_list or [],\n',
        '            "block_notify_list": block_notify_list or [],\n'
        f'            "mamba_block_notify_list": mamba_block_notify_list or [],{MB_MARK}\n',
    ),
    Hunk(
        MB,
        "patch_connector, decode advertise (uSAA)",
        CONN,
        "                    block_notify_list = (\n"
        "                        blocks.get_block_ids()[0] if num_external_tokens > 0 else []\n"
        "                    )\n",
        f"                    _k3_gbi_d = blocks.get_block_ids(){MB_MARK}\n"
        "                    block_notify_list = (\n"
        "                        _k3_gbi_d[0] if num_external_tokens > 0 else []\n"
        "                    )\n"
        "                    mamba_block_notify_list = (\n"
        "                        (list(_k3_gbi_d[1]) if len(_k3_gbi_d) > 1 else [])\n"
        "                        if num_external_tokens > 0 else []\n"
        "                    )\n",
    ),
    Hunk(
        MB,
        "patch_connector, decode advertise send_notify_block call",
        CONN,
        "                            host=_notify_host,\n"
        "                            port=target_port,\n"
        "                        )\n",
        "                            host=_notify_host,\n"
        "                            port=target_port,\n"
        f"                            mamba_block_notify_list=mamba_block_notify_list,{MB_MARK}\n"
        "                        )\n",
    ),
    Hunk(
        MB,
        "patch_connector, bCM final-chunk save add_new_req",
        CONN,
        "                            local_block_ids=self._reqs_need_pending_save[req_id][1],\n"
        "                            kv_transfer_params=kv_params,\n"
        "                            write_mode=True,\n"
        "                        )\n",
        "                            local_block_ids=self._reqs_need_pending_save[req_id][1],\n"
        "                            kv_transfer_params=kv_params,\n"
        "                            write_mode=True,\n"
        "                            mamba_local_block_ids=self._reqs_save_mamba.get(req_id, [])"
        f",{MB_MARK}\n"
        "                        )\n",
    ),
    Hunk(
        MB,
        "patch_connector, bCM single-chunk save add_new_req",
        CONN,
        "                local_block_ids=block_ids,\n"
        "                kv_transfer_params=kv_params,\n"
        "                write_mode=True,\n"
        "            )\n",
        "                local_block_ids=block_ids,\n"
        "                kv_transfer_params=kv_params,\n"
        "                write_mode=True,\n"
        f"                mamba_local_block_ids=self._reqs_save_mamba.get(req_id, []),{MB_MARK}\n"
        "            )\n",
    ),
    Hunk(
        MB,
        "patch_connector, schedule_write_blocks signature",
        CONN,
        '        remote_ip: str,\n    ) -> None:\n        """Schedule a block write operation.',
        "        remote_ip: str,\n"
        f"        mamba_local_block_ids: list[int] | None = None,{MB_MARK}\n"
        "    ) -> None:\n"
        '        """Schedule a block write operation.',
    ),
    Hunk(
        MB,
        "patch_connector, WriteTask construction",
        CONN,
        "            remote_block_ids_hint=remote_block_ids,\n            layer_name=layer_name,\n",
        "            remote_block_ids_hint=remote_block_ids,\n"
        f"            mamba_local_block_ids=mamba_local_block_ids,{MB_MARK}\n"
        "            layer_name=layer_name,\n",
    ),
    Hunk(
        MB,
        "patch_connector, _write_blocks_for_req schedule_write_blocks call",
        CONN,
        "            remote_notify_port=meta.remote_notify_port,\n"
        "            remote_ip=meta.remote_host,\n"
        "        )\n",
        "            remote_notify_port=meta.remote_notify_port,\n"
        "            remote_ip=meta.remote_host,\n"
        f"            mamba_local_block_ids=meta.mamba_local_block_ids,{MB_MARK}\n"
        "        )\n",
    ),
]


def _mamba_blockids(comments: bool, debug: bool) -> list[Hunk]:
    plan = "patch_engine, hunk 3 (_prepare_transfer_plan)"
    if comments:
        plan += ", with the four comment lines under `if _k3_mamba:`"
    if not debug:
        plan += ", without the K3_MAMBA_BC block"
    return [
        *_MB_COMMON,
        Hunk(MB, "patch_engine, hunk 1 (notify list)", ENGINE, _MB_NOTIFY_OLD, _MB_NOTIFY_NEW),
        Hunk(MB, "patch_engine, hunk 2 (RemoteAllocInfo)", ENGINE, _MB_ALLOC_OLD, _MB_ALLOC_NEW),
        Hunk(MB, plan, ENGINE, _MB_PLAN_OLD, _mb_plan(comments, debug)),
        *_MB_CONNECTOR,
    ]


# As the stored script writes it: with the K3_MAMBA_BC debug block, without the comment lines.
step("mamba_blockids", _mamba_blockids(comments=False, debug=True))
# The version group_routing's anchors were written against: the four comment lines too.
step("mamba_blockids_comments", _mamba_blockids(comments=True, debug=True))
step("mamba_blockids_nodebug", _mamba_blockids(comments=False, debug=False))


# --------------------------------------------------------------------------------------------
# group_routing: every group's block ids end to end, the plan indexing them by the layer's group
# (with the two-group choice as its fallback). Its anchors are the ones the script checks; the
# builder fails loudly if one is missing, as the script (two-pass) would then write nothing.

_GR_PLAN_OLD = (
    f"            from vllm.v1.kv_cache_interface import MambaSpec as _K3MS_BL{MB_MARK}\n"
    "            _k3_mamba = isinstance(\n"
    "                self.worker.layer_to_spec.get(task.layer_name), _K3MS_BL\n"
    "            )\n"
    "            if _k3_mamba:\n"
    + _MB_PLAN_COMMENTS
    + "                _k3_local = task.mamba_local_block_ids or task.local_block_ids\n"
    "                _k3_remote = request_info.mamba_block_ids or request_info.block_ids\n"
    "            else:\n"
    "                _k3_local = task.local_block_ids\n"
    "                _k3_remote = request_info.block_ids\n"
)
_GR_PLAN_NEW = (
    f"            from vllm.v1.kv_cache_interface import MambaSpec as _K3MS_BL{MB_MARK}\n"
    "            # k3-group-routing: the layer's own group when every group's ids travelled,\n"
    "            # the two-group choice otherwise.\n"
    '            _k3_gr_local = getattr(task, "all_group_block_ids", None)\n'
    '            _k3_gr_remote = getattr(request_info, "all_group_block_ids", None)\n'
    '            _k3_gr_on = getattr(self.worker, "_k3_group_routing", False)\n'
    "            if (\n"
    "                _k3_gr_on\n"
    "                and _k3_gr_local is not None\n"
    "                and _k3_gr_remote is not None\n"
    "            ):\n"
    "                _k3_gi = self.worker._layer_group_idx.get(\n"
    "                    task.layer_name, self.worker._attn_group_idx\n"
    "                )\n"
    "                if _k3_gi < len(_k3_gr_local) and _k3_gi < len(_k3_gr_remote):\n"
    "                    _k3_local = _k3_gr_local[_k3_gi]\n"
    "                    _k3_remote = _k3_gr_remote[_k3_gi]\n"
    "                else:\n"
    "                    _k3_local = task.local_block_ids\n"
    "                    _k3_remote = request_info.block_ids\n"
    "            elif isinstance(\n"
    "                self.worker.layer_to_spec.get(task.layer_name), _K3MS_BL\n"
    "            ):\n"
    "                # two-group fallback\n"
    "                _k3_local = task.mamba_local_block_ids or task.local_block_ids\n"
    "                _k3_remote = request_info.mamba_block_ids or request_info.block_ids\n"
    "            else:\n"
    "                _k3_local = task.local_block_ids\n"
    "                _k3_remote = request_info.block_ids\n"
)

_GR_WORKER_MAP = (
    "        # k3-group-routing: each layer's group index, and the first group that is not\n"
    "        # Mamba as the attention group; any failure falls back to group 0.\n"
    "        self._layer_group_idx: dict[str, int] = {}\n"
    "        self._attn_group_idx = 0\n"
    "        try:\n"
    "            from vllm.v1.kv_cache_interface import MambaSpec as _K3GR_Mamba\n"
    '            _k3gr_groups = getattr(kv_cache_config, "kv_cache_groups", []) or []\n'
    "            for _k3gr_gi, _k3gr_grp in enumerate(_k3gr_groups):\n"
    '                for _k3gr_ln in getattr(_k3gr_grp, "layer_names", []) or []:\n'
    "                    self._layer_group_idx[_k3gr_ln] = _k3gr_gi\n"
    "            for _k3gr_gi, _k3gr_grp in enumerate(_k3gr_groups):\n"
    '                _k3gr_lns = getattr(_k3gr_grp, "layer_names", []) or []\n'
    "                if _k3gr_lns and not isinstance(\n"
    "                    self.layer_to_spec.get(_k3gr_lns[0]), _K3GR_Mamba\n"
    "                ):\n"
    "                    self._attn_group_idx = _k3gr_gi\n"
    "                    break\n"
    "        except Exception:\n"
    "            self._layer_group_idx = {}\n"
    "            self._attn_group_idx = 0\n"
    "        import os as _k3gros\n"
    "        self._k3_group_routing = (\n"
    '            _k3gros.environ.get("K3_GROUP_ROUTING", "1") == "1"\n'
    "        )\n"
    "        logger.info(\n"
    '            "k3-group-routing: on=%s attention group %s of %s",\n'
    "            self._k3_group_routing,\n"
    "            self._attn_group_idx,\n"
    '            len(getattr(kv_cache_config, "kv_cache_groups", []) or []),\n'
    "        )\n"
)


def _gr(tag: str, file: str, old: str, added: str, *, before: str = "") -> Hunk:
    """A group_routing hunk that adds `added` after `old` minus its trailing `before`."""
    assert old.endswith(before)
    head = old[: len(old) - len(before)]
    return Hunk(GR, tag, file, old, head + added + before)


_LAYER_TO_SPEC = "        self.layer_to_spec = build_layer_to_spec(kv_cache_config)\n"

step(
    "group_routing",
    [
        _gr(
            "C1 WriteTask field",
            COMMON,
            f"    mamba_local_block_ids: list[int] | None = None{MB_MARK}\n"
            "    enqueue_time: float = field(default_factory=time.perf_counter)\n",
            f"    all_group_block_ids: list[list[int]] | None = None{GR_MARK}\n",
            before="    enqueue_time: float = field(default_factory=time.perf_counter)\n",
        ),
        _gr(
            "C2 RemoteAllocInfo field",
            COMMON,
            f"    mamba_block_ids: list[int] | None = None{MB_MARK}\n    writes_done: int = 0\n",
            f"    all_group_block_ids: list[list[int]] | None = None{GR_MARK}\n",
            before="    writes_done: int = 0\n",
        ),
        _gr(
            "C3 ReqMeta field",
            COMMON,
            "    # k3-mamba-blockids: mamba KV-group [1] local slot id(s) for this req.\n"
            "    mamba_local_block_ids: list[int] = field(default_factory=list)\n",
            "    # k3-group-routing: every group's local block ids, by group index\n"
            "    all_group_block_ids: list[list[int]] | None = None\n",
        ),
        _gr(
            "C4 add_new_req signature",
            COMMON,
            "        write_mode=False,\n"
            f"        mamba_local_block_ids: list[int] | None = None,{MB_MARK}\n"
            "    ):\n",
            f"        all_group_block_ids: list[list[int]] | None = None,{GR_MARK}\n",
            before="    ):\n",
        ),
        _gr(
            "C5 add_new_req set field",
            COMMON,
            f"        _req.mamba_local_block_ids = list(mamba_local_block_ids or []){MB_MARK}\n"
            "        if write_mode:\n",
            f"        _req.all_group_block_ids = ({GR_MARK}\n"
            "            [list(g) for g in all_group_block_ids]\n"
            "            if all_group_block_ids is not None else None\n"
            "        )\n",
            before="        if write_mode:\n",
        ),
        _gr(
            "N3 scheduler init dict",
            CONN,
            f"        self._reqs_save_mamba: dict[ReqId, list[int]] = {{}}{MB_MARK}\n",
            f"        self._reqs_save_allgrp: dict[ReqId, list[list[int]]] = {{}}{GR_MARK}\n",
        ),
        _gr(
            "N6 send_notify_block signature",
            CONN,
            f"        mamba_block_notify_list: list[int] | None = None,{MB_MARK}\n"
            "    ):\n"
            '        path = make_zmq_path("tcp", host, port)\n',
            f"        all_group_block_notify: list[list[int]] | None = None,{GR_MARK}\n",
            before='    ):\n        path = make_zmq_path("tcp", host, port)\n',
        ),
        _gr(
            "N7 send_notify_block wire dict",
            CONN,
            f'            "mamba_block_notify_list": mamba_block_notify_list or [],{MB_MARK}\n',
            f'            "all_group_block_notify": all_group_block_notify or [],{GR_MARK}\n',
        ),
        _gr(
            "N2 scheduler producer-save capture",
            CONN,
            f"            self._reqs_save_mamba[request.request_id] = ({MB_MARK}\n"
            "                list(_k3_gbi[1]) if len(_k3_gbi) > 1 else []\n"
            "            )\n"
            "            self._reqs_need_save[request.request_id] = (request, local_block_ids)\n",
            f"            self._reqs_save_allgrp[request.request_id] = [{GR_MARK}\n"
            "                list(g) for g in _k3_gbi\n"
            "            ]\n",
            before="            self._reqs_need_save[request.request_id] = "
            "(request, local_block_ids)\n",
        ),
        _gr(
            "N4 scheduler decode-advertise compute",
            CONN,
            "                    mamba_block_notify_list = (\n"
            "                        (list(_k3_gbi_d[1]) if len(_k3_gbi_d) > 1 else [])\n"
            "                        if num_external_tokens > 0 else []\n"
            "                    )\n",
            f"                    all_group_block_notify = ({GR_MARK}\n"
            "                        [list(g) for g in _k3_gbi_d]\n"
            "                        if num_external_tokens > 0 else []\n"
            "                    )\n",
        ),
        _gr(
            "N5 scheduler send_notify_block call",
            CONN,
            "                            port=target_port,\n"
            "                            mamba_block_notify_list=mamba_block_notify_list,"
            f"{MB_MARK}\n"
            "                        )\n",
            "                            all_group_block_notify=all_group_block_notify,"
            f"{GR_MARK}\n",
            before="                        )\n",
        ),
        _gr(
            "N8 build_connector_meta add_new_req (pending final chunk)",
            CONN,
            "                            write_mode=True,\n"
            "                            mamba_local_block_ids="
            f"self._reqs_save_mamba.get(req_id, []),{MB_MARK}\n"
            "                        )\n",
            "                            all_group_block_ids="
            "self._reqs_save_allgrp.get(req_id, None)"
            f",{GR_MARK}\n",
            before="                        )\n",
        ),
        _gr(
            "N9 build_connector_meta add_new_req (direct save)",
            CONN,
            "                write_mode=True,\n"
            "                mamba_local_block_ids="
            f"self._reqs_save_mamba.get(req_id, []),{MB_MARK}\n"
            "            )\n",
            "                all_group_block_ids=self._reqs_save_allgrp.get(req_id, None),"
            f"{GR_MARK}\n",
            before="            )\n",
        ),
        _gr(
            "N11 schedule_write_blocks signature",
            CONN,
            f"        mamba_local_block_ids: list[int] | None = None,{MB_MARK}\n"
            "    ) -> None:\n"
            '        """Schedule a block write operation.\n',
            f"        all_group_block_ids: list[list[int]] | None = None,{GR_MARK}\n",
            before='    ) -> None:\n        """Schedule a block write operation.\n',
        ),
        _gr(
            "N12 WriteTask construction",
            CONN,
            "            remote_block_ids_hint=remote_block_ids,\n"
            f"            mamba_local_block_ids=mamba_local_block_ids,{MB_MARK}\n"
            "            layer_name=layer_name,\n",
            f"            all_group_block_ids=all_group_block_ids,{GR_MARK}\n",
            before="            layer_name=layer_name,\n",
        ),
        _gr(
            "N10 _write_blocks_for_req schedule_write_blocks call",
            CONN,
            "            remote_ip=meta.remote_host,\n"
            f"            mamba_local_block_ids=meta.mamba_local_block_ids,{MB_MARK}\n"
            "        )\n",
            f"            all_group_block_ids=meta.all_group_block_ids,{GR_MARK}\n",
            before="        )\n",
        ),
        _gr("N1 worker __init__ compute group indices", CONN, _LAYER_TO_SPEC, _GR_WORKER_MAP),
        _gr(
            "E1 _handle_remote_blocks_message capture",
            ENGINE,
            f'        mamba_block_notify_list = data.get("mamba_block_notify_list", []){MB_MARK}\n'
            '        decode_dp_rank = data.get("decode_rank", 0)\n',
            f'        all_group_block_notify = data.get("all_group_block_notify", []){GR_MARK}\n',
            before='        decode_dp_rank = data.get("decode_rank", 0)\n',
        ),
        _gr(
            "E2 RemoteAllocInfo construction",
            ENGINE,
            f"                mamba_block_ids=list(mamba_block_notify_list or []),{MB_MARK}\n"
            "            )\n",
            f"                all_group_block_ids=({GR_MARK}\n"
            "                    [list(g) for g in all_group_block_notify]\n"
            "                    if all_group_block_notify else None\n"
            "                ),\n",
            before="            )\n",
        ),
        Hunk(GR, "E3 _prepare_transfer_plan group routing", ENGINE, _GR_PLAN_OLD, _GR_PLAN_NEW),
    ],
)


# --------------------------------------------------------------------------------------------
# chunked_allgrp: the all-group lists grow with every prefill chunk's new blocks (G1's loop).

_CA_OLD = (
    "                if new_block_ids is not None:\n"
    "                    block_ids = new_block_ids[0]\n"
)
_CA_NEW = _CA_OLD + (
    "                    # k3-chunked-allgrp: each chunk's new blocks join their group's list,\n"
    "                    # so the final save carries every chunk (new_block_ids is per group).\n"
    "                    try:\n"
    "                        if req_id in getattr(self, '_reqs_save_allgrp', {}):\n"
    "                            _k3ca_cur = self._reqs_save_allgrp[req_id]\n"
    "                            _k3ca_new = []\n"
    "                            for _k3ca_gi in range(len(_k3ca_cur)):\n"
    "                                _k3ca_add = (\n"
    "                                    list(new_block_ids[_k3ca_gi])\n"
    "                                    if _k3ca_gi < len(new_block_ids) else []\n"
    "                                )\n"
    "                                _k3ca_new.append(\n"
    "                                    list(_k3ca_cur[_k3ca_gi]) + _k3ca_add\n"
    "                                )\n"
    "                            self._reqs_save_allgrp[req_id] = _k3ca_new\n"
    "                            if req_id in getattr(self, '_reqs_save_mamba', {}) and len(_k3ca_new) > 1:\n"  # noqa: E501
    "                                # the mamba list is left as it is\n"
    "                                pass\n"
    "                    except Exception:\n"
    "                        pass\n"
)
step("chunked_allgrp", [Hunk(CA, "OLD -> NEW (G1 loop)", CONN, _CA_OLD, _CA_NEW)])


# --------------------------------------------------------------------------------------------
# xfer_probe (K3_XFER_PROBE=1): the two of its four written edits that land in functions k3patch
# reads. Its MLA-offsets and Triton MLA decode edits (not read) are left out.

_XP_GBI_OLD = (
    f"                    _k3_gbi_d = blocks.get_block_ids(){MB_MARK}\n"
    "                    block_notify_list = (\n"
)
_XP_GBI_NEW = (
    f"                    _k3_gbi_d = blocks.get_block_ids(){MB_MARK}\n"
    "                    import os as _k3gp_os  # k3-xfer-probe\n"
    "                    if _k3gp_os.environ.get('K3_XFER_PROBE', '0') == '1':\n"
    "                        try:\n"
    "                            logger.warning(\n"
    '                                "k3-xfer-probe GBI: %d groups, first ids %s, %d external",\n'
    "                                len(_k3_gbi_d),\n"
    "                                [list(g)[:6] for g in _k3_gbi_d[:2]],\n"
    "                                int(num_external_tokens),\n"
    "                            )\n"
    "                        except Exception as _k3gp_e:\n"
    '                            logger.warning("k3-xfer-probe GBI failed: %s", _k3gp_e)\n'
    "                    block_notify_list = (\n"
)
_XP_GROUPS_NEW = (
    "        import os as _k3grp_os  # k3-xfer-probe\n"
    "        if _k3grp_os.environ.get('K3_XFER_PROBE', '0') == '1':\n"
    "            try:\n"
    "                for _gi, _g in enumerate(kv_cache_config.kv_cache_groups):\n"
    "                    _sp = _g.kv_cache_spec\n"
    "                    _lns = list(getattr(_g, 'layer_names', []) or [])\n"
    "                    logger.warning(\n"
    '                        "k3-xfer-probe GROUP %d: %s, %d layers, first %s",\n'
    "                        _gi,\n"
    "                        type(_sp).__name__,\n"
    "                        len(_lns),\n"
    "                        _lns[:4],\n"
    "                    )\n"
    "            except Exception as _k3grp_e:\n"
    '                logger.warning("k3-xfer-probe GROUP failed: %s", _k3grp_e)\n'
)
step(
    "xfer_probe",
    [
        Hunk(XP, "GBI_OLD -> GBI_NEW (uSAA decode advertise)", CONN, _XP_GBI_OLD, _XP_GBI_NEW),
        Hunk(
            XP,
            "GD_OLD -> GD_NEW (worker __init__ group dump)",
            CONN,
            _LAYER_TO_SPEC,
            _LAYER_TO_SPEC + _XP_GROUPS_NEW,
        ),
    ],
)
