"""moriio-group-routing's behaviour probe: the tree's own MoRIIO WRITE path on CPU, in the verify
child (no GPU, no MoRIIO library, no network). moriio-chunk-gate's probe shares its stand-ins.

On a fork tree it runs, in the order a request meets them: the prefill scheduler (allocation,
then build_connector_meta per chunk until the save leaves), the decode scheduler's allocation
and the notify it sends, the prefill `MoRIIOWrapper._handle_message` (-> `RemoteAllocInfo`), the
statements of `MoRIIOConnectorWorker.__init__` that build its layer maps (whatever a patch put
there), `_write_blocks_for_req` (a `WriteTask` per layer) and `MoRIIOWriter._prepare_transfer_plan`
for each. The offsets computation returns the block ids themselves, so each plan says which
blocks it writes, also when it reuses offsets another layer computed (0.28.0 caches them by
tensor geometry alone, and K3's KDA groups share their layer tensors). Prefill block ids are
`100 * (group + 1) + chunk`, decode ones 1000 more: `402` is MLA group 3's block of chunk 2.
On upstream 0.31.0+ (native) it checks upstream's group split and, where the writer indexes
per-group lists (0.33.0+), its plan for K3's MLA layers.
"""

from __future__ import annotations

import ast
import importlib
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from k3patch.model import ProbeOutcome
from k3patch.probekit import Always, Checks, Stub, Swap, run_statements, source_of, stand_in
from k3patch.shapes import match

PACKAGE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio"
COMMON = f"{PACKAGE}.moriio_common"
CONNECTOR = f"{PACKAGE}.moriio_connector"
ENGINE = f"{PACKAGE}.moriio_engine"

BLOCK_SIZE = 16
TRANSFER_ID = "tx-k3patch-probe"
DECODE_OFFSET = 1000

# (kind, layer names) per KV-cache group, in group order. K3 interleaves three KDA layers and one
# MLA layer; vLLM groups the j-th layer of each KDA group together and backs them with one
# tensor, so same-index KDA layers of different groups have equal geometry.
Layout = tuple[tuple[str, tuple[str, ...]], ...]

K3_LAYOUT: Layout = (
    ("mamba", ("model.layers.0.kda", "model.layers.4.kda")),
    ("mamba", ("model.layers.1.kda", "model.layers.5.kda")),
    ("mamba", ("model.layers.2.kda", "model.layers.6.kda")),
    ("mla", ("model.layers.3.mla", "model.layers.7.mla")),
)
TWO_GROUP_LAYOUT: Layout = (
    ("attention", ("model.layers.0.attn", "model.layers.2.attn")),
    ("mamba", ("model.layers.1.kda", "model.layers.3.kda")),
)
# Upstream's checks keep the layer names and block numbers they had before the fork drive was
# written (group g's block 10g+1, decode 100 more), so their lines read as they always did.
UPSTREAM_LAYOUT: Layout = (
    ("mamba", ("model.layers.0.kda", "model.layers.3.kda")),
    ("mamba", ("model.layers.1.kda", "model.layers.4.kda")),
    ("mamba", ("model.layers.2.kda", "model.layers.5.kda")),
    ("mla", ("model.layers.6.mla", "model.layers.7.mla")),
)
KIND_NAMES = {"mamba": "KDA", "mla": "MLA"}


@dataclass(frozen=True)
class Case:
    """One request: its layout, prefill chunks (tokens each) and the kinds whose groups gain a
    block at every chunk after the first (at the first, every group gets one). `gate_may_hold`:
    a block-count chunk gate (the fork's counts group 0, a KDA group that never grows) may hold
    the save forever: "not exercised", not a routing failure. `fork_peer`: the decode node runs
    the unfixed fork and notifies only its lists [0] and [1]; a layer may refuse or happen to be
    right, but one written silently into another group's blocks is the older fix's fallback."""

    label: str
    layout: Layout
    chunks: tuple[int, ...]
    growing: frozenset[str] = frozenset()
    gate_may_hold: bool = False
    fork_peer: bool = False

    def prefill_blocks(self, chunk: int) -> list[list[int]]:
        """The blocks each group allocates at `chunk` (1-based)."""
        return [
            [100 * (g + 1) + chunk] if chunk == 1 or kind in self.growing else []
            for g, (kind, _) in enumerate(self.layout)
        ]

    def all_prefill_blocks(self) -> list[list[int]]:
        chunks = [self.prefill_blocks(c) for c in range(1, len(self.chunks) + 1)]
        return [
            [b for blocks in per_chunk for b in blocks] for per_chunk in zip(*chunks, strict=True)
        ]

    def decode_blocks(self) -> list[list[int]]:
        # The decode node allocates the whole prompt at once, one block per prefill block.
        return [[DECODE_OFFSET + b for b in g] for g in self.all_prefill_blocks()]


CASES = (
    Case("K3, 1 chunk", K3_LAYOUT, (12,)),
    # Without prefix caching a KDA group holds one state block per request; only MLA grows.
    Case("K3, 3 chunks", K3_LAYOUT, (16, 16, 8), frozenset({"mla"}), gate_may_hold=True),
    # Every group gains a block per chunk (as with Mamba prefix caching), so even a block-count
    # gate on group 0 lets the save leave at the final chunk and chunked routing is exercised.
    Case("K3, 3 chunks, every group grows", K3_LAYOUT, (16, 16, 8), frozenset({"mamba", "mla"})),
    Case("two-group, 1 chunk", TWO_GROUP_LAYOUT, (12,)),
    Case("two-group, 3 chunks", TWO_GROUP_LAYOUT, (16, 16, 8), frozenset({"attention"})),
    Case("K3, 1 chunk, decode node without the fix", K3_LAYOUT, (12,), fork_peer=True),
)


class ProbeSetupError(Exception):
    """The tree's code is not in a shape this probe can drive (a reason, not a routing result)."""


@dataclass
class Route:
    """What one layer's transfer plan would write: its block ids on both nodes, and the layer
    whose offsets call produced them (None: not recorded)."""

    local: list[int]
    remote: list[int]
    computed_by: str | None


@dataclass
class Drive:
    """One request through the tree's WRITE path."""

    saves: list[int] = field(default_factory=list)  # chunks at which the save left
    steps: list[str] = field(default_factory=list)  # per chunk: tokens, blocks, held or sent
    messages: int = 0
    routes: dict[str, Route] = field(default_factory=dict)  # of the (first) save
    errors: dict[str, str] = field(default_factory=dict)


def probe_routing() -> ProbeOutcome | None:
    connector = importlib.import_module(CONNECTOR)
    if hasattr(connector, "_split_kv_cache_group_kinds"):
        return probe_upstream(connector)
    if not hasattr(connector.MoRIIOConnectorScheduler, "update_state_after_alloc"):
        return None
    checks = Checks("routing")
    for case in CASES:
        try:
            drive = drive_write(case)
        except ProbeSetupError as exc:
            checks.fail(f"{case.label}: cannot drive this tree: {exc}")
            continue
        failures = judge(case, drive, checks)
        for failure in failures:
            checks.note(f"FAIL {case.label}: {failure}")
        if failures:
            checks.fail(_case_summary(case, failures))
    return checks.outcome(
        holds="every layer's KV goes to its own KV-cache group's blocks, all chunks', on both "
        "nodes (K3: KDA -> groups 0-2, MLA -> group 3; two groups as before; {ran} checks)",
        broken="{failures}",
    )


def _case_summary(case: Case, failures: list[str]) -> str:
    """What failed outright, then the first misrouted layer of each group (the other layers of
    a group fail the same way; the checks list them all)."""
    layers = sum(len(names) for _, names in case.layout)
    misrouted = [f for f in failures if f.startswith("model.")]
    parts = [f for f in failures if not f.startswith("model.")]
    if misrouted:
        first: dict[str, str] = {}
        for failure in misrouted:
            group = re.search(r"\(\w+ group (\d+)\)", failure)
            first.setdefault(group.group(1) if group else failure, failure)
        parts.append(
            f"{len(misrouted)} of {layers} layers misrouted, in group(s) {', '.join(first)}: "
            + "; ".join(first.values())
        )
    return f"{case.label}: " + "; ".join(parts)


def judge(case: Case, drive: Drive, checks: Checks) -> list[str]:
    """Records a check line per layer (and per prefill); returns the failures: one per
    misrouted layer (starting with its name), naming the blocks it would write and the ones it
    should, or per case."""
    label, final = case.label, len(case.chunks)
    checks.record(f"{label}: prefill " + "; ".join(drive.steps))
    if not drive.saves and case.gate_may_hold:
        checks.record(
            f"{label}: not exercised, the save never left the prefill scheduler (its "
            "final-chunk gate is moriio-chunk-gate's; the growing case covers chunks)"
        )
        return []
    if not drive.saves:
        return [f"the save never left the prefill scheduler in {final} chunks"]
    failures: list[str] = []
    if drive.saves != [final]:
        failures.append(
            f"the save left at chunk(s) {drive.saves} of {final}, expected once at chunk {final}"
        )
    if drive.messages != 1:
        return [*failures, f"decode sent {drive.messages} notify messages, expected 1"]
    local, remote = case.all_prefill_blocks(), case.decode_blocks()
    for g, (kind, names) in enumerate(case.layout):
        for layer in names:
            head = f"{layer} ({KIND_NAMES.get(kind, kind)} group {g})"
            route = drive.routes.get(layer)
            if layer in drive.errors and case.fork_peer:
                checks.record(f"{label}: {head} refused: {drive.errors[layer]}")
            elif layer in drive.errors or route is None:
                failures.append(f"{head}: {drive.errors.get(layer, 'no transfer planned')}")
            else:
                line = f"{head}: local {route.local} -> remote {route.remote}"
                if route.computed_by not in (None, layer):
                    line += f" (offsets reused from {route.computed_by})"
                checks.record(f"{label} @chunk {drive.saves[0]}: {line}")
                if (route.local, route.remote) != (local[g], remote[g]):
                    silently, refusal = (
                        ("silently ", " or a refusal") if case.fork_peer else ("", "")
                    )
                    failures.append(
                        f"{line}, {silently}{_whose(route, g, local[g], remote[g])}; "
                        f"expected local {local[g]} -> remote {remote[g]}{refusal}"
                    )
    return failures


def _whose(route: Route, group: int, local: list[int], remote: list[int]) -> str:
    """Whose blocks a route writes, from the probe's numbering (group from the hundreds digit,
    chunk from the units)."""
    groups = sorted({(b % DECODE_OFFSET) // 100 - 1 for b in route.local + route.remote})
    if groups != [group]:
        return "group(s) " + ", ".join(str(g) for g in groups) + "'s blocks"
    parts = []
    for side, want, got in (("prefill", local, route.local), ("decode", remote, route.remote)):
        left_out = sorted({b % 100 for b in want if b not in got})
        if left_out:
            parts.append(f"its {side} blocks of chunk(s) {left_out} left out")
    return ", ".join(parts) or "its own group's blocks, not as allocated"


def drive_write(case: Case) -> Drive:
    common = importlib.import_module(COMMON)
    connector = importlib.import_module(CONNECTOR)
    engine = importlib.import_module(ENGINE)
    drive = Drive()
    prompt = sum(case.chunks)
    saved_role = common.get_role()
    try:
        # 1. Prefill scheduler: allocation at chunk 1, then one build_connector_meta per chunk.
        prefill = connector.MoRIIOConnectorScheduler(_vllm_config("kv_producer"), "prefill")
        request = stub_request("req-prefill", prompt, kv_params("decode"))
        blocks = [case.prefill_blocks(c) for c in range(1, len(case.chunks) + 1)]
        sent = drive_prefill(prefill, [(request, list(zip(case.chunks, blocks, strict=True)))])
        for chunk, (tokens, allocated, saves) in enumerate(
            zip(case.chunks, blocks, sent, strict=True), 1
        ):
            held = request.request_id not in saves
            drive.steps.append(
                f"chunk {chunk} ({tokens} tokens, blocks {allocated}): "
                + ("held" if held else "save sent")
            )
        drive.saves = [c for c, saves in enumerate(sent, 1) if request.request_id in saves]
        if not drive.saves:
            return drive
        meta = sent[drive.saves[0] - 1][request.request_id]

        # 2. Decode scheduler: its allocation makes it tell the prefill node where to write.
        decode = connector.MoRIIOConnectorScheduler(_vllm_config("kv_consumer"), "decode")
        notified: list[bytes] = []
        decode.paths = Always(Stub(send=notified.append))  # every notify path open already
        decode_request = stub_request("req-decode", prompt, kv_params("prefill"))
        decode.update_state_after_alloc(decode_request, block_ids(case.decode_blocks()), prompt)
        drive.messages = len(notified)
        if drive.messages != 1:
            return drive

        # 3. Prefill node: the notify listener stores where decode wants the KV.
        common.set_role(common.ROLE.PRODUCER)
        wrapper = stand_in(
            engine.MoRIIOWrapper,
            lock=threading.Lock(),
            done_remote_allocate_req_dict={},
            done_req_ids=[],
            done_write_cache_req_ids=[],
            _terminal_transfer_ids=OrderedDict(),
            paths={},  # read when the worker is collected (its __del__ shuts it down)
        )
        if case.fork_peer:  # the keys of the unfixed fork's `send_notify_block`
            fork_lists = case.decode_blocks()
            notified[0] = engine.msgpack.dumps(
                {
                    "req_id": "req-decode",
                    "transfer_id": TRANSFER_ID,
                    "block_notify_list": fork_lists[0],
                    "mamba_block_notify_list": fork_lists[1] if len(fork_lists) > 1 else [],
                    "decode_rank": 0,
                    "type": "remote_blocks",
                }
            )
        wrapper._handle_message(notified[0])
        request_info = wrapper.done_remote_allocate_req_dict[TRANSFER_ID]

        # 4. Prefill worker: its own layer maps, then one write task per layer.
        vllm_config = _vllm_config("kv_producer")
        worker = stand_in(
            connector.MoRIIOConnectorWorker,
            vllm_config=vllm_config,
            kv_transfer_config=vllm_config.kv_transfer_config,
            is_producer=True,
            mode=common.MoRIIOMode.WRITE,
        )
        _run_worker_maps(connector, worker, vllm_config, case.layout)
        layers = [name for _, names in case.layout for name in names]
        tasks: list[Any] = []
        # Offsets lists by identity -> the layer whose call made them; the list is kept alive,
        # so no identity is reused while a plan can still return it.
        made: dict[int, tuple[str, list[int]]] = {}

        def offsets(layer: str, local: Any, remote: Any, *args: Any, **kw: Any) -> Any:
            local_ids = list(local)
            made[id(local_ids)] = (layer, local_ids)
            return local_ids, list(remote), [1] * len(local_ids)

        vars(worker).update(
            kv_caches=_kv_caches(case.layout),
            layer_name_to_local_kv_cache_metadata={name: [b""] for name in layers},
            moriio_wrapper=wrapper,
            _writer=Stub(schedule_write=tasks.append),
            _compute_block_transfer_offsets=offsets,
        )
        with Swap() as swap:
            _stand_in_cuda(swap, connector)
            for name in layers:
                worker._write_blocks_for_req(request.request_id, meta, name, None)

        # 5. The writer's plan for every layer.
        writer = stand_in(engine.MoRIIOWriter, _worker_ref=weakref.ref(worker))
        remote_meta = Stub(
            engine_id="decode", num_blocks=4096, block_len=1, kv_caches_base_addr=[0]
        )
        for task in tasks:
            try:
                plan = writer._prepare_transfer_plan(task, request_info, remote_meta)
            except Exception as exc:  # reported per layer, never swallowed
                drive.errors[task.layer_name] = f"{type(exc).__name__}: {exc}"
                continue
            local_off = plan.transfer_local_offsets
            by = made.get(id(local_off), (None,))[0]
            drive.routes[task.layer_name] = Route(
                list(local_off), list(plan.transfer_remote_offsets), by
            )
        return drive
    finally:
        common.set_role(saved_role)


def _run_worker_maps(connector: Any, worker: Any, vllm_config: Any, layout: Layout) -> None:
    """Run the statements of the tree's `MoRIIOConnectorWorker.__init__` that map layers to
    specs and groups: from `self.layer_to_spec = ...` up to `if self.is_producer:`. The rest of
    `__init__` needs a GPU, the MoRIIO library and a network; this run is the tree's own text,
    so a patch that builds its map there (k3patch's, the older script's) is what gets tested."""
    init = connector.MoRIIOConnectorWorker.__init__
    func = source_of(init)
    if func is None:
        raise ProbeSetupError("MoRIIOConnectorWorker.__init__ has no source")
    body = func.body
    starts = [i for i, s in enumerate(body) if match("self.layer_to_spec = HOLE_v", s) is not None]
    if not starts:
        raise ProbeSetupError("MoRIIOConnectorWorker.__init__ sets no self.layer_to_spec")
    ends = [
        i
        for i, stmt in enumerate(body[starts[0] :], starts[0])
        if isinstance(stmt, ast.If) and match("self.is_producer", stmt.test) is not None
    ]
    if not ends:
        raise ProbeSetupError(
            "MoRIIOConnectorWorker.__init__ has no `if self.is_producer:` after layer_to_spec"
        )
    try:
        config = kv_cache_config(layout)
    except TypeError:  # another version's fields
        config = kv_cache_stand_in(layout)
    run_statements(init, body[starts[0] : ends[0]], worker, vllm_config, "prefill", config)


# ---------------------------------------------------------------------------------------------
# MoRIIO and vLLM stand-ins (moriio-chunk-gate's probe drives build_connector_meta with them)


def _spec(kind: str, bare: bool = False) -> Any:
    """A KV-cache spec of `kind`; bare (only the class is read), also where this version's
    fields differ."""
    specs = importlib.import_module("vllm.v1.kv_cache_interface")
    torch = importlib.import_module("torch")
    classes = {"mamba": specs.MambaSpec, "mla": specs.MLAAttentionSpec}
    cls = classes.get(kind, specs.FullAttentionSpec)
    if kind == "mamba":
        fields: dict[str, Any] = {"shapes": ((4,), (8,)), "dtypes": (torch.float32,) * 2}
    else:
        fields = {"num_kv_heads": 1, "head_size": 8, "dtype": torch.bfloat16}
    if not bare:
        try:
            return cls(block_size=BLOCK_SIZE, **fields)
        except TypeError:  # another version's fields: only the class is read here
            pass
    return object.__new__(cls)


def kv_cache_config(layout: Layout, bare_specs: bool = False) -> Any:
    """`layout` as this version's own KVCacheConfig (TypeError where its fields differ)."""
    specs = importlib.import_module("vllm.v1.kv_cache_interface")
    groups = [
        specs.KVCacheGroupSpec(layer_names=list(names), kv_cache_spec=_spec(kind, bare_specs))
        for kind, names in layout
    ]
    return specs.KVCacheConfig(num_blocks=4096, kv_cache_tensors=[], kv_cache_groups=groups)


def kv_cache_stand_in(layout: Layout, bare_specs: bool = False) -> Stub:
    """What the connector reads of a KVCacheConfig, where the real one cannot be built."""
    groups = [
        Stub(
            layer_names=list(names), kv_cache_spec=_spec(kind, bare_specs), enable_kv_transfer=True
        )
        for kind, names in layout
    ]
    return Stub(
        kv_cache_groups=groups, kv_cache_tensors=[], num_blocks=4096, transfer_groups=tuple(groups)
    )


def _kv_caches(layout: Layout) -> dict[str, Any]:
    """One tensor per layer, the j-th layer of every Mamba group sharing one (as vLLM backs
    K3's KDA groups), attention layers each their own of another shape."""
    torch = importlib.import_module("torch")
    caches: dict[str, Any] = {}
    shared: dict[int, Any] = {}
    for kind, names in layout:
        for j, name in enumerate(names):
            if kind == "mamba":
                caches[name] = shared.setdefault(j, torch.empty((64, 12), dtype=torch.float32))
            else:
                caches[name] = torch.empty((64, BLOCK_SIZE, 8), dtype=torch.bfloat16)
    return caches


def _vllm_config(role: str) -> Stub:
    extra = {
        "handshake_port": "6301",
        "notify_port": "61005",
        "http_port": "8000",
        "host_ip": "127.0.0.1",
        "proxy_ip": "",
        "read_mode": "false",
    }
    return Stub(
        kv_transfer_config=Stub(
            kv_role=role,
            kv_connector_extra_config=extra,
            is_kv_producer=role == "kv_producer",
            is_kv_consumer=role == "kv_consumer",
        ),
        cache_config=Stub(block_size=BLOCK_SIZE),
        parallel_config=Stub(
            tensor_parallel_size=1,
            data_parallel_rank=0,
            data_parallel_size=1,
            data_parallel_size_local=1,
        ),
    )


def kv_params(remote: str, transfer_id: str = TRANSFER_ID) -> dict[str, Any]:
    """kv_transfer_params of a request whose KV goes to (remote "decode") or comes from
    (remote "prefill") the other node."""
    params: dict[str, Any] = {
        "do_remote_decode" if remote == "decode" else "do_remote_prefill": True,
        "transfer_id": transfer_id,
        "remote_host": "127.0.0.1",
        "remote_handshake_port": 6301,
        "remote_notify_port": 61005,
        "remote_engine_id": remote,
        "remote_block_ids": [],
        "remote_dp_rank": 0,
    }
    if remote == "decode":
        params["remote_dp_size"] = 1
    return params


def stub_request(request_id: str, prompt: int, params: dict[str, Any] | None) -> Stub:
    return Stub(
        request_id=request_id,
        req_id=request_id,
        kv_transfer_params=params,
        num_prompt_tokens=prompt,
        num_computed_tokens=0,
        num_tokens=prompt,
        prompt_token_ids=list(range(prompt)),
    )


def block_ids(per_group: list[list[int]]) -> Stub:
    """KVCacheBlocks as the connector reads them."""
    return Stub(get_block_ids=lambda *a, **k: tuple(list(g) for g in per_group))


def drive_prefill(
    scheduler: Any, plans: list[tuple[Any, list[tuple[int, list[list[int]]]]]]
) -> list[dict[str, Any]]:
    """`build_connector_meta` driven as vLLM's scheduler drives it, a step per chunk; `plans`
    gives each request its (tokens scheduled, blocks allocated per group) per step. At its first
    step a request is new, its blocks recorded by update_state_after_alloc first; later it is a
    cached request with the blocks that step allocated (None when none, as vLLM sends it); its
    computed tokens advance after each step. Returns each step's `reqs_to_save`."""
    sent = []
    for step in range(max(len(steps) for _, steps in plans)):
        live = [(request, *steps[step]) for request, steps in plans if step < len(steps)]
        new, cached = (live, []) if step == 0 else ([], live)
        for request, _, blocks in new:
            scheduler.update_state_after_alloc(request, block_ids(blocks), 0)
        output = Stub(
            scheduled_new_reqs=[request for request, _, _ in new],
            # As the real SchedulerOutput carries them: each request's computed tokens before
            # this step (the older k3-chunk-gate script reads its progress from here).
            scheduled_cached_reqs=Stub(
                req_ids=[request.request_id for request, _, _ in cached],
                new_block_ids=[tuple(map(list, b)) if any(b) else None for _, _, b in cached],
                num_computed_tokens=[request.num_computed_tokens for request, _, _ in cached],
                resumed_req_ids=set(),
                resumed_from_preemption=[False] * len(cached),
            ),
            num_scheduled_tokens={request.request_id: tokens for request, tokens, _ in live},
            total_num_scheduled_tokens=sum(tokens for _, tokens, _ in live),
            finished_req_ids=set(),
            new_block_ids_to_zero=None,
            kv_connector_block_state=None,
        )
        sent.append(dict(scheduler.build_connector_meta(output).reqs_to_save))
        for request, tokens, _ in live:
            request.num_computed_tokens += tokens
    return sent


def _stand_in_cuda(swap: Swap, module: Any) -> None:
    """schedule_write_blocks records a CUDA event; without a GPU the connector module's `torch`
    is replaced, for the drive, by an object that only has that event."""
    if "torch" not in module.__dict__:
        return
    event = Stub(record=lambda *a: None, synchronize=lambda: None)
    cuda = Stub(current_stream=lambda: None, Event=lambda *a, **k: event)
    swap.attr(module, "torch", Stub(cuda=cuda))


# ---------------------------------------------------------------------------------------------
# Upstream 0.31.0+ (satisfied natively): upstream's own split and plan, with K3's groups.


def probe_upstream(connector: Any) -> ProbeOutcome:
    checks = Checks("upstream")
    try:
        # The real config class, so the worker's map comes from upstream's own property.
        config = kv_cache_config(UPSTREAM_LAYOUT, bare_specs=True)
        layer_to_group = dict(config.transfer_group_index_by_layer)
    except (TypeError, AttributeError) as exc:
        checks.note(f"KVCacheConfig could not be built here ({exc}); using a stand-in")
        config = kv_cache_stand_in(UPSTREAM_LAYOUT, bare_specs=True)
        layer_to_group = {n: g for g, (_, names) in enumerate(UPSTREAM_LAYOUT) for n in names}
    split = connector._split_kv_cache_group_kinds(config)
    line = f"K3: _split_kv_cache_group_kinds -> attention {split[0]}, mamba {split[1]}"
    expected = [list(part) for part in split] == [[3], [0, 1, 2]]
    checks.record(line, expected, f"{line}, expected attention [3], mamba [0, 1, 2]")
    engine = importlib.import_module(ENGINE)
    plan = source_of(engine.MoRIIOWriter._prepare_transfer_plan)
    per_group = "self.worker.layer_to_group[task.layer_name]"
    if plan is not None and any(match(per_group, n) is not None for n in ast.walk(plan)):
        _probe_upstream_plan(engine, layer_to_group, checks)
        checks.note("KDA layers take upstream's separate Mamba plan (not exercised here)")
    else:
        checks.note(
            "WRITE with a Mamba group is refused by register_kv_caches on this version; "
            "its per-layer WRITE plan is single-group and was not exercised"
        )
    return checks.outcome(
        holds="upstream routes K3's groups by spec, natively", broken="{failures}"
    )


def _probe_upstream_plan(engine: Any, layer_to_group: dict[str, int], checks: Checks) -> None:
    """0.33.0+: MoRIIOWriter._prepare_transfer_plan for K3's MLA layers."""
    common = importlib.import_module(COMMON)
    mla = len(UPSTREAM_LAYOUT) - 1
    local = [[10 * g + 1] for g in range(mla)] + [[10 * mla + 1, 10 * mla + 2]]
    remote = [[100 + b for b in blocks] for blocks in local]
    given: dict[str, tuple[list[int], list[int]]] = {}

    def offsets(layer: str, local_ids: Any, remote_ids: Any, *args: Any, **kw: Any) -> Any:
        given[layer] = (list(local_ids), list(remote_ids))
        return [0], [0], [1]

    worker = Stub(
        kv_caches={
            name: Stub(shape=(1,), dtype="probe", stride=lambda: (1,)) for name in layer_to_group
        },
        layer_to_group=layer_to_group,
        _has_mamba=True,
        _check_peer_block_size=lambda *a, **k: None,
        _compute_block_transfer_offsets=offsets,
        _region_session_indices=lambda layer: [0],
    )
    writer = stand_in(engine.MoRIIOWriter, _worker_ref=weakref.ref(worker))
    for layer in UPSTREAM_LAYOUT[mla][1]:
        task = common.WriteTask(
            request_id="req",
            transfer_id=TRANSFER_ID,
            dst_engine_id="decode",
            local_block_ids=local,
            remote_block_ids_hint=None,
            layer_name=layer,
            event=None,
            remote_notify_port=0,
            remote_ip="127.0.0.1",
        )
        info = common.RemoteAllocInfo(block_ids=remote)
        try:
            writer._prepare_transfer_plan(task, info, Stub(num_blocks=4096))
        except Exception as exc:  # reported, never swallowed
            checks.fail(f"K3 upstream plan for {layer}: {type(exc).__name__}: {exc}")
            continue
        got = given.get(layer)
        line = (
            f"K3 upstream plan: {layer} (group {layer_to_group.get(layer)}) -> "
            f"local {got and got[0]} remote {got and got[1]}"
        )
        want = (local[mla], remote[mla])
        checks.record(line, got == want, f"{line}, expected local {want[0]} remote {want[1]}")
