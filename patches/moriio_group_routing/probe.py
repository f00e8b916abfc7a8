"""moriio-group-routing's probe: the tree's own MoRIIO WRITE path on CPU in the verify child (no
GPU, MoRIIO library or network). On a fork tree a request goes through the prefill scheduler
chunk by chunk, the decode node's notify, the prefill node's `_handle_message`, the worker's own
layer maps of `__init__` and `_prepare_transfer_plan` per layer. The offsets call returns the
block ids themselves, so each plan says which blocks it writes, also with offsets another layer
computed (0.28.0 caches them by tensor geometry, which K3's KDA groups share). Prefill block ids
are `100 * (group + 1) + chunk`, decode ones 1000 more: `402` is MLA group 3's block of chunk 2.
On upstream 0.31.0+ it checks the group split and, 0.33.0+, the MLA plan.
"""

from __future__ import annotations

import importlib
import inspect
import weakref
from dataclasses import dataclass
from typing import Any

from k3patch import probekit
from k3patch.patch import ProbeOutcome
from k3patch.probekit import Checks, Stub, Swap, stand_in
from k3patch.shapes import find_expressions, match

from .batches import (
    ATTENTION_LAYOUT,
    K3_LAYOUT,
    KIND_NAMES,
    TWO_ATTENTION_LAYOUT,
    TWO_GROUP_LAYOUT,
    Route,
    _layout,
    listener,
    probe_batches,
    write_layers,
)
from .forms import FIELD_NAME
from .resumes import probe_resumes
from .standins import (
    COMMON,
    CONNECTOR,
    ENGINE,
    TRANSFER_ID,
    Layout,
    ProbeSetupError,
    block_ids,
    drive_prefill,
    finish_request,
    kv_cache_config,
    kv_params,
    prefill_worker,
    stub_request,
    stub_vllm_config,
)

PATCH_ID = "moriio-group-routing"
DECODE_OFFSET = 1000
# No attention group at all: MoRIIO WRITE has no group to route attention KV by.
ALL_MAMBA_LAYOUT = _layout(("mamba", (0, 2)), ("mamba", (1, 3)))
# Upstream's checks keep their own layer names and block numbers (group g's 10g+1, decode 100 more).
UPSTREAM_LAYOUT = _layout(("mamba", (0, 3)), ("mamba", (1, 4)), ("mamba", (2, 5)), ("mla", (6, 7)))
# Per-request state the recipe's older scripts add and never remove (nor does k3patch: revert is
# exact): a note on every fork tree; any other entry left behind is a failure.
OLDER_SCRIPT_LEAKS = {
    "_reqs_save_mamba": "apply_kimik3_moriio_mamba_blockids.py",
    "_reqs_save_allgrp": "apply_kimik3_moriio_group_routing.py",
    "_k3_prog": "apply_kimik3_chunk_gate_fix.py",
}


@dataclass(frozen=True)
class Case:
    """One request: its layout, prefill chunks (tokens each), the kinds whose groups gain a block
    at every later chunk. `gate_may_hold`: a block-count chunk gate (the fork's counts group 0,
    a KDA group that never grows) may hold the save forever: not exercised, no routing failure.
    `one_sided`: the side without the fix, which the MoRIIOError refusing every layer must name
    (UNFIXED_DECODE sends the fork's lists [0] and [1] only; UNFIXED_PREFILL's save has no
    per-group lists). Not `external`: decode computes the whole prompt itself (a full prefix-cache
    hit) and tells the prefill node once, naming no block."""

    label: str
    layout: Layout
    chunks: tuple[int, ...]
    growing: tuple[str, ...] = ()
    gate_may_hold: bool = False
    one_sided: str | None = None
    external: bool = True

    def prefill_blocks(self, *chunks: int) -> list[list[int]]:
        """Each group's blocks allocated at `chunks` (1-based; none given: at every chunk)."""
        every = chunks or range(1, len(self.chunks) + 1)
        return [
            [100 * (g + 1) + c for c in every if c == 1 or kind in self.growing]
            for g, (kind, _) in enumerate(self.layout)
        ]

    def decode_blocks(self) -> list[list[int]]:
        """The decode node allocates the whole prompt at once, a block per prefill block."""
        return [[DECODE_OFFSET + b for b in g] for g in self.prefill_blocks()]


ONE, THREE = (12,), (16, 16, 8)
UNFIXED_DECODE, UNFIXED_PREFILL = "the decode node", "the prefill scheduler"
CASES = (
    Case("K3, 1 chunk", K3_LAYOUT, ONE),
    # Without prefix caching a KDA group holds one state block per request; only MLA grows.
    Case("K3, 3 chunks", K3_LAYOUT, THREE, ("mla",), gate_may_hold=True),
    # Every group grows (Mamba prefix caching): even a group-0 block-count gate sends at the end.
    Case("K3, 3 chunks, every group grows", K3_LAYOUT, THREE, ("mamba", "mla")),
    Case("two-group, 1 chunk", TWO_GROUP_LAYOUT, ONE),
    Case("two-group, 3 chunks", TWO_GROUP_LAYOUT, THREE, ("attention",)),
    Case("K3, 1 chunk, decode node without the fix", K3_LAYOUT, ONE, one_sided=UNFIXED_DECODE),
    Case(
        "K3, 1 chunk, prefill scheduler without the fix", K3_LAYOUT, ONE, one_sided=UNFIXED_PREFILL
    ),
    # One attention group: the fork's [0] is right (the older fix alone drops later chunks).
    Case("attention only, 1 chunk", ATTENTION_LAYOUT, ONE),
    Case("attention only, 3 chunks", ATTENTION_LAYOUT, THREE, ("attention",)),
    Case("two attention groups, 1 chunk", TWO_ATTENTION_LAYOUT, ONE),
    Case("two attention groups, 3 chunks", TWO_ATTENTION_LAYOUT, THREE, ("attention", "sliding")),
    # Decode names no block: a fix that sends its lists regardless overwrites cached KV.
    Case("K3, 1 chunk, decode without external tokens", K3_LAYOUT, ONE, external=False),
    Case(
        "attention only, 1 chunk, decode without external tokens",
        ATTENTION_LAYOUT,
        ONE,
        external=False,
    ),
)
Failures = list[tuple[int | None, str]]  # (the misrouted layer's group, or None: the case's)


def probe_routing() -> ProbeOutcome | None:
    connector = importlib.import_module(CONNECTOR)
    if hasattr(connector, "_split_kv_cache_group_kinds"):
        return probe_upstream(connector)
    if not hasattr(connector.MoRIIOConnectorScheduler, "update_state_after_alloc"):
        return None
    checks = Checks("routing")
    for case in CASES:
        try:
            failures = judge(case, drive_write(case), checks)
        except ProbeSetupError as exc:
            checks.fail(f"{case.label}: cannot drive this tree: {exc}")
            continue
        # What failed outright, then each group's first misrouted layer (the others alike).
        first: dict[int, str] = {}
        for group, failure in failures:
            checks.note(f"FAIL {case.label}: {failure}")
            if group is not None:
                first.setdefault(group, failure)
        parts = [failure for group, failure in failures if group is None]
        if first:
            layers = sum(len(names) for _, names in case.layout)
            parts.append(
                f"{len(failures) - len(parts)} of {layers} layers misrouted, in group(s) "
                f"{', '.join(map(str, first))}: " + "; ".join(first.values())
            )
        if failures:
            checks.fail(f"{case.label}: " + "; ".join(parts))
    _check_all_mamba(connector, checks)
    probe_batches(checks)
    probe_resumes(checks)
    return checks.outcome(
        holds="every layer's KV goes to its own KV-cache group's blocks, all chunks', on both "
        "nodes (K3: KDA -> groups 0-2, MLA -> group 3; two groups as before; models without a "
        "Mamba group; no block named without external tokens; no per-request state left "
        "behind; each save's group lists its blocks once, a request resumed after preemption "
        "too; {ran} checks)",
        broken="{failures}",
    )


def judge(case: Case, drive: Any, checks: Checks) -> Failures:
    """Records the prefill's check line and one per layer; returns the failures: per misrouted
    layer the blocks it would write and those it should, per case what went wrong."""
    label, final = case.label, len(case.chunks)
    steps = [
        f"chunk {c} ({tokens} tokens, blocks {case.prefill_blocks(c)}): "
        + ("save sent" if c in drive.saves else "held")
        for c, tokens in enumerate(case.chunks, 1)
    ]
    checks.record(f"{label}: prefill " + "; ".join(steps))
    if not drive.saves and case.gate_may_hold:
        checks.record(
            f"{label}: not exercised, the save never left the prefill scheduler (its "
            "final-chunk gate is moriio-chunk-gate's; the growing case covers chunks)"
        )
        return []
    if not drive.saves:
        return [(None, f"the save never left the prefill scheduler in {final} chunks")]
    failures: Failures = []
    if drive.saves != [final]:
        left = f"the save left at chunk(s) {drive.saves} of {final}, expected once at chunk {final}"
        failures.append((None, left))
    older = [leak for leak in drive.leaks if leak.rsplit(" ", 1)[1] in OLDER_SCRIPT_LEAKS]
    leaks = [leak for leak in drive.leaks if leak not in older]
    if older:
        scripts = sorted({OLDER_SCRIPT_LEAKS[leak.rsplit(" ", 1)[1]] for leak in older})
        checks.note(
            f"{label}: left by the older scripts ({', '.join(scripts)}): {', '.join(older)}"
        )
    line = f"{label}: per-request state once both requests finished: {', '.join(leaks) or 'none'}"
    if not checks.record(line, not leaks):
        failures.append((None, f"a leak per request: {', '.join(leaks)} still hold(s) it"))
    if drive.messages != 1:
        return [*failures, (None, f"decode sent {drive.messages} notify messages, expected 1")]
    if not case.external:
        return failures + _judge_nothing_to_write(case, drive, checks)
    local, remote, side = case.prefill_blocks(), case.decode_blocks(), case.one_sided
    for g, (kind, names) in enumerate(case.layout):
        for layer in names:
            head = f"{layer} ({KIND_NAMES.get(kind, kind)} group {g})"
            error = drive.errors.get(layer)
            if error and side and _names_missing_fix(error, side):
                checks.record(f"{label}: {head} refused: {error}")
            elif error and side:
                named = f"expected MoRIIOError: ... from {side}; both nodes need k3patch {PATCH_ID}"
                failures.append((g, f"{head}: refused by {error}, {named}"))
            elif error or layer not in drive.routes:
                failures.append((g, f"{head}: {error or 'no transfer planned'}"))
            else:
                got, by = drive.routes[layer]
                line = f"{head}: local {got[0]} -> remote {got[1]}"
                line += f" (offsets reused from {by})" if by not in (None, layer) else ""
                checks.record(f"{label} @chunk {drive.saves[0]}: {line}")
                silently, refusal = ("silently ", " or a refusal") if side else ("", "")
                want = (local[g], remote[g])
                expected = f"expected local {want[0]} -> remote {want[1]}{refusal}"
                if got != want:
                    failures.append((g, f"{line}, {silently}{_whose(got, g, want)}; {expected}"))
    return failures


def _names_missing_fix(error: str, side: str) -> bool:
    """Whether `error` (from probekit.attempt) is the refusal naming `side` as without the fix."""
    return error.startswith("MoRIIOError: ") and f"from {side};" in error and PATCH_ID in error


def _check_all_mamba(connector: Any, checks: Checks) -> None:
    """Every group a MambaSpec: the worker's layer maps must refuse, not take one for attention."""
    head = "every group Mamba (no attention group): the worker's layer maps"
    _, error = probekit.attempt(prefill_worker, connector, ALL_MAMBA_LAYOUT)
    refused = error is not None and error.startswith("ValueError: ") and "attention" in error
    line = f"{head} refuse: {error}" if refused else f"{head}: {error or 'built without a word'}"
    checks.record(line, refused, f"{line}, expected a ValueError naming the attention group")


def _judge_nothing_to_write(case: Case, drive: Any, checks: Checks) -> Failures:
    """Decode computed the whole prompt itself: its notify names no block, the prefill node none."""
    named = sorted(_block_ids_in(drive.notify))
    what = f"decode's notify names blocks {named}"
    failures: Failures = []
    if not checks.record(f"{case.label}: {what}", not named):
        failures.append((None, f"{what}, expected none (no external tokens)"))
    written = {layer: route for layer, (route, _) in drive.routes.items() if route != ([], [])}
    if drive.refused is not None:
        checks.record(f"{case.label}: the prefill node writes nothing ({drive.refused})")
    elif written or drive.errors:
        for layer, (local, remote) in written.items():
            failures.append((None, f"{layer} writes local {local} -> remote {remote}"))
        for layer, error in drive.errors.items():
            failures.append((None, f"{layer}: {error}"))
    else:
        checks.record(f"{case.label}: the prefill node plans empty writes only")
    return failures


def _block_ids_in(message: Any) -> set[int]:
    """Every block id a notify message names: the numbers of its list values, nested too."""
    found: set[int] = set()
    values = list(message.values()) if isinstance(message, dict) else []
    while values:
        value = values.pop()
        if isinstance(value, list):
            values += value
        elif isinstance(value, int) and not isinstance(value, bool) and value >= 100:
            found.add(value)
    return found


def _whose(got: Route, group: int, want: Route) -> str:
    """Whose blocks a route writes, by their numbers (group: hundreds digit, chunk: units)."""
    groups = sorted({(b % DECODE_OFFSET) // 100 - 1 for b in got[0] + got[1]})
    if groups != [group]:
        return "group(s) " + ", ".join(map(str, groups)) + "'s blocks"
    left_out = [
        f"its {side} blocks of chunk(s) {sorted({b % 100 for b in w if b not in g})} left out"
        for side, w, g in zip(("prefill", "decode"), want, got, strict=True)
        if not set(w) <= set(g)
    ]
    return ", ".join(left_out) or "its own group's blocks, not as allocated"


def drive_write(case: Case) -> Stub:
    """One request through the tree's WRITE path: the chunks at which the save left (`saves`),
    decode's notify `messages` and the one it sent (`notify`), what each scheduler still holds of
    the request once it finished (`leaks`), why the prefill node took no remote allocation
    (`refused`), and per layer of the first save its route and the layer whose offsets call made
    it, None: not recorded (`routes`), or its error (`errors`)."""
    common, connector, engine = map(importlib.import_module, (COMMON, CONNECTOR, ENGINE))
    drive = Stub(saves=[], messages=0, notify=None, leaks=[], refused=None, routes={}, errors={})
    prompt = sum(case.chunks)
    with Swap() as swap:
        swap.on_exit(common.set_role, common.get_role())
        # 1. Prefill scheduler: allocation at chunk 1, then build_connector_meta per chunk.
        prefill = connector.MoRIIOConnectorScheduler(stub_vllm_config("kv_producer"), "prefill")
        request = stub_request("req-prefill", prompt, kv_params("decode"))
        steps = [(tokens, case.prefill_blocks(c)) for c, tokens in enumerate(case.chunks, 1)]
        sent = drive_prefill(prefill, [(request, steps)])
        drive.saves = [c for c, saves in enumerate(sent, 1) if request.request_id in saves]
        if not drive.saves:
            return drive
        meta = sent[drive.saves[0] - 1][request.request_id]

        # 2. Decode scheduler: its allocation makes it tell the prefill node where to write.
        decode = connector.MoRIIOConnectorScheduler(stub_vllm_config("kv_consumer"), "decode")
        notified: list[bytes] = []
        decode.paths = probekit.Always(Stub(send=notified.append))  # every notify path is open
        decode_request = stub_request("req-decode", prompt, kv_params("prefill"))
        decode_blocks = block_ids(case.decode_blocks())
        decode.update_state_after_alloc(decode_request, decode_blocks, prompt * case.external)
        drive.messages = len(notified)
        # Both requests end (the prefill one's KV sent, the decode one's generation done).
        for node, scheduler, req, blocks in (
            ("prefill", prefill, request, case.prefill_blocks()),
            ("decode", decode, decode_request, case.decode_blocks()),
        ):
            held = finish_request(scheduler, req, blocks[0])
            drive.leaks += [f"{node} scheduler's {name}" for name in held]
        if drive.messages != 1:
            return drive
        drive.notify = engine.msgpack.loads(notified[0])

        # 3. Prefill node: the notify listener stores where decode wants the KV.
        common.set_role(common.ROLE.PRODUCER)
        wrapper = listener(engine)
        if case.one_sided == UNFIXED_DECODE:  # the keys of the unfixed fork's send_notify_block
            lists = case.decode_blocks()
            fork: dict[str, Any] = dict(req_id="req-decode", transfer_id=TRANSFER_ID, decode_rank=0)
            fork.update(block_notify_list=lists[0], type="remote_blocks")
            fork["mamba_block_notify_list"] = lists[1] if len(lists) > 1 else []
            notified[0] = engine.msgpack.dumps(fork)
        _, drive.refused = probekit.attempt(wrapper._handle_message, notified[0])
        info = wrapper.done_remote_allocate_req_dict.get(TRANSFER_ID)
        if info is None:
            drive.refused = drive.refused or "no remote allocation stored"
            return drive

        if case.one_sided == UNFIXED_PREFILL and hasattr(meta, FIELD_NAME):
            setattr(meta, FIELD_NAME, None)  # where the tree has per-group lists, none sent

        # 4. Prefill worker: its own layer maps, a write task per layer; 5. the writer's plans.
        at = write_layers(connector, engine, case.layout, wrapper, [(request.request_id, meta)])
        peer = Stub(engine_id="decode", num_blocks=4096, block_len=1, kv_caches_base_addr=[0])
        plan: Any
        for task in at.tasks:
            plan, error = probekit.attempt(at.writer._prepare_transfer_plan, task, info, peer)
            if error is not None:
                drive.errors[task.layer_name] = error
                continue
            ids = plan.transfer_local_offsets
            by = next((args[0] for args, _, answer in at.offsets.calls if answer[0] is ids), None)
            drive.routes[task.layer_name] = ((list(ids), list(plan.transfer_remote_offsets)), by)
    return drive


def probe_upstream(connector: Any) -> ProbeOutcome:
    """Upstream 0.31.0+ (satisfied natively): its split of K3's groups and, where its writer
    indexes per-group lists (0.33.0+), its plan for K3's MLA layers."""
    checks, holds = Checks("upstream"), "upstream routes K3's groups by spec, natively"
    try:  # the real config class, so the worker's map comes from upstream's own property
        config = kv_cache_config(UPSTREAM_LAYOUT, bare_specs=True)
        layer_to_group = dict(config.transfer_group_index_by_layer)
    except (TypeError, AttributeError) as exc:
        checks.note(f"KVCacheConfig could not be built here ({exc}); using a stand-in")
        config = kv_cache_config(UPSTREAM_LAYOUT, bare_specs=True, real=False)
        layer_to_group = {n: g for g, (_, names) in enumerate(UPSTREAM_LAYOUT) for n in names}
    # K3's, then the other layouts (must not break), with and without Mamba.
    for label, layout in (
        ("K3", UPSTREAM_LAYOUT),
        ("two-group", TWO_GROUP_LAYOUT),
        ("attention only", ATTENTION_LAYOUT),
        ("two attention groups", TWO_ATTENTION_LAYOUT),
    ):
        split = connector._split_kv_cache_group_kinds(
            config if label == "K3" else kv_cache_config(layout, bare_specs=True, real=False)
        )
        by_kind = [
            [g for g, (kind, _) in enumerate(layout) if (kind == "mamba") is m]
            for m in (False, True)
        ]
        line = f"{label}: _split_kv_cache_group_kinds -> attention {split[0]}, mamba {split[1]}"
        checks.record(line, [list(p) for p in split] == by_kind, f"{line}, expected {by_kind}")
    common, engine = importlib.import_module(COMMON), importlib.import_module(ENGINE)
    plan = probekit.source_of(engine.MoRIIOWriter._prepare_transfer_plan)
    if not (plan and any(find_expressions("self.worker.layer_to_group[task.layer_name]", plan))):
        checks.note(
            "WRITE with a Mamba group is refused by register_kv_caches on this version; "
            "its per-layer WRITE plan is single-group and was not exercised"
        )
        return checks.outcome(holds=holds, broken="{failures}")
    layer_to_group = _worker_layer_map(connector, config, layer_to_group, checks)
    for label, layout in (("K3", UPSTREAM_LAYOUT), ("two attention groups", TWO_ATTENTION_LAYOUT)):
        _drive_upstream_request(engine, common, label, layout, layer_to_group, checks)
    checks.note("KDA layers take upstream's separate Mamba plan (not exercised here)")
    return checks.outcome(holds=holds, broken="{failures}")


def _worker_layer_map(
    connector: Any, config: Any, fallback: dict[str, int], checks: Checks
) -> dict[str, int]:
    """The worker's own `self.layer_to_group = ...` (MoRIIOConnectorWorker.__init__) run on a
    stand-in, with K3's config; where there is no one such statement, `fallback` (a note)."""
    init = connector.MoRIIOConnectorWorker.__init__
    body = getattr(probekit.source_of(init), "body", None) or []
    found = [s for s in body if match("self.layer_to_group = HOLE_value", s) is not None]
    if len(found) != 1:
        checks.note(f"{len(found)} `self.layer_to_group = ...` in the worker: upstream's map used")
        return fallback
    names = list(inspect.signature(init).parameters)[1:]
    args = [config if name == "kv_cache_config" else None for name in names]
    holder = Stub()
    try:
        probekit.run_statements(init, found, holder, *args)
    except (AttributeError, TypeError) as exc:  # a stand-in config (noted above)
        checks.note(f"the worker's layer map could not run here ({exc!r}): upstream's map used")
        return fallback
    return dict(holder.layer_to_group)


def _drive_upstream_request(
    engine: Any, common: Any, label: str, layout: Layout, layer_map: dict[str, int], checks: Checks
) -> None:
    """One request's attention layers through the writer's plan, as the writer runs them: one
    RemoteAllocInfo for the whole request (its offsets cache shared by every layer), real
    tensors (the j-th layer of every group backed by one tensor, as vLLM's hybrid allocator
    shares them; one geometry for all), each group's own local blocks and the decode node's,
    which, with a Mamba group, hold one tail block more (for the token D recomputes)."""
    torch = importlib.import_module("torch")
    shared = [torch.empty((64, 16, 8), dtype=torch.bfloat16) for _ in range(8)]
    caches = {n: shared[j] for _, names in layout for j, n in enumerate(names)}
    has_mamba = any(kind == "mamba" for kind, _ in layout)
    local = [[10 * g + 1, 10 * g + 2] for g in range(len(layout))]
    tail = [[100 + 10 * g + 9] if has_mamba else [] for g in range(len(layout))]
    remote = [[100 + b for b in blocks] + tail[g] for g, blocks in enumerate(local)]
    offsets = probekit.Calls(lambda layer, lo, re, *a, **k: (list(lo), list(re), [1] * len(lo)))
    groups = {n: layer_map.get(n, g) for g, (_, names) in enumerate(layout) for n in names}
    if label != "K3":
        groups = {n: g for g, (_, names) in enumerate(layout) for n in names}
    worker = Stub(
        kv_caches=caches,
        layer_to_group=groups,
        _has_mamba=has_mamba,
        _check_peer_block_size=lambda *a, **k: None,
        _compute_block_transfer_offsets=offsets,
        _region_session_indices=lambda layer: [0],
    )
    writer = stand_in(engine.MoRIIOWriter, _worker_ref=weakref.ref(worker))
    task: dict[str, Any] = dict(request_id="req", transfer_id=TRANSFER_ID, dst_engine_id="decode")
    task.update(event=None, remote_block_ids_hint=None, remote_notify_port=0, remote_ip="127.0.0.1")
    info, peer = common.RemoteAllocInfo(block_ids=remote), Stub(num_blocks=4096)
    for g, (kind, names) in enumerate(layout):
        if kind == "mamba":
            continue  # upstream's separate Mamba plan
        want = (local[g], remote[g][: len(local[g])])
        for layer in names:
            write = common.WriteTask(local_block_ids=local, layer_name=layer, **task)
            plan: Any
            plan, error = probekit.attempt(writer._prepare_transfer_plan, write, info, peer)
            if error is not None:
                checks.fail(f"{label} upstream plan for {layer}: {error}")
                continue
            got = (list(plan.transfer_local_offsets), list(plan.transfer_remote_offsets))
            line = f"{label} upstream plan, one request: {layer} (group {g}) -> local {got[0]} "
            line += f"remote {got[1]}"
            checks.record(line, got == want, f"{line}, expected local {want[0]} remote {want[1]}")
