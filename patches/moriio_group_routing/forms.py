"""The forms moriio-group-routing knows, as source to hold against SITES.md section 1: k3patch's
post-image piece by piece, the fork's and the older fix's statements it recognises, report words."""

from __future__ import annotations

from k3patch.fingerprints import dedent

FIELD_NAME = "k3patch_group_block_ids"
FIELD = f"{FIELD_NAME}: list[list[int]] | None = None"
FIELD_COMMENT = "# k3patch moriio-group-routing: block ids of every KV-cache group"

SCHEDULER_DICT = """
# k3patch moriio-group-routing: every KV-cache group's blocks per request
self._k3patch_save_groups: dict[str, list[list[int]]] = {}
"""

CAPTURE = """
# k3patch moriio-group-routing: every group's blocks, not only [0]/[1]
self._k3patch_save_groups[request.request_id] = [
    list(_k3patch_g) for _k3patch_g in _k3_gbi
]
"""

NOTIFY = """
# k3patch moriio-group-routing: send every group's blocks
_k3patch_group_notify = (
    [list(_k3patch_g) for _k3patch_g in _k3_gbi_d] if num_external_tokens > 0 else []
)
"""

# Built between `self.layer_to_spec = ...` and `if self.is_producer:`: the probe runs that span.
WORKER_MAP = """
# k3patch moriio-group-routing: each layer's KV-cache group (no position
# is assumed: K3 has three KDA groups before its MLA group)
self._k3patch_group_of_layer, self._k3patch_attention_group = (
    _k3patch_kv_cache_group_index(kv_cache_config)
)
"""

GROUP_INDEX_FUNCTION = '''
def _k3patch_kv_cache_group_index(
    kv_cache_config: "KVCacheConfig",
) -> tuple[dict[str, int], int]:
    """k3patch moriio-group-routing: the KV-cache group of every layer, and the attention group.

    A layer's KV lives in its own group's blocks. Kimi-K3 has three KDA (Mamba) groups before
    its MLA group, so no fixed position is the attention group: it is the first group whose
    spec is not a MambaSpec.
    """
    from vllm.v1.kv_cache_interface import MambaSpec

    group_of_layer: dict[str, int] = {}
    attention_group: int | None = None
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        for layer_name in group.layer_names:
            group_of_layer[layer_name] = index
        if attention_group is None and not isinstance(group.kv_cache_spec, MambaSpec):
            attention_group = index
    if attention_group is None:
        raise ValueError("MoRIIO WRITE needs an attention KV-cache group; all groups are Mamba")
    return group_of_layer, attention_group
'''

# Before build_connector_meta's final `return meta`: moriio-chunk-gate's gates stay untouched.
SAVE_GROUPS = """
# k3patch moriio-group-routing: every KV-cache group's blocks travel with
# the request (K3's MLA group is index 3, not [0]). Blocks a later prefill
# chunk allocates join their group's list; each save leaving in this step
# takes its request's lists along.
if self._k3patch_save_groups:
    _k3patch_cached = scheduler_output.scheduled_cached_reqs
    for _k3patch_index, _k3patch_req_id in enumerate(_k3patch_cached.req_ids):
        _k3patch_new = _k3patch_cached.new_block_ids[_k3patch_index]
        if _k3patch_new is None or _k3patch_req_id not in self._k3patch_save_groups:
            continue
        if _k3patch_req_id in _k3patch_cached.resumed_req_ids:
            # Resumed after preemption: its new_block_ids are all its blocks
            # (vLLM's CachedRequestData), the lists update_state_after_alloc
            # took again this step: they replace, never join, the old lists.
            self._k3patch_save_groups[_k3patch_req_id] = [
                list(_k3patch_added) for _k3patch_added in _k3patch_new
            ]
            continue
        self._k3patch_save_groups[_k3patch_req_id] = [
            _k3patch_group + list(_k3patch_added)
            for _k3patch_group, _k3patch_added in zip(
                self._k3patch_save_groups[_k3patch_req_id], _k3patch_new, strict=True
            )
        ]
    for _k3patch_req_id, _k3patch_meta in meta.reqs_to_save.items():
        _k3patch_meta.k3patch_group_block_ids = self._k3patch_save_groups.pop(
            _k3patch_req_id, None
        )
"""


# k3patch's earlier SAVE_GROUPS (every release before the resume fix: the per-layer plan's and
# the first per-group plan's): a resumed request's new_block_ids (all its blocks) joined the
# lists update_state_after_alloc had just captured again, so its lists carried its blocks twice.
# It reads pending and apply replaces it in place.
def _resume_appends(text: str) -> str:
    """`text` (SAVE_GROUPS) as k3patch wrote it before: no resume branch, the growth nested
    under `if _k3patch_new is not None and ...`. Derived, so each piece of the form is written
    once in this file (the mutation rows substitute them by their text); a text without those
    pieces (a mutant's) is its own earlier form, which then never matches where it does not."""
    lines = text.splitlines(keepends=True)
    heads = [i for i, line in enumerate(lines) if line.startswith("        if _k3patch_new is")]
    attach = [i for i, line in enumerate(lines) if line.startswith("    for _k3patch_req_id,")]
    if len(heads) != 1 or len(attach) != 1 or heads[0] + 2 > attach[0]:
        return text
    grow = heads[0] + 2  # after the `continue`; then the resume branch, if there is one
    if lines[grow].startswith("        if _k3patch_req_id in _k3patch_cached.resumed_req_ids"):
        grow += 1
        while grow < attach[0] and lines[grow].startswith(" " * 12):
            grow += 1
    test = lines[heads[0]].replace(" is None or ", " is not None and ")
    test = test.replace(" not in self.", " in self.")
    nested = ["    " + line for line in lines[grow : attach[0]]]
    return "".join([*lines[: heads[0]], test, *nested, *lines[attach[0] :]])


SAVE_GROUPS_RESUME_APPENDS = _resume_appends(SAVE_GROUPS)
RESUME_APPENDS_SHAPE = "k3patch's earlier form: resumed requests' blocks sent twice"
RESUME_APPENDS_DEFECT = (
    "k3patch's earlier form: resumed requests' blocks sent twice (a request resumed after "
    "preemption gets its whole block list as new blocks, appended to the lists captured again "
    "at its resumption, so the decode node receives every block of the request twice); apply "
    "replaces it in place"
)

K3PATCH_PLAN = """
# k3patch moriio-group-routing: each layer's KV goes to its own KV-cache
# group's blocks on both nodes (K3: KDA groups 0-2, MLA group 3). Offsets
# are cached per group and tensor geometry: K3's KDA groups share one
# geometry but not their block ids. Without per-group ids (a peer that
# lacks this fix) the write fails, never guesses.
_k3patch_local = task.k3patch_group_block_ids
_k3patch_remote = request_info.k3patch_group_block_ids
if _k3patch_local is None or _k3patch_remote is None:
    raise MoRIIOError(
        f"MoRIIO transfer {task.transfer_id}: no per-group block ids from "
        + ("the prefill scheduler" if _k3patch_local is None else "the decode node")
        + "; both nodes need k3patch moriio-group-routing"
    )
_k3patch_group = self.worker._k3patch_group_of_layer[task.layer_name]
geometry_key = (_k3patch_group, *_get_write_geometry_key(layer_cache))
offsets = request_info.transfer_offsets.get(geometry_key)
if offsets is None:
    offsets = self.worker._compute_block_transfer_offsets(
        task.layer_name,
        _k3patch_local[_k3patch_group],
        _k3patch_remote[_k3patch_group],
        remote_moriio_meta,
    )
    request_info.transfer_offsets[geometry_key] = offsets
"""

# k3patch's first plan, on operators' trees, cached offsets per layer: the same transfers (they
# follow from the group's block ids and spec and the tensor's geometry); reads applied.
PER_LAYER_PLAN = K3PATCH_PLAN.replace("(_k3patch_group, *", "(task.layer_name, *")
PER_LAYER_NOTE = "k3patch's first plan: offsets cached per layer (the same transfers, more work)"

# The fork's statements (apply_kimik3_moriio_mamba_blockids.py on 0.28.0) k3patch anchors on.
FORK_FIELDS = {
    "WriteTask": "mamba_local_block_ids: list[int] | None = None",
    "RemoteAllocInfo": "mamba_block_ids: list[int] | None = None",
    "ReqMeta": "mamba_local_block_ids: list[int] = field(default_factory=list)",
}
SCHEDULER_DICT_ANCHOR = ("self._reqs_save_mamba: HOLE_type = {}", "self._reqs_save_mamba = {}")
FORK_CAPTURE = (
    "self._reqs_save_mamba[request.request_id] = list(_k3_gbi[1]) if len(_k3_gbi) > 1 else []"
)
FORK_NOTIFY = (
    "mamba_block_notify_list = ((list(_k3_gbi_d[1]) if len(_k3_gbi_d) > 1 else [])"
    " if num_external_tokens > 0 else [])"
)
LAYER_TO_SPEC = "self.layer_to_spec = build_layer_to_spec(kv_cache_config)"
FORK_KEYWORDS = {  # by callee
    "send_notify_block": "mamba_block_notify_list=mamba_block_notify_list",
    "WriteTask": "mamba_local_block_ids=mamba_local_block_ids",
    "schedule_write_blocks": "mamba_local_block_ids=meta.mamba_local_block_ids",
    "RemoteAllocInfo": "mamba_block_ids=list(mamba_block_notify_list or [])",
}

# The transfer plan's region: only the choice under `if offsets is None:` differs, the fork's or
# the older fix's (apply_kimik3_moriio_group_routing.py). `debug`: the K3_MAMBA_BC block.
PLAN = """
geometry_key = _get_write_geometry_key(layer_cache)
offsets = request_info.transfer_offsets.get(geometry_key)
if offsets is None:
{choice}{debug}    offsets = self.worker._compute_block_transfer_offsets(
        task.layer_name, _k3_local, _k3_remote, remote_moriio_meta
    )
    request_info.transfer_offsets[geometry_key] = offsets
"""
FORK_CHOICE = """
    from vllm.v1.kv_cache_interface import MambaSpec as _K3MS_BL
    _k3_mamba = isinstance(self.worker.layer_to_spec.get(task.layer_name), _K3MS_BL)
    if _k3_mamba:
        _k3_local = task.mamba_local_block_ids or task.local_block_ids
        _k3_remote = request_info.mamba_block_ids or request_info.block_ids
    else:
        _k3_local = task.local_block_ids
        _k3_remote = request_info.block_ids
"""
LEGACY_CHOICE = """
    from vllm.v1.kv_cache_interface import MambaSpec as _K3MS_BL
    _k3_gr_local = getattr(task, "all_group_block_ids", None)
    _k3_gr_remote = getattr(request_info, "all_group_block_ids", None)
    _k3_gr_on = getattr(self.worker, "_k3_group_routing", False)
    if _k3_gr_on and _k3_gr_local is not None and _k3_gr_remote is not None:
        _k3_gi = self.worker._layer_group_idx.get(task.layer_name, self.worker._attn_group_idx)
        if _k3_gi < len(_k3_gr_local) and _k3_gi < len(_k3_gr_remote):
            _k3_local = _k3_gr_local[_k3_gi]
            _k3_remote = _k3_gr_remote[_k3_gi]
        else:
            _k3_local = task.local_block_ids
            _k3_remote = request_info.block_ids
    elif isinstance(self.worker.layer_to_spec.get(task.layer_name), _K3MS_BL):
        _k3_local = task.mamba_local_block_ids or task.local_block_ids
        _k3_remote = request_info.mamba_block_ids or request_info.block_ids
    else:
        _k3_local = task.local_block_ids
        _k3_remote = request_info.block_ids
"""
DEBUG_TEST = "{alias}.environ.get('K3_MAMBA_BC', '0') == '1'"
DEBUG_HOLES = "    HOLE_debug_import\n    HOLE_debug_gate\n"
PLANS = {
    (kind, debug): dedent(PLAN.format(choice=choice.lstrip("\n"), debug=DEBUG_HOLES * debug))
    for kind, choice in (("fork", FORK_CHOICE), ("legacy", LEGACY_CHOICE))
    for debug in (False, True)
}

# The older fix's capture in update_state_after_alloc (its all-group lists, at the first chunk).
LEGACY_CAPTURE = "self._reqs_save_allgrp[request.request_id] = [list(g) for g in _k3_gbi]"
# Its companion (apply_kimik3_chunked_allgrp.py, build_connector_meta) grows them per chunk.
CHUNKED_ALLGRP = """
try:
    if req_id in getattr(self, '_reqs_save_allgrp', {}):
        _k3ca_cur = self._reqs_save_allgrp[req_id]
        _k3ca_new = []
        for _k3ca_gi in range(len(_k3ca_cur)):
            _k3ca_add = list(new_block_ids[_k3ca_gi]) if _k3ca_gi < len(new_block_ids) else []
            _k3ca_new.append(list(_k3ca_cur[_k3ca_gi]) + _k3ca_add)
        self._reqs_save_allgrp[req_id] = _k3ca_new
        if req_id in getattr(self, '_reqs_save_mamba', {}) and len(_k3ca_new) > 1:
            pass
except Exception:
    pass
"""

FORK_SHAPE = "fork: mamba block ids ([0] attention, [1] mamba)"
LEGACY_SHAPE = "older k3-group-routing fix (legacy, defective)"
LEGACY_CHUNKED_SHAPE = "older k3-group-routing fix + k3-chunked-allgrp (legacy, defective)"

FORK_DEFECT = (
    "the fork routes by [0]/[1] (MLA into group 0's blocks, every KDA group into group 1's) "
    "and caches offsets by tensor geometry alone"
)
GEOMETRY_DEFECT = (
    "it chooses the block ids inside the geometry-keyed offsets cache (`geometry_key = "
    "_get_write_geometry_key(layer_cache)`: shape, stride, dtype), so the offsets of the first "
    "layer of a geometry are reused for every later layer of that geometry in the request; K3's "
    "three KDA groups share one geometry, so it misroutes the 2nd and 3rd KDA groups into the "
    "1st group's blocks"
)
FIRST_CHUNK_DEFECT = (
    "the all-group block lists are captured at the first chunk only; later chunks' block lists "
    "are never sent (its companion apply_kimik3_chunked_allgrp.py, which grows them, is not "
    "applied)"
)
LEGACY_CAVEATS = (
    "its fallbacks are silent (a group map that fails to build is group 0; a task without the "
    "lists takes the two-group choice) and K3_GROUP_ROUTING=0 restores the bug"
)
LEGACY_DEBUG_DEFECT = (
    "its K3_MAMBA_BC block still reads `_k3_mamba`, which the older fix no longer binds (a "
    "NameError with K3_MAMBA_BC=1)"
)
DEBUG_GOES = "the K3_MAMBA_BC debug block that logs that choice goes with it"
