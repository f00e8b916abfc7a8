"""moriio-chunk-gate's probes, in the verify child (no GPU, no network): the real
build_connector_meta driven step by step on moriio-group-routing's MoRIIO stand-ins (a few written
cases, then TABLE), then vLLM's own Scheduler.schedule() through SCHEDULED. The save must leave
once, with the final chunk, carrying every block allocated by then."""

from __future__ import annotations

import importlib
import itertools
from dataclasses import dataclass
from typing import Any

from k3patch.patch import ProbeOutcome
from k3patch.probekit import Checks, Swap, source_of, stand_in
from k3patch.shapes import match

from ..moriio_group_routing.standins import CONNECTOR, drive_prefill, kv_params, stub_request
from .names import attribute_assignments
from .scheduler import (
    CHUNK,
    K3_BLOCK,
    new_request,
    router_id,
    run_step,
    scheduler_setting,
    seen_in_output,
    vllm_scheduler,
)
from .workloads import probe_workloads

SMALL_BLOCK = 16

# (request id, prompt, (tokens, new blocks) per step, the one step (from 1) whose metadata must
# carry the save, None: no kv_transfer_params, never sent), per case with title and block size.
Request = tuple[str, int, tuple[tuple[int, int], ...], int | None]
DIRECT_CASES: tuple[tuple[str, int, tuple[Request, ...]], ...] = (
    (
        "K3: 2,611-token prompt, one 5,760-token block, chunks 2,048 + 563 (no new block)",
        K3_BLOCK,
        (
            ("k3-2611", 2611, ((2048, 1), (563, 0)), 2),
            # A request without kv_transfer_params beside it is never sent and never fails.
            ("local", 100, ((100, 1), (1, 0)), None),
        ),
    ),
    (
        "K3: 5,000-token prompt, chunks 2,048 + 2,048 + 904",
        K3_BLOCK,
        (("k3-3chunk", 5000, ((2048, 1), (2048, 0), (904, 0)), 3),),
    ),
    ("last chunk of 2 tokens: no slack", K3_BLOCK, (("k3-2050", 2050, ((2048, 1), (2, 0)), 2),)),
    (
        "16-token blocks, a new block every chunk: the full block list is sent",
        SMALL_BLOCK,
        (("small", 5000, ((2048, 128), (2048, 128), (904, 57)), 3),),
    ),
    ("a prompt in one chunk", K3_BLOCK, (("short", 1000, ((1000, 1),), 1),)),
    # Resumed after preemption, vLLM prefills prompt + output again: the final chunk ends past
    # num_prompt_tokens. One K3 block holds it all (which blocks past the prompt travel is not
    # this gate's question: upstream 0.32.0 sends the prompt's blocks only).
    (
        "resumed after preemption: 4,000-token prompt recomputed over 4,098 tokens, chunks "
        "2,048 + 2,050 (past the prompt's end)",
        K3_BLOCK,
        (("resumed-4000", 4000, ((2048, 1), (2050, 0), (1, 0)), 2),),
    ),
)


@dataclass(frozen=True)
class Prefill:
    """A row: a prompt of `tokens` in CHUNK-token chunks and `block`-token KV blocks.
    `truncated`: mamba_n1's P side pops the last token before the scheduler counts (the gate
    compares with N-1) and sets max_tokens to 1 (no decode step)."""

    tokens: int
    block: int
    truncated: bool = False

    @property
    def prompt(self) -> int:
        return self.tokens - self.truncated

    @property
    def chunks(self) -> tuple[int, ...]:
        full, last = divmod(self.prompt, CHUNK)
        return (CHUNK,) * full + ((last,) if last else ())

    @property
    def steps(self) -> tuple[tuple[int, int], ...]:
        """(tokens, new blocks) per step, as vLLM allocates; the decode step gets no block even
        where its token starts one: 0.14.1-0.27.1 then raise a KeyError that is not this gate's."""
        held = [0, *(-(-total // self.block) for total in itertools.accumulate(self.chunks))]
        prefill = zip(self.chunks, (b - a for a, b in itertools.pairwise(held)), strict=True)
        return (*prefill, *([(1, 0)] if not self.truncated else []))

    @property
    def label(self) -> str:
        full, last = divmod(self.prompt, CHUNK)
        parts = [f"{full} chunk{'s' if full > 1 else ''}"] * bool(full) + [f"{last:,}"] * bool(last)
        split = " + ".join(parts) if len(self.chunks) > 1 else "one chunk"
        cut = f", mamba_n1 N-1: {self.prompt:,}" if self.truncated else ""
        return f"block {self.block:,}: {self.tokens:,} tokens{cut} ({split})"


def _table() -> tuple[Prefill, ...]:
    """Last chunks of 1, 2 (and block - 1, block, block + 1 in 16-token blocks) after 1-3 full
    chunks; K3's first block ends inside chunk 3, so the prompt ends just short of, at and past
    it; one chunk (G2 alone). Each as sent and truncated."""
    lasts = {K3_BLOCK: (1, 2), SMALL_BLOCK: (1, 2, SMALL_BLOCK - 1, SMALL_BLOCK, SMALL_BLOCK + 1)}
    tokens = [
        (full * CHUNK + last, block)
        for block, ends in lasts.items()
        for full in (1, 2, 3)
        for last in ends
    ]
    tokens += [(K3_BLOCK + d, K3_BLOCK) for d in (-1, 0, 1)] + [(1000, K3_BLOCK), (CHUNK, K3_BLOCK)]
    return tuple(Prefill(n, block, cut) for n, block in tokens for cut in (False, True))


TABLE = _table()


def _scheduler(mc: Any, block_size: int, hybrid: bool = False) -> Any:
    """A MoRIIO scheduler holding what build_connector_meta and update_state_after_alloc read:
    the request maps its own __init__ sets to {} (a release's, a fork's, a patch's), and the
    block sizes, group and mode its gates and block lists read; `hybrid`: a K3 node's
    `_has_mamba` on a fork with mamba_n1 (its N-1 helper then cuts, as it does there)."""
    init = source_of(mc.MoRIIOConnectorScheduler.__init__)
    assigned = attribute_assignments([init] if init else [], "self")
    empty = [a for a, v in assigned if any(match(e, v) is not None for e in ("{}", "dict()"))]
    state: dict[str, Any] = {name: {} for name in empty}
    state.update(
        mode=mc.MoRIIOMode.WRITE,
        block_size=block_size,  # 0.14.1-0.29.0 gate
        _full_attn_group_idx=0,  # 0.30.0-0.31.0 gate
        _full_attn_block_size=block_size,
        _has_mamba=hybrid and mamba_n1(mc.MoRIIOConnectorScheduler),  # 0.32.0+ clamps with it
        blocks_per_sw=[0],
        _group_block_sizes=[block_size],
    )
    return stand_in(mc.MoRIIOConnectorScheduler, **state)


def mamba_n1(connector: Any) -> bool:
    """The fork's k3-mamba-n1 (SITES.md 0): its N-1 helper reads `_has_mamba`."""
    return hasattr(connector, "_get_remote_prefill_token_count")


def _saves(steps: list[int], chunks: int) -> str:
    at = [step for step in steps if step <= chunks]
    none = f"no save in {chunks} chunk{'s' * (chunks > 1)}"
    text = f"save at chunk {', '.join(map(str, at))} of {chunks}" if at else none
    return text + (" and at the decode step after" if len(at) < len(steps) else "")


def _expected(final: int | None) -> str:
    if final is None:
        return "expected none"
    return f"expected chunk {final} only ({'G2' if final == 1 else 'G1'})"


def truncate(request: Any) -> None:
    """mamba_n1's P-side truncation as the fork makes it (SITES.md 0), once per request."""
    params = request.kv_transfer_params
    if params.get("_p_side_truncated"):
        return
    request.prompt_token_ids.pop()
    if hasattr(request, "_all_token_ids"):  # vLLM's Request; num_tokens follows it
        request._all_token_ids.pop()
    else:
        request.num_tokens -= 1
    request.num_prompt_tokens -= 1
    request.max_tokens = 1
    params["_p_side_truncated"] = True


# A request through the direct drive: the stand-in, (tokens, new blocks) per step, the step whose
# metadata must carry the save (None: never sent), how many of the steps are prefill chunks.
Planned = tuple[Any, tuple[tuple[int, int], ...], int | None, int]


def _direct(scheduler: Any, requests: list[Planned], checks: Checks, heads: list[str]) -> None:
    """The real build_connector_meta through chunked prefills run side by side: a check per
    request, that its save left once, at its final chunk, with every block allocated by then."""
    counter = itertools.count()  # block ids in allocation order, step by step across requests
    allocated: dict[str, list[list[int]]] = {r.request_id: [] for r, *_ in requests}
    for step in range(max(len(steps) for _, steps, *_ in requests)):
        for request, steps, *_ in requests:
            if step < len(steps):
                ids = list(itertools.islice(counter, steps[step][1]))
                allocated[request.request_id].append(ids)
    plans = [
        (r, [(n, [ids]) for (n, _), ids in zip(steps, allocated[r.request_id], strict=True)])
        for r, steps, *_ in requests
    ]
    emitted: dict[str, list[tuple[int, list[int]]]] = {r.request_id: [] for r, *_ in requests}
    for step, saves in enumerate(drive_prefill(scheduler, plans), 1):
        for req_id, meta in saves.items():
            sent = list(meta.local_block_ids)
            nested = sent and isinstance(sent[0], list | tuple)
            emitted[req_id].append(
                (step, [*itertools.chain(*sent)] if nested else [*map(int, sent)])
            )
    for (request, _, want, chunks), head in zip(requests, heads, strict=True):
        got = emitted[request.request_id]
        saved = [step for step, _ in got]
        line = f"{head}: {_saves(saved, chunks)}, {_expected(want)}"
        ok = saved == ([] if want is None else [want])
        blocks = [b for ids in allocated[request.request_id][:want] for b in ids]
        if ok and got and got[0][1] != blocks:
            ok = False
            line += f"; sent blocks {got[0][1][:8]} ({len(got[0][1])}), allocated {len(blocks)}"
        checks.record(line, ok)


def _direct_case(scheduler: Any, title: str, requests: tuple[Request, ...], checks: Checks) -> None:
    planned: list[Planned] = []
    for req_id, n, steps, want in requests:
        params = kv_params("decode", f"t-{req_id}") if want else None
        stub = stub_request(router_id(req_id), n, params)
        # A resumed request holds its output tokens too: num_tokens is what it prefills.
        stub.num_tokens = max(n, sum(tokens for tokens, _ in steps[:want]))
        # Chunks: the steps up to the save where a decode step follows it.
        chunks = want if want and steps[want:] == ((1, 0),) else len(steps)
        planned.append((stub, steps, want, chunks))
    _direct(scheduler, planned, checks, [f"{title} [{req_id}]" for req_id, *_ in requests])


# (request id, row): the rows that tell each wrong gate of G1 and G2 from the right one (2,611:
# 2,048 + 563 in one 5,760-token block; 5,000: three chunks; slack of 1 and 2 after one and two
# chunks, a block count at chunk 3, one chunk, the truncation).
SCHEDULED = tuple(
    (f"sched-{n}{'-n1' if cut else ''}", Prefill(n, K3_BLOCK, cut))
    for n, cut in (
        *((n, False) for n in (2611, 5000, 2049, 2050, 4097, 4098, 6145, 1000)),
        *((n, True) for n in (4098, 2049)),
    )
)


def drive_scheduler(scheduler: Any, name: str, row: Prefill, checks: Checks) -> None:
    """One request through vLLM's Scheduler until it finishes: which steps' metadata carried the
    save, and `req.num_computed_tokens` inside build_connector_meta against scheduler_output.
    A truncated row is cut by the tree's own mamba_n1 truncation where it has one, else ours."""
    req_id = router_id(name)
    request = new_request(req_id, [1] * row.tokens, 2, f"t-{name}")
    saves: list[int] = []
    seen: list[tuple[int, int | None, int]] = []  # computed: live, in the output; scheduled
    prompts: list[int] = []  # the prompt the connector compares with
    connector = scheduler.connector.connector_scheduler
    build, matched = connector.build_connector_meta, connector.get_num_new_matched_tokens
    cut = getattr(connector, "_truncate_mamba_request_for_prefill", truncate)

    def watched(scheduler_output: Any) -> Any:
        if req_id in scheduler_output.num_scheduled_tokens:
            live = scheduler.requests[req_id]
            scheduled = int(scheduler_output.num_scheduled_tokens[req_id])
            told = seen_in_output(scheduler_output, req_id)
            seen.append((int(live.num_computed_tokens), told, scheduled))
            prompts.append(int(live.num_prompt_tokens))
        return build(scheduler_output)

    def truncating(live: Any, *args: Any, **kwargs: Any) -> Any:
        if live.request_id == req_id:
            cut(live)
        return matched(live, *args, **kwargs)

    with Swap() as swap:
        swap.attr(connector, "build_connector_meta", watched)
        if row.truncated:
            swap.attr(connector, "get_num_new_matched_tokens", truncating)
            if mamba_n1(connector):  # as on a K3 node: hybrid, so the fork's helpers cut
                swap.attr(connector, "_has_mamba", True)
        scheduler.add_request(request)
        for step in range(1, len(row.chunks) + 4):
            output = scheduler.schedule()
            if req_id not in output.num_scheduled_tokens:
                break
            if req_id in getattr(output.kv_connector_metadata, "reqs_to_save", {}):
                saves.append(step)
            run_step(scheduler, output, "num_prompt_tokens", set())
    chunks = len(row.chunks)
    line = (
        f"Scheduler.schedule() [{name}] {row.label}: {_saves(saves, chunks)}, {_expected(chunks)}"
    )
    scheduled = [n for _, _, n in seen]
    want = [*row.chunks, *([1] if not row.truncated else [])]
    if scheduled != want:
        line += f"; scheduled {scheduled} tokens, expected {want}"
    checks.record(line, saves == [chunks] and scheduled == want)
    fresh = all(a == b for a, b, _ in seen) and bool(seen)
    checks.record(
        f"Scheduler.schedule() [{name}]: inside build_connector_meta (num_prompt_tokens "
        f"{prompts[-1] if prompts else 0}) req.num_computed_tokens = "
        f"{', '.join(str(a) for a, _, _ in seen)} at steps 1-{len(seen)}; scheduler_output says "
        f"{', '.join(str(b) for _, b, _ in seen)}"
        + (" (the count before this step's chunk, not stale)" if fresh else " (STALE)"),
        fresh,
    )


def probe_chunk_gate() -> ProbeOutcome:
    """Both probes: the direct drive of build_connector_meta, then vLLM's own Scheduler."""
    checks, mc = Checks("chunk gate"), importlib.import_module(CONNECTOR)
    with Swap() as swap:
        # The producer role is process-global state set at connector start; pin it here.
        swap.attr(mc, "get_role", lambda: mc.ROLE.PRODUCER)
        for title, block_size, requests in DIRECT_CASES:
            _direct_case(_scheduler(mc, block_size), title, requests, checks)
        for row in TABLE:  # each alone, truncated before the scheduler first sees it
            request = stub_request(router_id(f"row-{row.tokens}"), row.tokens, kv_params("decode"))
            if row.truncated:
                truncate(request)
            plan = (request, row.steps, len(row.chunks), len(row.chunks))
            _direct(_scheduler(mc, row.block, row.truncated), [plan], checks, [row.label])
    with scheduler_setting(mc) as model:
        scheduler = vllm_scheduler(model)
        for name, row in SCHEDULED:
            drive_scheduler(scheduler, name, row, checks)
        probe_workloads(model, checks)
    return checks.outcome(
        holds="the save is emitted once, with the final prefill chunk, by build_connector_meta "
        "driven directly and under vLLM's Scheduler ({ran} checks)",
        broken="wrong in {failed} of {ran} checks: {failures}",
    )
