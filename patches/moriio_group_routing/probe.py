"""moriio-group-routing's behaviour probe: the tree's own MoRIIO WRITE path, driven on CPU.

It runs in the verify child (the tree's interpreter, vLLM importable, no GPU, no MoRIIO library,
k3patch not installed; the patch imports it there, `from . import probe`), so it uses the
standard library, the tree's vLLM and k3patch's standard-library modules (model, probekit) only.

On a fork tree (the 0.28.0 wheel plus the recipe's scripts, patched by k3patch or not) it drives
the tree's real code, in the order a request meets it:
1. the prefill `MoRIIOConnectorScheduler`: `update_state_after_alloc` with the blocks of the first
   chunk, then `build_connector_meta` once per prefill chunk, each step carrying the blocks that
   chunk allocated, until the save leaves;
2. the decode `MoRIIOConnectorScheduler.update_state_after_alloc`, whose notify message is caught
   on a recording socket;
3. the prefill `MoRIIOWrapper._handle_message` (-> `_handle_remote_blocks_message`), which turns
   that message into the `RemoteAllocInfo` the writer reads;
4. the worker: the statements of `MoRIIOConnectorWorker.__init__` that build its layer maps (from
   `self.layer_to_spec = ...` up to the role switch, whatever a patch put there), then
   `_write_blocks_for_req` -> `schedule_write_blocks` -> one `WriteTask` per layer;
5. `MoRIIOWriter._prepare_transfer_plan` for every task, offsets cache included.
The worker's `_compute_block_transfer_offsets` is a recorder that returns the block ids
themselves as offsets, so each layer's plan says which blocks its RDMA write would read and write
even when the plan reuses offsets another layer computed (0.28.0 caches them by tensor geometry
alone, and K3's three KDA groups share their layer tensors). Only what needs a GPU or a network
is stood in: the worker object (`object.__new__` plus what the methods read), the zmq socket, the
CUDA event, the offsets computation.

Block ids name their owner: prefill block `100 * (group + 1) + chunk`, decode block `1000 +` the
same, so `402` is group 3's (MLA) block from chunk 2 and `1402` the decode block it goes to.

On upstream 0.31.0+ (satisfied natively) it checks upstream's own group split and, where the
writer indexes per-group lists (0.33.0+), its transfer plan for K3's MLA layers.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from k3patch.model import ProbeOutcome
from k3patch.probekit import Swap

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


@dataclass(frozen=True)
class Case:
    """One request: its layout, its prefill chunks (tokens each) and which groups gain a block at
    every chunk after the first (at the first, every group gets one)."""

    label: str
    layout: Layout
    chunks: tuple[int, ...]
    growing: frozenset[str]  # kinds that allocate a block per chunk
    # A case whose save a block-count chunk gate may hold forever (the fork's gate counts group
    # 0's blocks, a KDA group that never grows): held is "not exercised", not a routing failure.
    gate_may_hold: bool = False
    # The decode node runs the fork with no routing fix: its notify carries only the fork's two
    # lists ([0] and [1]). A layer may refuse the transfer or happen to be right; a layer
    # written silently into another group's blocks is the bug the older fix's fallback keeps.
    fork_peer: bool = False

    @property
    def prompt(self) -> int:
        return sum(self.chunks)

    def prefill_blocks(self, chunk: int) -> list[list[int]]:
        """The blocks each group allocates at `chunk` (1-based)."""
        return [
            [_block(g, chunk)] if chunk == 1 or kind in self.growing else []
            for g, (kind, _) in enumerate(self.layout)
        ]

    def all_prefill_blocks(self) -> list[list[int]]:
        per_group: list[list[int]] = [[] for _ in self.layout]
        for chunk in range(1, len(self.chunks) + 1):
            for g, blocks in enumerate(self.prefill_blocks(chunk)):
                per_group[g] += blocks
        return per_group

    def decode_blocks(self) -> list[list[int]]:
        # The decode node allocates the whole prompt at once, one block per prefill block.
        return [[DECODE_OFFSET + b for b in g] for g in self.all_prefill_blocks()]

    def group_of(self) -> dict[str, int]:
        return {name: g for g, (_, names) in enumerate(self.layout) for name in names}


def _block(group: int, chunk: int) -> int:
    return 100 * (group + 1) + chunk


CASES = (
    Case("K3, 1 chunk", K3_LAYOUT, (12,), frozenset()),
    # Without prefix caching a KDA group holds one state block per request; only MLA grows.
    Case("K3, 3 chunks", K3_LAYOUT, (16, 16, 8), frozenset({"mla"}), gate_may_hold=True),
    # Every group gains a block per chunk (as with Mamba prefix caching), so even a block-count
    # gate on group 0 lets the save leave at the final chunk and chunked routing is exercised.
    Case("K3, 3 chunks, every group grows", K3_LAYOUT, (16, 16, 8), frozenset({"mamba", "mla"})),
    Case("two-group, 1 chunk", TWO_GROUP_LAYOUT, (12,), frozenset()),
    Case("two-group, 3 chunks", TWO_GROUP_LAYOUT, (16, 16, 8), frozenset({"attention"})),
    Case("K3, 1 chunk, decode node without the fix", K3_LAYOUT, (12,), frozenset(), fork_peer=True),
)


class ProbeSetupError(Exception):
    """The tree's code is not in a shape this probe can drive (a reason, not a routing result)."""


@dataclass
class Route:
    """What one layer's transfer plan would write: its block ids on both nodes."""

    local: list[int]
    remote: list[int]
    computed_by: str | None  # the layer whose offsets call produced these; None: not recorded


@dataclass
class Drive:
    """One request through the tree's WRITE path."""

    saves: list[int] = field(default_factory=list)  # chunks at which the save left
    steps: list[str] = field(default_factory=list)  # per chunk: tokens, blocks, held or sent
    messages: int = 0
    routes: dict[str, Route] = field(default_factory=dict)  # of the (first) save
    errors: dict[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Entry point


def probe_routing() -> ProbeOutcome | None:
    connector = importlib.import_module(CONNECTOR)
    if hasattr(connector, "_split_kv_cache_group_kinds"):
        return probe_upstream(connector)
    if not hasattr(connector.MoRIIOConnectorScheduler, "update_state_after_alloc"):
        return None
    return probe_fork()


def probe_fork() -> ProbeOutcome:
    checks: list[str] = []
    summaries: list[str] = []
    for case in CASES:
        try:
            drive = drive_write(case)
        except ProbeSetupError as exc:
            summaries.append(f"{case.label}: cannot drive this tree: {exc}")
            continue
        got, bad = check_case(case, drive)
        checks += got
        checks += [f"FAIL {case.label}: {line}" for line in bad]
        if bad:
            summaries.append(_case_summary(case, bad))
    if summaries:
        return ProbeOutcome(False, "; ".join(summaries), tuple(checks))
    return ProbeOutcome(
        True,
        "every layer's KV goes to its own KV-cache group's blocks, all chunks', on both nodes "
        f"(K3: KDA -> groups 0-2, MLA -> group 3; two groups as before; {len(checks)} checks)",
        tuple(checks),
    )


def _case_summary(case: Case, failures: list[str]) -> str:
    """One line per case: what failed outright, then the first misrouted layer of each group
    (the other layers of a group fail the same way; the checks list them all)."""
    import re

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


# ---------------------------------------------------------------------------------------------
# Judging a drive


def check_case(case: Case, drive: Drive) -> tuple[list[str], list[str]]:
    """(checks, failures): a check line per layer; a failure per misrouted layer (starting with
    its name), naming the blocks it would write and the ones it should, or per case."""
    label = case.label
    final = len(case.chunks)
    steps = [f"{label}: prefill " + "; ".join(drive.steps)]
    if not drive.saves:
        if case.gate_may_hold:
            return [
                *steps,
                f"{label}: not exercised, the save never left the prefill scheduler (its "
                "final-chunk gate is moriio-chunk-gate's; the growing case covers chunks)",
            ], []
        return steps, [f"the save never left the prefill scheduler in {final} chunks"]
    failures: list[str] = []
    if drive.saves != [final]:
        failures.append(
            f"the save left at chunk(s) {drive.saves} of {final}, expected once at chunk {final}"
        )
    if drive.messages != 1:
        failures.append(f"decode sent {drive.messages} notify messages, expected 1")
        return steps, failures
    local = case.all_prefill_blocks()
    remote = case.decode_blocks()
    checks = steps
    for layer, g in case.group_of().items():
        kind = {"mamba": "KDA", "mla": "MLA"}.get(case.layout[g][0], case.layout[g][0])
        head = f"{layer} ({kind} group {g})"
        if layer in drive.errors:
            if case.fork_peer:
                checks.append(f"{label}: {head} refused: {drive.errors[layer]}")
            else:
                failures.append(f"{head}: {drive.errors[layer]}")
            continue
        route = drive.routes.get(layer)
        if route is None:
            failures.append(f"{head}: no transfer planned")
            continue
        line = f"{head}: local {route.local} -> remote {route.remote}"
        if route.computed_by not in (None, layer):
            line += f" (offsets reused from {route.computed_by})"
        checks.append(f"{label} @chunk {drive.saves[0]}: {line}")
        if route.local != local[g] or route.remote != remote[g]:
            whose = _whose(route, g, local[g], remote[g])
            silently = "silently " if case.fork_peer else ""
            failures.append(
                f"{line}, {silently}{whose}; expected local {local[g]} -> remote {remote[g]}"
                + (" or a refusal" if case.fork_peer else "")
            )
    return checks, failures


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


# ---------------------------------------------------------------------------------------------
# Driving the tree's code


def drive_write(case: Case) -> Drive:
    import threading
    import types
    import weakref
    from collections import OrderedDict

    common = importlib.import_module(COMMON)
    connector = importlib.import_module(CONNECTOR)
    engine = importlib.import_module(ENGINE)
    kv_cache_config = _kv_cache_config(case.layout)
    drive = Drive()
    saved_role = common.get_role()
    try:
        # 1. Prefill scheduler: allocation at chunk 1, then one build_connector_meta per chunk.
        prefill = connector.MoRIIOConnectorScheduler(_vllm_config("kv_producer"), "prefill")
        request = _request("req-prefill", case.prompt, _side_params("decode"))
        prefill.update_state_after_alloc(request, _blocks(case.prefill_blocks(1)), 0)
        meta = None
        for chunk, scheduled in enumerate(case.chunks, start=1):
            new = None if chunk == 1 else case.prefill_blocks(chunk)
            step = prefill.build_connector_meta(_scheduler_output(request, scheduled, new))
            request.num_computed_tokens += scheduled
            sent = request.request_id in step.reqs_to_save
            drive.steps.append(
                f"chunk {chunk} ({scheduled} tokens, blocks {case.prefill_blocks(chunk)}): "
                + ("save sent" if sent else "held")
            )
            if sent:
                drive.saves.append(chunk)
                meta = meta or step.reqs_to_save[request.request_id]
        if meta is None:
            return drive

        # 2. Decode scheduler: its allocation makes it tell the prefill node where to write.
        decode = connector.MoRIIOConnectorScheduler(_vllm_config("kv_consumer"), "decode")
        socket = _Socket()
        decode.paths = _AnyPath(socket)
        decode_request = _request("req-decode", case.prompt, _side_params("prefill"))
        decode.update_state_after_alloc(decode_request, _blocks(case.decode_blocks()), case.prompt)
        drive.messages = len(socket.sent)
        if drive.messages != 1:
            return drive

        # 3. Prefill node: the notify listener stores where decode wants the KV.
        common.set_role(common.ROLE.PRODUCER)
        wrapper = object.__new__(engine.MoRIIOWrapper)
        wrapper.lock = threading.Lock()
        wrapper.done_remote_allocate_req_dict = {}
        wrapper.done_req_ids = []
        wrapper.done_write_cache_req_ids = []
        wrapper._terminal_transfer_ids = OrderedDict()
        wrapper.paths = {}  # read when the worker is collected (its __del__ shuts it down)
        wrapper._handle_message(_fork_notify(engine, case) if case.fork_peer else socket.sent[0])
        request_info = wrapper.done_remote_allocate_req_dict[TRANSFER_ID]

        # 4. Prefill worker: its own layer maps, then one write task per layer.
        worker = object.__new__(connector.MoRIIOConnectorWorker)
        vllm_config = _vllm_config("kv_producer")
        worker.vllm_config = vllm_config
        worker.kv_transfer_config = vllm_config.kv_transfer_config
        worker.is_producer = True
        worker.mode = common.MoRIIOMode.WRITE
        _run_worker_maps(connector, worker, vllm_config, kv_cache_config)
        layers = [name for _, names in case.layout for name in names]
        worker.kv_caches = _kv_caches(case.layout)
        worker.layer_name_to_local_kv_cache_metadata = {name: [b""] for name in layers}
        worker.moriio_wrapper = wrapper
        tasks: list[Any] = []
        worker._writer = types.SimpleNamespace(schedule_write=tasks.append)
        # Offsets lists by identity -> the layer whose call made them; `made` keeps them alive
        # so no identity is reused while a plan can still return them.
        made: list[list[int]] = []
        recorded: dict[int, str] = {}

        def offsets(layer: str, local: Any, remote: Any, *args: Any, **kw: Any) -> Any:
            local_ids, remote_ids = list(local), list(remote)
            made.append(local_ids)
            recorded[id(local_ids)] = layer
            return local_ids, remote_ids, [1] * len(local_ids)

        worker._compute_block_transfer_offsets = offsets
        with Swap() as swap:
            _stand_in_cuda(swap, connector)
            for name in layers:
                worker._write_blocks_for_req(request.request_id, meta, name, None)

        # 5. The writer's plan for every layer.
        writer = object.__new__(engine.MoRIIOWriter)
        writer._worker_ref = weakref.ref(worker)
        remote_meta = types.SimpleNamespace(
            engine_id="decode", num_blocks=4096, block_len=1, kv_caches_base_addr=[0]
        )
        for task in tasks:
            try:
                plan = writer._prepare_transfer_plan(task, request_info, remote_meta)
            except Exception as exc:  # reported per layer, never swallowed
                drive.errors[task.layer_name] = f"{type(exc).__name__}: {exc}"
                continue
            local_off = plan.transfer_local_offsets
            drive.routes[task.layer_name] = Route(
                list(local_off), list(plan.transfer_remote_offsets), recorded.get(id(local_off))
            )
        return drive
    finally:
        common.set_role(saved_role)


def _fork_notify(engine: Any, case: Case) -> bytes:
    """The notify an unfixed fork decode node sends for `case`: the keys of the fork's
    `send_notify_block`, group 0's blocks as `block_notify_list`, group 1's as the Mamba list."""
    blocks = case.decode_blocks()
    message = {
        "req_id": "req-decode",
        "transfer_id": TRANSFER_ID,
        "block_notify_list": blocks[0],
        "mamba_block_notify_list": blocks[1] if len(blocks) > 1 else [],
        "decode_rank": 0,
        "type": "remote_blocks",
    }
    data: bytes = engine.msgpack.dumps(message)
    return data


def _run_worker_maps(connector: Any, worker: Any, vllm_config: Any, kv_cache_config: Any) -> None:
    """Run the statements of the tree's `MoRIIOConnectorWorker.__init__` that map layers to
    specs and groups: from `self.layer_to_spec = ...` up to `if self.is_producer:`. The rest of
    `__init__` needs a GPU, the MoRIIO library and a network; this run is the tree's own text,
    so a patch that builds its map there (k3patch's, the older script's) is what gets tested."""
    import ast
    import inspect
    import textwrap

    init = connector.MoRIIOConnectorWorker.__init__
    try:
        lines, first = inspect.getsourcelines(init)
        filename = inspect.getsourcefile(init) or "<worker>"
    except (OSError, TypeError) as exc:
        raise ProbeSetupError(f"MoRIIOConnectorWorker.__init__ has no source ({exc})") from None
    func = ast.parse(textwrap.dedent("".join(lines))).body[0]
    assert isinstance(func, ast.FunctionDef)
    body = func.body
    start = next(
        (
            i
            for i, stmt in enumerate(body)
            if isinstance(stmt, ast.Assign)
            and [ast.unparse(t) for t in stmt.targets] == ["self.layer_to_spec"]
        ),
        None,
    )
    if start is None:
        raise ProbeSetupError("MoRIIOConnectorWorker.__init__ sets no self.layer_to_spec")
    end = next(
        (
            i
            for i, stmt in enumerate(body[start:], start)
            if isinstance(stmt, ast.If) and ast.unparse(stmt.test) == "self.is_producer"
        ),
        None,
    )
    if end is None:
        raise ProbeSetupError(
            "MoRIIOConnectorWorker.__init__ has no `if self.is_producer:` after layer_to_spec"
        )
    func.name = "_k3patch_probe_worker_maps"
    func.body = body[start:end]
    func.decorator_list = []
    module = ast.Module(body=[func], type_ignores=[])
    ast.increment_lineno(module, first - 1)  # tracebacks point into the tree's file
    ast.fix_missing_locations(module)
    namespace = dict(vars(connector))
    exec(compile(module, filename, "exec"), namespace)
    namespace["_k3patch_probe_worker_maps"](worker, vllm_config, "prefill", kv_cache_config)


def _kv_cache_config(layout: Layout) -> Any:
    import types

    specs = importlib.import_module("vllm.v1.kv_cache_interface")
    torch = importlib.import_module("torch")

    def spec(kind: str) -> Any:
        try:
            if kind == "mamba":
                return specs.MambaSpec(
                    block_size=BLOCK_SIZE, shapes=((4,), (8,)), dtypes=(torch.float32,) * 2
                )
            cls = specs.MLAAttentionSpec if kind == "mla" else specs.FullAttentionSpec
            return cls(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.bfloat16)
        except TypeError:  # another version's fields: only the class is read here
            cls = {
                "mamba": specs.MambaSpec,
                "mla": specs.MLAAttentionSpec,
                "attention": specs.FullAttentionSpec,
            }[kind]
            return object.__new__(cls)

    groups = [specs.KVCacheGroupSpec(layer_names=list(n), kv_cache_spec=spec(k)) for k, n in layout]
    try:
        return specs.KVCacheConfig(num_blocks=4096, kv_cache_tensors=[], kv_cache_groups=groups)
    except TypeError:
        return types.SimpleNamespace(kv_cache_groups=groups, kv_cache_tensors=[], num_blocks=4096)


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


def _vllm_config(role: str) -> Any:
    import types

    extra = {
        "handshake_port": "6301",
        "notify_port": "61005",
        "http_port": "8000",
        "host_ip": "127.0.0.1",
        "proxy_ip": "",
        "read_mode": "false",
    }
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(
            kv_role=role,
            kv_connector_extra_config=extra,
            is_kv_producer=role == "kv_producer",
            is_kv_consumer=role == "kv_consumer",
        ),
        cache_config=types.SimpleNamespace(block_size=BLOCK_SIZE),
        parallel_config=types.SimpleNamespace(
            tensor_parallel_size=1,
            data_parallel_rank=0,
            data_parallel_size=1,
            data_parallel_size_local=1,
        ),
    )


def _side_params(remote: str) -> dict[str, Any]:
    """kv_transfer_params of a request whose KV goes to (remote "decode") or comes from
    (remote "prefill") the other node."""
    params: dict[str, Any] = {
        "do_remote_decode" if remote == "decode" else "do_remote_prefill": True,
        "transfer_id": TRANSFER_ID,
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


def _request(request_id: str, prompt: int, params: dict[str, Any]) -> Any:
    import types

    return types.SimpleNamespace(
        request_id=request_id,
        req_id=request_id,
        kv_transfer_params=params,
        num_prompt_tokens=prompt,
        num_computed_tokens=0,
        num_tokens=prompt,
        prompt_token_ids=list(range(prompt)),
    )


def _blocks(per_group: list[list[int]]) -> Any:
    import types

    return types.SimpleNamespace(get_block_ids=lambda *a, **k: tuple(list(g) for g in per_group))


def _scheduler_output(request: Any, scheduled: int, new_blocks: list[list[int]] | None) -> Any:
    """The step's SchedulerOutput as bCM reads it: the request is new at chunk 1 (`new_blocks`
    None), a cached request with the blocks this chunk allocated afterwards."""
    import types

    cached = new_blocks is not None
    # vLLM sends None, not a tuple of empty lists, when no group allocated a block this step.
    new_ids = tuple(new_blocks) if new_blocks is not None and any(new_blocks) else None
    return types.SimpleNamespace(
        scheduled_cached_reqs=types.SimpleNamespace(
            req_ids=[request.request_id] if cached else [],
            new_block_ids=[new_ids] if cached else [],
            num_computed_tokens=[request.num_computed_tokens] if cached else [],
            resumed_req_ids=set(),
            resumed_from_preemption=[False] if cached else [],
        ),
        scheduled_new_reqs=[] if cached else [request],
        num_scheduled_tokens={request.request_id: scheduled},
        total_num_scheduled_tokens=scheduled,
        finished_req_ids=set(),
        new_block_ids_to_zero=None,
    )


class _Socket:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)


class _AnyPath(dict):  # type: ignore[type-arg]
    """`self.paths` of a scheduler: every notify path is already open, on the recorder."""

    def __init__(self, socket: _Socket) -> None:
        super().__init__()
        self.socket = socket

    def __contains__(self, key: object) -> bool:
        return True

    def __getitem__(self, key: object) -> _Socket:
        return self.socket


def _stand_in_cuda(swap: Swap, module: Any) -> None:
    """schedule_write_blocks records a CUDA event; without a GPU the connector module's `torch`
    is replaced, for the drive, by an object that only has that event."""
    import types

    if "torch" not in module.__dict__:
        return
    event = types.SimpleNamespace(record=lambda *a: None, synchronize=lambda: None)
    cuda = types.SimpleNamespace(current_stream=lambda: None, Event=lambda *a, **k: event)
    swap.attr(module, "torch", types.SimpleNamespace(cuda=cuda))


# ---------------------------------------------------------------------------------------------
# Upstream 0.31.0+ (satisfied natively): upstream's own split and plan, with K3's groups. These
# checks keep the layer names and block numbers they had before the fork drive was written
# (group g's block 10g+1, decode 100 more), so their check lines read as they always did.

UPSTREAM_LAYOUT: Layout = (
    ("mamba", ("model.layers.0.kda", "model.layers.3.kda")),
    ("mamba", ("model.layers.1.kda", "model.layers.4.kda")),
    ("mamba", ("model.layers.2.kda", "model.layers.5.kda")),
    ("mla", ("model.layers.6.mla", "model.layers.7.mla")),
)


def probe_upstream(connector: Any) -> ProbeOutcome:
    import types

    specs = importlib.import_module("vllm.v1.kv_cache_interface")

    def spec(kind: str) -> Any:
        return object.__new__(specs.MambaSpec if kind == "mamba" else specs.MLAAttentionSpec)

    checks: list[str] = []
    try:
        # The real config class, so the worker's map comes from upstream's own property.
        config: Any = specs.KVCacheConfig(
            num_blocks=4096,
            kv_cache_tensors=[],
            kv_cache_groups=[
                specs.KVCacheGroupSpec(layer_names=list(names), kv_cache_spec=spec(kind))
                for kind, names in UPSTREAM_LAYOUT
            ],
        )
        layer_to_group = dict(config.transfer_group_index_by_layer)
    except (TypeError, AttributeError) as exc:
        checks.append(f"KVCacheConfig could not be built here ({exc}); using a stand-in")
        groups = [
            types.SimpleNamespace(
                layer_names=list(n), kv_cache_spec=spec(k), enable_kv_transfer=True
            )
            for k, n in UPSTREAM_LAYOUT
        ]
        config = types.SimpleNamespace(kv_cache_groups=groups, transfer_groups=tuple(groups))
        layer_to_group = {n: i for i, g in enumerate(groups) for n in g.layer_names}
    failures: list[str] = []
    split = connector._split_kv_cache_group_kinds(config)
    line = f"K3: _split_kv_cache_group_kinds -> attention {split[0]}, mamba {split[1]}"
    checks.append(line)
    if [list(part) for part in split] != [[3], [0, 1, 2]]:
        failures.append(f"{line}, expected attention [3], mamba [0, 1, 2]")
    engine = importlib.import_module(ENGINE)
    if _plan_indexes_layer_group(engine):
        checks += _probe_upstream_plan(engine, layer_to_group, failures)
        checks.append("KDA layers take upstream's separate Mamba plan (not exercised here)")
    else:
        checks.append(
            "WRITE with a Mamba group is refused by register_kv_caches on this version; "
            "its per-layer WRITE plan is single-group and was not exercised"
        )
    if failures:
        return ProbeOutcome(False, "; ".join(failures[:4]), tuple(checks))
    return ProbeOutcome(True, "upstream routes K3's groups by spec, natively", tuple(checks))


def _plan_indexes_layer_group(engine: Any) -> bool:
    import inspect

    try:
        source = inspect.getsource(engine.MoRIIOWriter._prepare_transfer_plan)
    except (OSError, TypeError):
        return False
    return "self.worker.layer_to_group[task.layer_name]" in source


def _probe_upstream_plan(
    engine: Any, layer_to_group: dict[str, int], failures: list[str]
) -> list[str]:
    """0.33.0+: MoRIIOWriter._prepare_transfer_plan for K3's MLA layers."""
    import types
    import weakref

    common = importlib.import_module(COMMON)
    mla = len(UPSTREAM_LAYOUT) - 1
    local = [[10 * g + 1] for g in range(len(UPSTREAM_LAYOUT))]
    local[mla] = [10 * mla + 1, 10 * mla + 2]
    remote = [[100 + b for b in blocks] for blocks in local]
    given: dict[str, tuple[list[int], list[int]]] = {}

    def offsets(layer: str, local_ids: Any, remote_ids: Any, *args: Any, **kw: Any) -> Any:
        given[layer] = (list(local_ids), list(remote_ids))
        return [0], [0], [1]

    worker = _WeakHolder(
        kv_caches={name: _Cache() for name in layer_to_group},
        layer_to_group=layer_to_group,
        _has_mamba=True,
        _check_peer_block_size=lambda *a, **k: None,
        _compute_block_transfer_offsets=offsets,
        _region_session_indices=lambda layer: [0],
    )
    writer = object.__new__(engine.MoRIIOWriter)
    writer._worker_ref = weakref.ref(worker)
    checks = []
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
            writer._prepare_transfer_plan(task, info, types.SimpleNamespace(num_blocks=4096))
        except Exception as exc:  # reported, never swallowed
            failures.append(f"K3 upstream plan for {layer}: {type(exc).__name__}: {exc}")
            continue
        got = given.get(layer)
        line = (
            f"K3 upstream plan: {layer} (group {layer_to_group.get(layer)}) -> "
            f"local {got and got[0]} remote {got and got[1]}"
        )
        checks.append(line)
        if got != (local[mla], remote[mla]):
            failures.append(f"{line}, expected local {local[mla]} remote {remote[mla]}")
    return checks


class _Cache:
    shape = (1,)
    dtype = "probe"

    def stride(self) -> tuple[int, ...]:
        return (1,)


class _WeakHolder:
    """A weak-referenceable stand-in for the worker (the writer holds its worker weakly, and a
    SimpleNamespace cannot be weakly referenced)."""

    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)
