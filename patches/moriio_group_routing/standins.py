"""MoRIIO and vLLM stand-ins for the probes in the verify child (moriio-chunk-gate's too): KV-cache
configs and tensors of a layout, a vLLM config, requests, the prefill scheduler step by step and
the prefill worker with its own layer maps."""

from __future__ import annotations

import ast
import contextlib
import importlib
from typing import Any

from k3patch import probekit
from k3patch.probekit import Stub, stand_in
from k3patch.shapes import match

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
COMMON, CONNECTOR, ENGINE = (f"{PACKAGE}.moriio_{m}" for m in ("common", "connector", "engine"))
BLOCK_SIZE = 16
TRANSFER_ID = "tx-k3patch-probe"
# (kind, layer names) per KV-cache group, in group order.
Layout = tuple[tuple[str, tuple[str, ...]], ...]


def _spec(kind: str, bare: bool = False) -> Any:
    """A KV-cache spec of `kind`, bare (of the class alone) if asked or where its fields differ."""
    specs = importlib.import_module("vllm.v1.kv_cache_interface")
    torch = importlib.import_module("torch")
    classes = {"mamba": specs.MambaSpec, "mla": specs.MLAAttentionSpec}
    classes["sliding"] = specs.SlidingWindowSpec
    cls = classes.get(kind, specs.FullAttentionSpec)
    if kind == "mamba":
        fields: dict[str, Any] = {"shapes": ((4,), (8,)), "dtypes": (torch.float32,) * 2}
    else:
        fields = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.bfloat16}
        fields.update({"sliding_window": 4 * BLOCK_SIZE} if kind == "sliding" else {})
    if not bare:
        with contextlib.suppress(TypeError):  # another version's fields: only the class is read
            return cls(block_size=BLOCK_SIZE, **fields)
    return stand_in(cls)


def kv_cache_config(layout: Layout, bare_specs: bool = False, real: bool = True) -> Any:
    """`layout` as this version's KVCacheConfig (TypeError where its fields differ), or not
    `real`: a stand-in."""
    specs = importlib.import_module("vllm.v1.kv_cache_interface")
    groups = [(list(names), _spec(kind, bare_specs)) for kind, names in layout]
    if real:
        groups = [specs.KVCacheGroupSpec(*group) for group in groups]
        return specs.KVCacheConfig(num_blocks=4096, kv_cache_tensors=[], kv_cache_groups=groups)
    stubs = [Stub(layer_names=n, kv_cache_spec=s, enable_kv_transfer=True) for n, s in groups]
    return Stub(
        kv_cache_groups=stubs, kv_cache_tensors=[], num_blocks=4096, transfer_groups=(*stubs,)
    )


def stub_kv_caches(layout: Layout) -> dict[str, Any]:
    """A tensor per layer; the j-th of each Mamba group share one, as vLLM backs K3's KDA groups."""
    torch = importlib.import_module("torch")
    kda = [torch.empty((64, 12), dtype=torch.float32) for _, names in layout for _ in names]
    return {
        name: kda[j] if kind == "mamba" else torch.empty((64, BLOCK_SIZE, 8), dtype=torch.bfloat16)
        for kind, names in layout
        for j, name in enumerate(names)
    }


def stub_vllm_config(role: str) -> Stub:
    ports = {"handshake_port": "6301", "notify_port": "61005", "http_port": "8000"}
    extra = {**ports, "host_ip": "127.0.0.1", "proxy_ip": "", "read_mode": "false"}
    roles = dict(is_kv_producer=role == "kv_producer", is_kv_consumer=role == "kv_consumer")
    parallel = dict(tensor_parallel_size=1, data_parallel_rank=0, data_parallel_size=1)
    return Stub(
        kv_transfer_config=Stub(kv_role=role, kv_connector_extra_config=extra, **roles),
        cache_config=Stub(block_size=BLOCK_SIZE),
        parallel_config=Stub(**parallel, data_parallel_size_local=1),
    )


def kv_params(remote: str, transfer_id: str = TRANSFER_ID) -> dict[str, Any]:
    """kv_transfer_params: the KV goes to `remote` ("decode") or comes from it ("prefill")."""
    side = "do_remote_decode" if remote == "decode" else "do_remote_prefill"
    params: dict[str, Any] = {side: True, "transfer_id": transfer_id, "remote_host": "127.0.0.1"}
    params.update(remote_handshake_port=6301, remote_notify_port=61005, remote_engine_id=remote)
    params.update(remote_block_ids=[], remote_dp_rank=0)
    return {**params, "remote_dp_size": 1} if remote == "decode" else params


def stub_request(request_id: str, prompt: int, params: dict[str, Any] | None) -> Stub:
    ids = dict(request_id=request_id, req_id=request_id, prompt_token_ids=list(range(prompt)))
    counts = dict(num_prompt_tokens=prompt, num_computed_tokens=0, num_tokens=prompt)
    return Stub(kv_transfer_params=params, **ids, **counts)


def block_ids(per_group: list[list[int]]) -> Stub:
    """KVCacheBlocks as the connector reads them."""
    return Stub(get_block_ids=lambda *a, **k: tuple(list(g) for g in per_group))


def finish_request(scheduler: Any, request: Any, blocks: list[int]) -> list[str]:
    """Ends `request` as vLLM does (request_finished, a step naming it finished, the worker's ack
    that its KV was sent, one more step); the scheduler's attributes still holding its request or
    transfer id (a leak)."""
    request.status = importlib.import_module("vllm.v1.request").RequestStatus.FINISHED_LENGTH_CAPPED
    scheduler.request_finished(request, list(blocks))
    scheduler.build_connector_meta(_step_output([], finished={request.request_id}))
    if hasattr(scheduler, "update_connector_output"):
        ack = dict(finished_sending={request.request_id}, finished_recving=None)
        scheduler.update_connector_output(Stub(**ack, invalid_block_ids=set()))
    scheduler.build_connector_meta(_step_output([]))
    ids = {request.request_id, (request.kv_transfer_params or {}).get("transfer_id")}
    kinds = dict | set | frozenset | list | tuple  # a dict: its keys
    held = [(name, v) for name, v in vars(scheduler).items() if isinstance(v, kinds)]
    return [name for name, v in held if any(isinstance(item, str) and item in ids for item in v)]


def _step_output(
    live: list[tuple[Any, int, list[list[int]]]],
    new: int = 0,
    finished: set[str] | frozenset[str] = frozenset(),
) -> Stub:
    """A SchedulerOutput: `live` (request, tokens, blocks per group) scheduled, its first `new`
    new, the others cached; `finished`: the ids that ended since the last step."""
    cached = live[new:]
    return Stub(
        scheduled_new_reqs=[request for request, _, _ in live[:new]],
        # As vLLM's: computed tokens before this step (the older chunk-gate script reads them).
        scheduled_cached_reqs=Stub(
            req_ids=[request.request_id for request, _, _ in cached],
            new_block_ids=[tuple(map(list, b)) if any(b) else None for _, _, b in cached],
            num_computed_tokens=[request.num_computed_tokens for request, _, _ in cached],
            resumed_req_ids=set(),
            resumed_from_preemption=[False] * len(cached),
        ),
        num_scheduled_tokens={request.request_id: tokens for request, tokens, _ in live},
        total_num_scheduled_tokens=sum(tokens for _, tokens, _ in live),
        finished_req_ids=set(finished),
        new_block_ids_to_zero=None,
        kv_connector_block_state=None,
    )


def drive_prefill(
    scheduler: Any, plans: list[tuple[Any, list[tuple[int, list[list[int]]]]]]
) -> list[dict[str, Any]]:
    """Each step's `reqs_to_save` from `build_connector_meta`, driven as vLLM does: `plans` gives
    each request its tokens and blocks per group per step; it is new at its first step (after
    update_state_after_alloc), then cached; its computed tokens advance after each step."""
    sent = []
    for step in range(max(len(steps) for _, steps in plans)):
        live = [(request, *steps[step]) for request, steps in plans if step < len(steps)]
        new = len(live) if step == 0 else 0
        for request, _, blocks in live[:new]:
            scheduler.update_state_after_alloc(request, block_ids(blocks), 0)
        sent.append(dict(scheduler.build_connector_meta(_step_output(live, new)).reqs_to_save))
        for request, tokens, _ in live:
            request.num_computed_tokens += tokens
    return sent


class ProbeSetupError(Exception):
    """The tree's code is not in a shape this probe can drive (a reason, not a routing result)."""


def prefill_worker(connector: Any, layout: Layout) -> Any:
    """A WRITE-mode prefill worker with its layer maps for `layout`: `MoRIIOConnectorWorker.
    __init__`'s own statements from `self.layer_to_spec = ...` to `if self.is_producer:` (a
    patch's too); the rest needs a GPU and a network."""
    config = stub_vllm_config("kv_producer")
    worker = stand_in(connector.MoRIIOConnectorWorker, is_producer=True, vllm_config=config)
    mode = importlib.import_module(COMMON).MoRIIOMode.WRITE
    worker.kv_transfer_config, worker.mode = config.kv_transfer_config, mode
    init, where = connector.MoRIIOConnectorWorker.__init__, "MoRIIOConnectorWorker.__init__"
    body = getattr(probekit.source_of(init), "body", None)
    if body is None:
        raise ProbeSetupError(f"{where} has no source")
    starts = [match("self.layer_to_spec = HOLE_v", s) is not None for s in body]
    ends = [isinstance(s, ast.If) and match("self.is_producer", s.test) is not None for s in body]
    if True not in starts:
        raise ProbeSetupError(f"{where} sets no self.layer_to_spec")
    start = starts.index(True)
    if True not in ends[start:]:
        raise ProbeSetupError(f"{where} has no `if self.is_producer:` after layer_to_spec")
    try:
        kv_config = kv_cache_config(layout)
    except TypeError:  # another version's fields
        kv_config = kv_cache_config(layout, real=False)
    body = body[start : ends.index(True, start)]
    probekit.run_statements(init, body, worker, config, "prefill", kv_config)
    return worker
