"""moriio-group-routing's wrong fixes: forms.py's texts are what apply writes and what it reads
back (the transfer plan and the inserted statements as patterns, the function by fingerprint)."""

from __future__ import annotations

from .common import FIRST, ISSUE_28, ROUTING, ROUTING_DECL, ROUTING_FORMS, Sub, Variant

PLAN_ARGS = "        _k3patch_local[_k3patch_group],\n        _k3patch_remote[_k3patch_group],\n"
CACHE_KEY = "geometry_key = (_k3patch_group, *_get_write_geometry_key(layer_cache))"
GROWTH = "_k3patch_group + list(_k3patch_added)"
LAYER_GROUP = "            group_of_layer[layer_name] = index\n"
# SAVE_GROUPS's two loops: each chunk's new blocks join their lists, then each save takes them.
GROW_LOOP = """\
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
"""
# The resume branch (issue 28 item 5's fix): without it, k3patch's earlier form's behaviour.
RESUME_BRANCH = GROW_LOOP[
    GROW_LOOP.index("        if _k3patch_req_id in") : GROW_LOOP.index(
        "        self._k3patch_save_groups[_k3patch_req_id] = [\n            _k3patch_group"
    )
]
ATTACH_LOOP = """\
    for _k3patch_req_id, _k3patch_meta in meta.reqs_to_save.items():
        _k3patch_meta.k3patch_group_block_ids = self._k3patch_save_groups.pop(
            _k3patch_req_id, None
        )
"""


def _routing(
    id: str,
    what: str,
    *subs: Sub,
    trees: tuple[str, ...] = ("fork-a",),
    eq: str = "",
    written: str = FIRST,
) -> Variant:
    return Variant(id, ROUTING, what, subs, trees, eq, written)


def _new(id: str, what: str, *subs: Sub, trees: tuple[str, ...] = ("fork-a",)) -> Variant:
    return _routing(id, what, *subs, trees=trees, written=ISSUE_28)


VARIANTS: tuple[Variant, ...] = (
    _routing(
        "routing-index-0",
        "the transfer plan indexes the group lists with [0] for every layer",
        Sub(ROUTING_FORMS, PLAN_ARGS, "        _k3patch_local[0],\n        _k3patch_remote[0],\n"),
    ),
    _routing(
        "routing-attention-first-group",
        "the attention group is the first group, Mamba or not",
        Sub(
            ROUTING_FORMS,
            "if attention_group is None and not isinstance(group.kv_cache_spec, MambaSpec):",
            "if attention_group is None:",
        ),
    ),
    _routing(
        "routing-cache-by-geometry",
        "the offsets cache keyed by tensor geometry alone (0.28.0's key)",
        Sub(ROUTING_FORMS, CACHE_KEY, "geometry_key = _get_write_geometry_key(layer_cache)"),
        trees=("fork-a", "fork-d"),
    ),
    _routing(
        "routing-cache-by-layer-only",
        "the offsets cache keyed by the layer name alone",
        Sub(ROUTING_FORMS, CACHE_KEY, "geometry_key = (task.layer_name,)"),
        eq="the cache lives in one request's RemoteAllocInfo, and a layer's KV cache tensor "
        "(its geometry) is allocated once per process: within a request a layer has one "
        "geometry, so the layer name alone keys the same entries",
    ),
    _routing(
        "routing-entry-not-removed",
        "the per-request group lists read, not removed, when their save leaves (`pop` -> `get`)",
        Sub(
            ROUTING_FORMS,
            "self._k3patch_save_groups.pop(\n            _k3patch_req_id, None",
            "self._k3patch_save_groups.get(\n            _k3patch_req_id, None",
        ),
    ),
    _routing(
        "routing-first-chunk-only",
        "the group lists never grow after the first chunk (later chunks' blocks dropped)",
        Sub(ROUTING_FORMS, GROWTH, "_k3patch_group"),
        trees=("fork-a", "fork-c"),
    ),
    _routing(
        "routing-growth-prepended",
        "a later chunk's blocks put before the earlier ones",
        Sub(ROUTING_FORMS, GROWTH, "list(_k3patch_added) + _k3patch_group"),
    ),
    _routing(
        "routing-no-saves-inverted",
        "`if self._k3patch_save_groups:` inverted (the lists never reach the metadata)",
        Sub(
            ROUTING_FORMS, "if self._k3patch_save_groups:\n", "if not self._k3patch_save_groups:\n"
        ),
    ),
    _routing(
        "routing-notify-without-external",
        "decode notify sends the group lists also with `num_external_tokens == 0` (`>` -> `>=`)",
        Sub(
            ROUTING_FORMS,
            "_k3_gbi_d] if num_external_tokens > 0 else []",
            "_k3_gbi_d] if num_external_tokens >= 0 else []",
        ),
    ),
    _routing(
        "routing-notify-first-group",
        "decode notify sends only the first group's blocks",
        Sub(
            ROUTING_FORMS,
            "[list(_k3patch_g) for _k3patch_g in _k3_gbi_d]",
            "[list(_k3patch_g) for _k3patch_g in _k3_gbi_d[:1]]",
        ),
    ),
    _routing(
        "routing-capture-two-groups",
        "the prefill capture keeps two groups, as the fork did (`_k3_gbi[:2]`)",
        Sub(
            ROUTING_FORMS,
            "    list(_k3patch_g) for _k3patch_g in _k3_gbi\n]",
            "    list(_k3patch_g) for _k3patch_g in _k3_gbi[:2]\n]",
        ),
    ),
    _routing(
        "routing-write-task-none",
        "the metadata's group lists not handed to schedule_write_blocks (None passed)",
        Sub(ROUTING_DECL, 'f"{FIELD_NAME}=meta.{FIELD_NAME}"', 'f"{FIELD_NAME}=None"'),
    ),
    _routing(
        "routing-peer-check-and",
        "the missing-peer check `or` -> `and` (a one-sided peer fails later, not by MoRIIOError)",
        Sub(
            ROUTING_FORMS,
            "if _k3patch_local is None or _k3patch_remote is None:",
            "if _k3patch_local is None and _k3patch_remote is None:",
        ),
    ),
    # ---- issue 28: written before its probes were extended.
    _new(
        "routing-growth-first-request",
        "the per-chunk growth reads the first cached request's new blocks (`new_block_ids[0]`) "
        "for every request of the step",
        Sub(
            ROUTING_FORMS,
            "_k3patch_cached.new_block_ids[_k3patch_index]",
            "_k3patch_cached.new_block_ids[0]",
        ),
    ),
    _new(
        "routing-growth-group0-for-all",
        "the per-chunk growth appends group 0's new blocks to every group's list",
        Sub(ROUTING_FORMS, GROWTH, "_k3patch_group + list(_k3patch_new[0])"),
    ),
    _new(
        "routing-growth-replaces",
        "a later chunk's blocks replace the lists instead of joining them (only the last "
        "chunk's blocks travel)",
        Sub(ROUTING_FORMS, GROWTH, "list(_k3patch_added)"),
    ),
    _new(
        "routing-growth-deduped-sorted",
        "the grown lists deduplicated and sorted (`sorted(set(...))`): block order is the "
        "token order, so positions no longer pair local with remote blocks",
        Sub(ROUTING_FORMS, GROWTH, f"sorted(set({GROWTH}))"),
    ),
    _new(
        "routing-growth-by-tracked-position",
        "the growth walks the tracked requests and takes `new_block_ids` by their position: a "
        "tracked request that sits out a step (or an untracked one in it) shifts every later "
        "request onto another's blocks",
        Sub(
            ROUTING_FORMS,
            "enumerate(_k3patch_cached.req_ids):",
            "enumerate(list(self._k3patch_save_groups)):",
        ),
    ),
    _new(
        "routing-save-before-growth",
        "each save takes its lists before this step's new blocks join them: the final chunk's "
        "blocks never travel",
        Sub(ROUTING_FORMS, GROW_LOOP + ATTACH_LOOP, ATTACH_LOOP + GROW_LOOP),
    ),
    _new(
        "routing-resume-appends",
        "k3patch's earlier growth: a request resumed after preemption gets its new_block_ids "
        "(all its blocks) joined to the lists captured again at resumption, so every block is "
        "sent twice",
        Sub(ROUTING_FORMS, RESUME_BRANCH, ""),
    ),
    _new(
        "routing-offsets-per-worker",
        "the offsets cache kept on the worker (keyed by layer and geometry), not per request: "
        "every later request writes with the first request's block offsets",
        Sub(
            ROUTING_FORMS,
            CACHE_KEY + "\noffsets = request_info.transfer_offsets.get(geometry_key)\n",
            CACHE_KEY + '\noffsets = self.worker.__dict__.setdefault("_k3patch_offsets", {})'
            ".get(geometry_key)\n",
        ),
        Sub(
            ROUTING_FORMS,
            "        remote_moriio_meta,\n    )\n    request_info.transfer_offsets[geometry_key]",
            "        remote_moriio_meta,\n    )\n    self.worker._k3patch_offsets[geometry_key]",
        ),
    ),
    _new(
        "routing-plan-args-swapped",
        "the plan passes the remote list where the local one goes and back",
        Sub(
            ROUTING_FORMS,
            PLAN_ARGS,
            "        _k3patch_remote[_k3patch_group],\n        _k3patch_local[_k3patch_group],\n",
        ),
    ),
    _new(
        "routing-remote-is-local",
        "copy-paste: the remote lists read from the task (`task.k3patch_group_block_ids`): the "
        "prefill node writes into its own block ids on the decode node",
        Sub(
            ROUTING_FORMS,
            "_k3patch_remote = request_info.k3patch_group_block_ids",
            "_k3patch_remote = task.k3patch_group_block_ids",
        ),
    ),
    _new(
        "routing-capture-group0-everywhere",
        "the prefill capture copies group 0's blocks for every group (`list(_k3_gbi[0]) for "
        "_k3patch_g in _k3_gbi`)",
        Sub(
            ROUTING_FORMS,
            "    list(_k3patch_g) for _k3patch_g in _k3_gbi\n]",
            "    list(_k3_gbi[0]) for _k3patch_g in _k3_gbi\n]",
        ),
    ),
    _new(
        "routing-notify-attention-first",
        "the decode node sends its lists attention group first (READ mode's payload order): "
        "group g's remote list is another group's",
        Sub(
            ROUTING_FORMS,
            "[list(_k3patch_g) for _k3patch_g in _k3_gbi_d]",
            "[list(_k3patch_g) for _k3patch_g in [*_k3_gbi_d[-1:], *_k3_gbi_d[:-1]]]",
        ),
    ),
    _new(
        "routing-attention-assumed-last",
        "the layer map puts every non-Mamba layer in the last group (K3's order): a layout "
        "whose attention group is not last writes attention KV into another group's blocks",
        Sub(
            ROUTING_FORMS,
            LAYER_GROUP,
            "            group_of_layer[layer_name] = (\n"
            "                index\n"
            "                if isinstance(group.kv_cache_spec, MambaSpec)\n"
            "                else len(kv_cache_config.kv_cache_groups) - 1\n"
            "            )\n",
        ),
    ),
    _new(
        "routing-kda-groups-merged",
        'the layer map sends every Mamba (KDA) layer to group 0 ("they share one tensor"): '
        "the second and third KDA groups' KV lands in the first one's blocks",
        Sub(
            ROUTING_FORMS,
            LAYER_GROUP,
            "            group_of_layer[layer_name] = (\n"
            "                0 if isinstance(group.kv_cache_spec, MambaSpec) else index\n"
            "            )\n",
        ),
    ),
)
