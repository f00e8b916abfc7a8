# ruff: noqa: E501  (rows hold the edits verbatim, one string per line of the tree)
"""moriio-group-routing's attack rows (issue 28; see attack_common.py for the two forms).

VARIANTS are substitutions in forms.py (what apply writes and reads back); TREE_ROWS are the same
wrong fixes made by hand in a tree after apply (status reads every one of them drifted), and
edits of upstream 0.33.0's native routing (satisfied upstream, nothing written by apply).
Duplicates of rows already in moriio_group_routing.py (found after writing): rt-growth-prepend
= routing-growth-prepended, rt-swap-local-remote = routing-plan-args-swapped, rt-remote-is-local
= routing-remote-is-local, rt-notify-without-external = routing-notify-without-external,
rt-state-leak = routing-entry-not-removed; they stay as TREE_ROWS only. Near-duplicates by
effect: routing-att-growth-only-pending ~ routing-save-before-growth, routing-att-two-kinds ~
routing-kda-groups-merged. Measured (benchmarks/ATTACK-28.md): all killed by the probes but
routing-att-key-group (declared equivalent); routing-att-growth-sorted-ids survived until the
probe's request ids stopped sorting in their scheduled order.
"""

from __future__ import annotations

from .attack_common import ATTACK, TreeRow
from .common import ROUTING, ROUTING_FORMS, Sub, Variant

# The key since issue 28 item 4 landed (per group and geometry; the rows were written against the
# per-layer key before it).
CACHE_KEY = "geometry_key = (_k3patch_group, *_get_write_geometry_key(layer_cache))"
GROUP = "_k3patch_group = self.worker._k3patch_group_of_layer[task.layer_name]\n"
ENUM_GROUPS = "    for index, group in enumerate(kv_cache_config.kv_cache_groups):\n"


def _att(id: str, what: str, old: str, new: str, equivalent: str = "") -> Variant:
    return Variant(
        id, ROUTING, what, (Sub(ROUTING_FORMS, old, new),), ("fork-a",), equivalent, ATTACK
    )


VARIANTS: tuple[Variant, ...] = (
    _att(
        "routing-att-growth-only-pending",
        "the growth loop grows only requests still in _reqs_need_pending_save: G1 has already "
        "removed the one whose final chunk is this step, so that chunk's blocks never join",
        "if _k3patch_new is None or _k3patch_req_id not in self._k3patch_save_groups:",
        "if _k3patch_new is None or _k3patch_req_id not in self._reqs_need_pending_save:",
    ),
    _att(
        "routing-att-growth-sorted-ids",
        "the growth loop walks the request ids sorted but reads new_block_ids by that index: "
        "two requests sharing a step swap their new blocks",
        "enumerate(_k3patch_cached.req_ids)",
        "enumerate(sorted(_k3patch_cached.req_ids))",
    ),
    _att(
        "routing-att-key-data-ptr",
        "the offsets cache keyed by the layer tensor (data_ptr) instead of the layer: K3's "
        "same-index KDA layers share one tensor, so groups 1-2 reuse group 0's offsets",
        CACHE_KEY,
        "geometry_key = (layer_cache.data_ptr(), *_get_write_geometry_key(layer_cache))",
    ),
    _att(
        "routing-att-key-group",
        "the offsets cache keyed per layer and geometry (the first post-image, before issue 28 "
        "item 4 keyed it per KV-cache group)",
        CACHE_KEY,
        "geometry_key = (task.layer_name, *_get_write_geometry_key(layer_cache))",
        equivalent="a control: a per-layer key is finer than the group key, each layer computes "
        "its offsets from its own geometry, spec and block ids, which the group key shares among "
        "one group's layers of one geometry (the batch oracle plans the same sends)",
    ),
    _att(
        "routing-att-two-kinds",
        "two kinds instead of per-layer groups: every Mamba layer to the first Mamba group, "
        "attention to the attention group (right for two groups, wrong for K3's three KDA groups)",
        GROUP,
        "from vllm.v1.kv_cache_interface import MambaSpec as _K3PMS\n"
        "_k3patch_group = (\n"
        "    min(g for g in self.worker._k3patch_group_of_layer.values()\n"
        "        if g != self.worker._k3patch_attention_group)\n"
        "    if isinstance(self.worker.layer_to_spec.get(task.layer_name), _K3PMS)\n"
        "    else self.worker._k3patch_attention_group\n"
        ")\n",
    ),
    _att(
        "routing-att-drop-last-group",
        "the capture's range is off by one and drops the last group (K3's MLA group)",
        "    list(_k3patch_g) for _k3patch_g in _k3_gbi\n",
        "    list(_k3_gbi[_k3patch_i]) for _k3patch_i in range(len(_k3_gbi) - 1)\n",
    ),
    _att(
        "routing-att-silent-fallback",
        "'never crash production': without a peer's per-group ids the plan falls back to the "
        "old attention/mamba lists (groups 1-2 silently misrouted), instead of raising",
        "if _k3patch_local is None or _k3patch_remote is None:\n    raise MoRIIOError(\n",
        "if _k3patch_local is None or _k3patch_remote is None:\n"
        "    _k3patch_n = 1 + max(self.worker._k3patch_group_of_layer.values())\n"
        "    _k3patch_local = [task.mamba_local_block_ids or task.local_block_ids] * _k3patch_n\n"
        "    _k3patch_local[self.worker._k3patch_attention_group] = task.local_block_ids\n"
        "    _k3patch_remote = [request_info.mamba_block_ids or request_info.block_ids] * _k3patch_n\n"
        "    _k3patch_remote[self.worker._k3patch_attention_group] = request_info.block_ids\n"
        "if False:\n    raise MoRIIOError(\n",
    ),
    _att(
        "routing-att-map-attention-first",
        "the layer->group map numbered with attention first (as the rest of the connector "
        "assumes): every index shifted against get_block_ids()'s order",
        ENUM_GROUPS,
        "    for index, group in enumerate(\n"
        "        sorted(\n"
        "            kv_cache_config.kv_cache_groups,\n"
        "            key=lambda g: isinstance(g.kv_cache_spec, MambaSpec),\n"
        "        )\n"
        "    ):\n",
    ),
    _att(
        "routing-att-map-one-based",
        "the layer->group map counts groups from 1",
        ENUM_GROUPS,
        "    for index, group in enumerate(kv_cache_config.kv_cache_groups, start=1):\n",
    ),
)

TREE_ROWS: tuple[TreeRow, ...] = (
    TreeRow(
        id="rt-growth-final-lost",
        patch="moriio-group-routing",
        what="grows only requests still pending: G1 already removed the request whose final chunk is this step, so the final chunk's new blocks never join its lists",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                if _k3patch_new is not None and _k3patch_req_id in self._k3patch_save_groups:\n",
                "                if _k3patch_new is not None and _k3patch_req_id in self._reqs_need_pending_save:\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="rt-growth-prepend",
        patch="moriio-group-routing",
        what="per-group blocks in the wrong order: new blocks put before the old; local block i pairs with the wrong decode block",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        _k3patch_group + list(_k3patch_added)\n",
                "                        list(_k3patch_added) + _k3patch_group\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="rt-key-data-ptr",
        patch="moriio-group-routing",
        what="offsets cache keyed by the tensor (data_ptr) instead of the layer: K3's KDA groups share one tensor per layer index, so groups 1-2 reuse group 0's block offsets",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_engine.py",
        edits=(
            (
                "        geometry_key = (task.layer_name, *_get_write_geometry_key(layer_cache))\n",
                "        geometry_key = (layer_cache.data_ptr(), *_get_write_geometry_key(layer_cache))\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="rt-key-group",
        patch="moriio-group-routing",
        what="CONTROL (issue 28 item 4): key by group and geometry; should behave the same",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_engine.py",
        edits=(
            (
                "        geometry_key = (task.layer_name, *_get_write_geometry_key(layer_cache))\n",
                "        geometry_key = (_k3patch_group, *_get_write_geometry_key(layer_cache))\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="rt-two-kinds",
        patch="moriio-group-routing",
        what="two kinds instead of per-layer groups: every Mamba (KDA) layer goes to the first Mamba group, attention to the attention group (right for 2 groups, wrong for K3's 3 KDA groups)",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_engine.py",
        edits=(
            (
                "        _k3patch_group = self.worker._k3patch_group_of_layer[task.layer_name]\n",
                "        from vllm.v1.kv_cache_interface import MambaSpec as _K3PMS\n        _k3patch_group = (\n            min(g for g in self.worker._k3patch_group_of_layer.values() if g != self.worker._k3patch_attention_group)\n            if isinstance(self.worker.layer_to_spec.get(task.layer_name), _K3PMS)\n            else self.worker._k3patch_attention_group\n        )\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="rt-swap-local-remote",
        patch="moriio-group-routing",
        what="local and remote lists passed in swapped order",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_engine.py",
        edits=(
            (
                "                _k3patch_local[_k3patch_group],\n                _k3patch_remote[_k3patch_group],\n",
                "                _k3patch_remote[_k3patch_group],\n                _k3patch_local[_k3patch_group],\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="rt-remote-is-local",
        patch="moriio-group-routing",
        what="'both nodes allocate the same block ids': the producer's own ids used as the decode's",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_engine.py",
        edits=(
            (
                "                _k3patch_remote[_k3patch_group],\n",
                "                _k3patch_local[_k3patch_group],\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="rt-notify-without-external",
        patch="moriio-group-routing",
        what="decode names its blocks also when there are no external tokens (full prefix hit): the producer writes into decode blocks that hold cached KV",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                        [list(_k3patch_g) for _k3patch_g in _k3_gbi_d] if num_external_tokens > 0 else []\n",
                "                        [list(_k3patch_g) for _k3patch_g in _k3_gbi_d]\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="rt-state-leak",
        patch="moriio-group-routing",
        what="get instead of pop: every request's lists stay in the scheduler forever (a leak; a reused request id starts from stale lists)",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "                _k3patch_meta.k3patch_group_block_ids = self._k3patch_save_groups.pop(\n",
                "                _k3patch_meta.k3patch_group_block_ids = self._k3patch_save_groups.get(\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="rt-drop-last-group",
        patch="moriio-group-routing",
        what="off-by-one range drops the last group (K3's MLA group)",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "            self._k3patch_save_groups[request.request_id] = [\n                list(_k3patch_g) for _k3patch_g in _k3_gbi\n            ]\n",
                "            self._k3patch_save_groups[request.request_id] = [\n                list(_k3_gbi[_k3patch_i]) for _k3patch_i in range(len(_k3_gbi) - 1)\n            ]\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="rt-silent-fallback",
        patch="moriio-group-routing",
        what="'never crash production': without per-group ids from a peer, falls back to the old attention/mamba lists (a silent misroute of groups 1-2, the pitfall SITES.md names)",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_engine.py",
        edits=(
            (
                "        if _k3patch_local is None or _k3patch_remote is None:\n            raise MoRIIOError(\n",
                "        if _k3patch_local is None or _k3patch_remote is None:\n            _k3patch_n = 1 + max(self.worker._k3patch_group_of_layer.values())\n            _k3patch_local = [task.mamba_local_block_ids or task.local_block_ids] * _k3patch_n\n            _k3patch_local[self.worker._k3patch_attention_group] = task.local_block_ids\n            _k3patch_remote = [request_info.mamba_block_ids or request_info.block_ids] * _k3patch_n\n            _k3patch_remote[self.worker._k3patch_attention_group] = request_info.block_ids\n        if False:\n            raise MoRIIOError(\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="rt-growth-sorted-ids",
        patch="moriio-group-routing",
        what="iterates the request ids sorted (for determinism) but reads new_block_ids by that index: two requests sharing a step swap their new blocks",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "            for _k3patch_index, _k3patch_req_id in enumerate(_k3patch_cached.req_ids):\n",
                "            for _k3patch_index, _k3patch_req_id in enumerate(sorted(_k3patch_cached.req_ids)):\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="r-helper-attn-first",
        patch="moriio-group-routing",
        what="the group map numbered with attention first (as the rest of the connector assumes): every layer's index is shifted against get_block_ids()'s order",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "    for index, group in enumerate(kv_cache_config.kv_cache_groups):\n",
                "    for index, group in enumerate(\n        sorted(kv_cache_config.kv_cache_groups, key=lambda g: isinstance(g.kv_cache_spec, MambaSpec))\n    ):\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="r-helper-one-based",
        patch="moriio-group-routing",
        what="group indices counted from 1",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "    for index, group in enumerate(kv_cache_config.kv_cache_groups):\n",
                "    for index, group in enumerate(kv_cache_config.kv_cache_groups, start=1):\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="r-msg-key-typo",
        patch="moriio-group-routing",
        what="the decode's message key and the producer's handler key differ: no per-group ids arrive",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                '            "k3patch_group_block_ids": k3patch_group_block_notify,\n',
                '            "k3patch_group_block_notify": k3patch_group_block_notify,\n',
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="r-write-meta-dropped",
        patch="moriio-group-routing",
        what="the worker forgets to pass the per-group ids from ReqMeta to the write task",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(("            k3patch_group_block_ids=meta.k3patch_group_block_ids,\n", ""),),
        recorded="status",
        recorded_detail="status: pending (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="r-task-groups-shared",
        patch="moriio-group-routing",
        what="the write task's group lists cached on the worker (first request wins): every later request writes from the first one's blocks",
        tree="fork-a",
        base="applied",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "            k3patch_group_block_ids=k3patch_group_block_ids,\n",
                "            k3patch_group_block_ids=self.__dict__.setdefault('_k3_first_groups', k3patch_group_block_ids),\n",
            ),
        ),
        recorded="status",
        recorded_detail="status: drifted (rc 1); (no probe run: patch not in a good state)",
    ),
    TreeRow(
        id="u-key-geometry-only",
        patch="moriio-group-routing",
        what="offsets cache keyed by geometry only (0.28.0's key): K3's KDA groups share a geometry, so every later layer of that geometry reuses the first layer's group's blocks",
        tree="0.33.0",
        base="pristine",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_engine.py",
        edits=(
            (
                "        key = (task.layer_name, *_get_write_geometry_key(layer_cache), target_rank)\n",
                "        key = (*_get_write_geometry_key(layer_cache), target_rank)\n",
            ),
        ),
        recorded="SURVIVED",
        recorded_detail="status: satisfied (rc 0); (all probes passed)",
    ),
    TreeRow(
        id="u-key-data-ptr",
        patch="moriio-group-routing",
        what="keyed by the tensor instead of the layer: K3's same-index layers of the KDA groups share one tensor, so groups 1-2 reuse group 0's offsets",
        tree="0.33.0",
        base="pristine",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_engine.py",
        edits=(
            (
                "        key = (task.layer_name, *_get_write_geometry_key(layer_cache), target_rank)\n",
                "        key = (layer_cache.data_ptr(), *_get_write_geometry_key(layer_cache), target_rank)\n",
            ),
        ),
        recorded="verify",
        recorded_detail="status: satisfied (rc 0); K3 upstream plan for model.layers.6.mla: AttributeError: 'Stub' object has no attribute 'data_ptr'; K3 upstream plan for model.layers.7.mla: AttributeError: 'Stub' object has no attribute 'data_ptr'",
    ),
    TreeRow(
        id="u-group-map-sorted",
        patch="moriio-group-routing",
        what="the two-group assumption re-introduced while 'tidying': every group index above 1 folded to 1 (K3's KDA groups 1-2 and MLA group 3 all go to group 1's blocks)",
        tree="0.33.0",
        base="pristine",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(
            (
                "        self.layer_to_group = dict(kv_cache_config.transfer_group_index_by_layer)\n",
                "        self.layer_to_group = {\n            name: min(g, 1) for name, g in kv_cache_config.transfer_group_index_by_layer.items()\n        }\n",
            ),
        ),
        recorded="SURVIVED",
        recorded_detail="status: satisfied (rc 0); (all probes passed)",
    ),
    TreeRow(
        id="u-remote-tail",
        patch="moriio-group-routing",
        what="'D reserves a tail block' read backwards: keeps the decode's LAST len(local) blocks, so every block lands one block late when D holds the extra one",
        tree="0.33.0",
        base="pristine",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_engine.py",
        edits=(
            (
                "                remote_blocks = remote_blocks[: len(local_blocks)]\n",
                "                remote_blocks = remote_blocks[-len(local_blocks):]\n",
            ),
        ),
        recorded="SURVIVED",
        recorded_detail="status: satisfied (rc 0); (all probes passed)",
    ),
    TreeRow(
        id="u-growth-prepend",
        patch="moriio-group-routing",
        what="each chunk's new blocks put before the old ones in every group's list: block i of the save no longer holds tokens i*block_size..",
        tree="0.33.0",
        base="pristine",
        file="vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py",
        edits=(("                        old + new\n", "                        new + old\n"),),
        recorded="SURVIVED",
        recorded_detail="status: satisfied (rc 0); (all probes passed)",
    ),
)
