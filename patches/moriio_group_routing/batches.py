"""moriio-group-routing's oracle over generated batches, in the verify child (probe.py's last
check; hypothesis drives it through `serve_batches`), and the layouts both use."""

from __future__ import annotations

import importlib
import random
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from k3patch import probekit
from k3patch.probekit import Checks, Stub, Swap, stand_in

from .standins import (
    BLOCK_SIZE,
    COMMON,
    CONNECTOR,
    ENGINE,
    Layout,
    block_ids,
    drive_prefill,
    kv_params,
    prefill_worker,
    stub_kv_caches,
    stub_request,
    stub_vllm_config,
)

KIND_NAMES = {"mamba": "KDA", "mla": "MLA", "sliding": "sliding-window"}


def _layout(*groups: tuple[str, tuple[int, ...]]) -> Layout:
    suffix = {"mamba": "kda", "mla": "mla", "attention": "attn", "sliding": "swa"}
    return tuple((k, tuple(f"model.layers.{n}.{suffix[k]}" for n in ns)) for k, ns in groups)


# vLLM backs the j-th layer of every KDA group with one tensor: same-index KDA layers of different
# groups have equal geometry.
K3_LAYOUT = _layout(("mamba", (0, 4)), ("mamba", (1, 5)), ("mamba", (2, 6)), ("mla", (3, 7)))
TWO_GROUP_LAYOUT = _layout(("attention", (0, 2)), ("mamba", (1, 3)))
# No Mamba group: the fork's `[0]`/`[1]` choice sends a sliding-window group's layers to group 0.
ATTENTION_LAYOUT = _layout(("attention", (0, 1)))
TWO_ATTENTION_LAYOUT = _layout(("attention", (0, 2)), ("sliding", (1, 3)))
Route = tuple[list[int], list[int]]  # the block ids a layer's plan writes: (prefill, decode)


# ---------------------------------------------------------------------------------------------
# The oracle over generated batches: several requests share one prefill scheduler, one decode
# scheduler, one notify listener and one prefill worker, their chunks run side by side. The
# reference model: every layer of every request writes, from that request's own blocks of the
# layer's KV-cache group as allocated up to the step its save left, into that request's own
# decode blocks of the same group. Request k's prefill block of group g at chunk c is
# 10000 * (k + 1) + 100 * (g + 1) + 50 - c, its decode block BATCH_DECODE more: a later chunk's
# block has a lower id (a block another request freed can), so the order the lists keep is the
# allocation order, never the ids'. Seeded
# standard-library `random`: a failing seed is the same batch on every machine.
BATCHES = 12  # seeds 0..BATCHES-1 in verify
BATCH_DECODE = 5000
LAYOUTS = {
    "K3": K3_LAYOUT,
    "two-group": TWO_GROUP_LAYOUT,
    "attention only": ATTENTION_LAYOUT,
    "two attention groups": TWO_ATTENTION_LAYOUT,
}


@dataclass(frozen=True)
class Batch:
    """`layout` (a LAYOUTS key); the kinds whose groups gain a block at every later chunk; per
    request its prefill chunks (tokens each)."""

    seed: int | None
    layout: str
    growing: tuple[str, ...]
    chunks: tuple[tuple[int, ...], ...]

    def prefill_blocks(self, k: int, upto: int | None = None) -> list[list[int]]:
        steps = range(len(self.chunks[k]) if upto is None else upto)
        groups = range(len(LAYOUTS[self.layout]))
        return [[b for s in steps for b in self.step_blocks(k, s)[g]] for g in groups]

    def step_blocks(self, k: int, step: int) -> list[list[int]]:
        """Request k's new blocks per group at `step` (0-based)."""
        block = 10000 * (k + 1) + 49 - step
        return [
            [block + 100 * (g + 1)] if step == 0 or kind in self.growing else []
            for g, (kind, _) in enumerate(LAYOUTS[self.layout])
        ]

    def describe(self) -> str:
        grows = ", ".join(self.growing) or "none"
        asks = "; ".join(f"r{k}: chunks {list(c)}" for k, c in enumerate(self.chunks))
        return f"{self.layout} layout, growing {grows}; {asks}"


def generate_batch(seed: int) -> Batch:
    rng = random.Random(seed)
    layout = rng.choice(sorted(LAYOUTS))
    kinds = sorted({kind for kind, _ in LAYOUTS[layout]})
    growing = tuple(k for k in kinds if rng.random() < 0.6)
    chunks = tuple(
        tuple(rng.randint(1, BLOCK_SIZE) for _ in range(rng.randint(1, 4)))
        for _ in range(rng.randint(2, 4))
    )
    return Batch(seed, layout, growing, chunks)


def listener(engine: Any) -> Any:
    """The prefill node's notify listener (`paths` is read when the worker is collected)."""
    wrapper = stand_in(engine.MoRIIOWrapper, lock=threading.Lock(), paths={}, done_req_ids=[])
    wrapper._terminal_transfer_ids, wrapper.done_remote_allocate_req_dict = OrderedDict(), {}
    wrapper.done_write_cache_req_ids = []
    return wrapper


def write_layers(connector: Any, engine: Any, layout: Layout, wrapper: Any, metas: Any) -> Stub:
    """The prefill worker (its own layer maps) writes every layer of each (request id, save
    metadata) in `metas`, layer by layer as the forward pass runs: its write `tasks`, the
    `offsets` calls (which return the block ids themselves), the `writer` that plans them."""
    worker = prefill_worker(connector, layout)
    layers = [name for _, names in layout for name in names]
    tasks: list[Any] = []
    offsets = probekit.Calls(
        lambda layer, local, remote, *a, **k: (list(local), list(remote), [1] * len(local))
    )
    vars(worker).update(
        kv_caches=stub_kv_caches(layout),
        layer_name_to_local_kv_cache_metadata={name: [b""] for name in layers},
        moriio_wrapper=wrapper,
        _writer=Stub(schedule_write=tasks.append),
        _compute_block_transfer_offsets=offsets,
    )
    with Swap() as cuda:
        if "torch" in vars(connector):  # schedule_write_blocks records a CUDA event
            event = Stub(record=lambda *a: None, synchronize=lambda: None)
            stream = Stub(current_stream=lambda: None, Event=lambda *a, **k: event)
            cuda.attr(connector, "torch", Stub(cuda=stream))
        for name in layers:
            for req_id, meta in metas:
                worker._write_blocks_for_req(req_id, meta, name, None)
    writer = stand_in(engine.MoRIIOWriter, _worker_ref=weakref.ref(worker))
    return Stub(tasks=tasks, offsets=offsets, writer=writer, worker=worker)


def drive_batch(batch: Batch) -> tuple[dict[tuple[int, str], Route | str], list[int | None]]:
    """The batch through the tree's WRITE path: per (request, layer) the route its plan writes
    or its error; per request the step (from 1) its save left, None: never."""
    common, connector, engine = map(importlib.import_module, (COMMON, CONNECTOR, ENGINE))
    layout = LAYOUTS[batch.layout]
    routes: dict[tuple[int, str], Route | str] = {}
    with Swap() as swap:
        swap.on_exit(common.set_role, common.get_role())
        prefill = connector.MoRIIOConnectorScheduler(stub_vllm_config("kv_producer"), "prefill")
        # Request ids sort against the order they are scheduled in (vLLM schedules by arrival,
        # its ids are random): code that walks them sorted yet reads new_block_ids by that
        # position hands each request another's blocks (issue 28, routing-att-growth-sorted-ids).
        requests = [
            stub_request(f"req-p{9 - k}", sum(c), kv_params("decode", f"tx-{k}"))
            for k, c in enumerate(batch.chunks)
        ]
        plans = [
            (r, [(t, batch.step_blocks(k, s)) for s, t in enumerate(batch.chunks[k])])
            for k, r in enumerate(requests)
        ]
        sent = drive_prefill(prefill, plans)
        saves = [
            next((s for s, saved in enumerate(sent, 1) if r.request_id in saved), None)
            for r in requests
        ]
        metas = [
            sent[s - 1][r.request_id] if s else None for r, s in zip(requests, saves, strict=True)
        ]

        decode = connector.MoRIIOConnectorScheduler(stub_vllm_config("kv_consumer"), "decode")
        notified: list[bytes] = []
        decode.paths = probekit.Always(Stub(send=notified.append))
        for k, chunks in enumerate(batch.chunks):
            d = stub_request(f"req-d{k}", sum(chunks), kv_params("prefill", f"tx-{k}"))
            blocks = [[b + BATCH_DECODE for b in g] for g in batch.prefill_blocks(k)]
            decode.update_state_after_alloc(d, block_ids(blocks), sum(chunks))

        common.set_role(common.ROLE.PRODUCER)
        wrapper = listener(engine)
        for message in notified:
            wrapper._handle_message(message)
        infos = wrapper.done_remote_allocate_req_dict

        written = [(r.request_id, m) for r, m in zip(requests, metas, strict=True) if m]
        node = write_layers(connector, engine, layout, wrapper, written)
        peer = Stub(engine_id="decode", num_blocks=1 << 20, block_len=1, kv_caches_base_addr=[0])
        for task in node.tasks:
            k = int(str(task.transfer_id).rsplit("-", 1)[1])
            info = infos.get(task.transfer_id)
            if info is None:
                routes[k, task.layer_name] = "no remote allocation stored"
                continue
            plan: Any
            plan, error = probekit.attempt(node.writer._prepare_transfer_plan, task, info, peer)
            if error is not None:
                routes[k, task.layer_name] = error
                continue
            routes[k, task.layer_name] = (
                list(plan.transfer_local_offsets),
                list(plan.transfer_remote_offsets),
            )
    return routes, saves


def judge_batch(
    batch: Batch, routes: dict[tuple[int, str], Route | str], saves: list[int | None]
) -> list[str]:
    """What the reference model says went wrong (empty: all right)."""
    wrong = []
    for k, save in enumerate(saves):
        if save is None:
            continue  # held by a chunk gate: moriio-chunk-gate's question, not routing's
        local = batch.prefill_blocks(k, save)
        for g, (kind, names) in enumerate(LAYOUTS[batch.layout]):
            want = (local[g], [b + BATCH_DECODE for b in batch.prefill_blocks(k)[g]])
            for name in names:
                got = routes.get((k, name), "no transfer planned")
                if got != want:
                    what = f"{KIND_NAMES.get(kind, kind)} group {g}, saved at chunk {save}"
                    head = f"r{k} {name} ({what})"
                    if isinstance(got, str):
                        wrong.append(f"{head}: {got}")
                    else:
                        wrong.append(
                            f"{head}: local {got[0]} -> remote {got[1]}, expected local "
                            f"{want[0]} -> remote {want[1]}"
                        )
    return wrong


def probe_batches(checks: Checks, seeds: Any = range(BATCHES)) -> None:
    """A check per generated batch; the first failing one shrunk (requests dropped, chunks cut)."""
    probekit.seeded(checks, "batch", seeds, generate_batch, batch_wrongs, shrink_batch)


def batch_wrongs(batch: Batch) -> tuple[list[str], str]:
    return judge_batch(batch, *drive_batch(batch)), batch.describe()


def shrink_batch(batch: Batch, fails: Any) -> Batch:
    """Deterministic: drop requests, then each request's later chunks, while it still fails."""
    k = len(batch.chunks) - 1
    while k >= 0 and len(batch.chunks) > 1:
        smaller = replace(batch, seed=None, chunks=batch.chunks[:k] + batch.chunks[k + 1 :])
        if fails(smaller):
            batch = smaller
        k -= 1
    for k in range(len(batch.chunks)):
        while len(batch.chunks[k]) > 1:
            cut = (*batch.chunks[:k], batch.chunks[k][:-1], *batch.chunks[k + 1 :])
            if not fails(replace(batch, seed=None, chunks=cut)):
                break
            batch = replace(batch, seed=None, chunks=cut)
    return batch


def batch_from(data: dict[str, Any]) -> Batch:
    chunks = tuple(tuple(c) for c in data["chunks"])
    return Batch(**{**data, "chunks": chunks, "growing": tuple(data["growing"])})


def serve_batches(lines: Any, answer: Any) -> None:
    """The batch oracle for a test driver (probekit.serve)."""
    importlib.import_module(CONNECTOR)
    probekit.serve(lines, answer, batch_from, batch_wrongs)
