"""moriio-chunk-gate's oracle, in the verify child: vLLM's own Scheduler on CPU, the tree's MoRIIO
connector its producer, driven by seeded generated workloads (by hypothesis through
`serve_workloads`), judged against a reference model."""

from __future__ import annotations

import importlib
import random
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from k3patch import probekit
from k3patch.probekit import Checks, Swap

from ..moriio_group_routing.standins import CONNECTOR
from .scheduler import (
    K3_BLOCK,
    MAX_LEN,
    new_request,
    router_id,
    run_step,
    scheduler_setting,
    seen_in_output,
    vllm_scheduler,
)
from .sites import UPSTREAM_HELPER

# ---------------------------------------------------------------------------------------------
# The oracle: generated workloads through vLLM's own Scheduler and the tree's MoRIIO connector.
# Reference model (what must happen, whatever the gate's code): each request sent to a decode
# node leaves in exactly one step's reqs_to_save, the step whose chunk computes its last prompt
# token (progress counted as the scheduler counts it: prefix-cache hits and tokens the connector
# reports as external included), carrying the request's own blocks as the scheduler holds them at
# that step; a request kept on this node is never sent. Workloads mix several requests per step,
# random prompts and chunk budgets, shared prefixes (cache hits), pools small enough to preempt,
# requests that sit out steps. Once every request has finished, none is left in the connector's
# per-request maps (a snapshot read with `get` leaks a dict per request for the server's life).
# The generator is seeded standard-library `random`: the same seed is the same workload anywhere.
WORKLOADS = 40  # seeds 0..WORKLOADS-1 in verify
SHRINK_RUNS = 24  # at most this many re-runs to shrink the first failing workload


@dataclass(frozen=True)
class Ask:
    """One request of a workload. `family`/`shared`: its first `shared` tokens are those of every
    request of its family (a prefix-cache hit once one of them computed them); `arrives`: the
    step before which it is added; `remote`: sent to a decode node (max_tokens 1, as the proxy
    asks a prefill node), else kept here and decoding `decode` tokens; `external`: tokens the
    connector reports as already loaded."""

    prompt: int
    family: int = 0
    shared: int = 0
    arrives: int = 1
    remote: bool = True
    external: int = 0
    decode: int = 1
    priority: int = 0  # under priority scheduling: the lower, the sooner (and preempted later)

    def tokens(self, index: int) -> list[int]:
        base = [(self.family * 7919 + i) % 997 + 1 for i in range(min(self.shared, self.prompt))]
        return base + [(index * 104729 + i) % 991 + 1000 for i in range(self.prompt - len(base))]

    def describe(self) -> str:
        parts = [f"prompt {self.prompt}"]
        if self.shared:
            parts.append(f"first {self.shared} shared with family {self.family}")
        if self.arrives > 1:
            parts.append(f"arrives at step {self.arrives}")
        if self.external:
            parts.append(f"{self.external} external")
        parts.append("remote" if self.remote else f"local, {self.decode} decode tokens")
        parts += [f"priority {self.priority}"] * bool(self.priority)
        return ", ".join(parts)


@dataclass(frozen=True)
class Workload:
    seed: int | None  # None: a shrunk or written workload
    block: int
    budget: int  # max_num_batched_tokens
    pool: int  # KV blocks on this node
    asks: tuple[Ask, ...]
    # scheduler_reserve_full_isl (vLLM 0.28.0+): admit a request only when its whole prompt fits;
    # False admits it chunk by chunk, so a full pool preempts requests in mid-prefill.
    reserve: bool = True
    # long_prefill_token_threshold: at most this many tokens per request a step (0: no cap), so
    # several prompts share a step's budget chunk by chunk.
    cap: int = 0
    # "priority": vLLM's priority scheduling (a resumed request can be scheduled after a new
    # one in a step, and the lowest priority is preempted, not the last admitted).
    policy: str = "fcfs"

    def describe(self) -> str:
        head = f"block {self.block}, budget {self.budget}, pool {self.pool} blocks, {self.policy}"
        head += "" if self.reserve else ", prompts admitted chunk by chunk"
        head += f", at most {self.cap} tokens a request a step" if self.cap else ""
        return head + "; " + "; ".join(f"r{i}: {a.describe()}" for i, a in enumerate(self.asks))


def generate(seed: int) -> Workload:
    """Workload `seed`: K3's block and chunk in some, small blocks and budgets in the others."""
    rng = random.Random(seed)
    k3 = rng.random() < 0.25
    block = K3_BLOCK if k3 else rng.choice((16, 32, 64))
    budget = rng.choice((2048, 3000)) if k3 else rng.randrange(24, 260, 4)
    longest = MAX_LEN - K3_BLOCK if k3 else rng.randrange(60, 700)
    asks = []
    by_priority = rng.random() < 0.35
    for _ in range(rng.randint(2, 6)):
        family = rng.randrange(3)
        prompt = rng.randint(1, longest)
        remote = rng.random() < 0.75
        ask = Ask(
            prompt=prompt,
            family=family,
            shared=rng.choice((0, prompt // 2, prompt, rng.randint(0, prompt))),
            arrives=rng.choice((1, 1, 1, rng.randint(2, 6))),
            remote=remote,
            external=(rng.randint(0, prompt - 1) // block * block) if rng.random() < 0.2 else 0,
            decode=1 if remote else rng.randint(1, 12),
            priority=rng.randrange(3) if by_priority else 0,
        )
        asks.append(ask)
    need = max(-(-(a.prompt + a.decode) // block) for a in asks) + 1
    total = sum(-(-(a.prompt + a.decode) // block) for a in asks)
    # A tight pool, prompts admitted chunk by chunk and a cap that keeps several prompts growing
    # at once: preemption in mid-prefill.
    tight = rng.random() < 0.6
    pool = rng.randint(need, need + total // 4) if tight else total + 4
    cap = rng.randrange(budget // 4, budget) if rng.random() < 0.5 else 0
    reserve = tight and rng.random() < 0.3
    policy = "priority" if by_priority else "fcfs"
    return Workload(seed, block, budget, pool, tuple(asks), reserve, cap, policy)


@dataclass
class Seen:
    """What the drive saw of one request: per step it ran (step, computed before, scheduled),
    its steps preempted, the saves (step, blocks sent), the step and blocks the model wants, the
    connector's maps still holding it once every request finished."""

    ran: list[tuple[int, int, int]] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    saves: list[tuple[int, list[int]]] = field(default_factory=list)
    due: tuple[int, list[int]] | None = None
    prompt: int = 0
    left: list[str] = field(default_factory=list)


# Not the gate's: the fork's k3-mamba-blockids and older k3-group-routing never pop their maps
# (their own leaks, left alone); the older chunk gate's progress map is rebuilt every step.
NOT_THE_GATES = ("_reqs_save_mamba", "_reqs_save_allgrp", "_k3_prog")


def _flat(blocks: Any) -> list[int]:
    blocks = list(blocks or ())
    if blocks and isinstance(blocks[0], list | tuple):
        return [int(b) for group in blocks[:1] for b in group]
    return [int(b) for b in blocks]


def run_workload(w: Workload, model_dir: str) -> tuple[dict[str, Seen], str | None]:
    """`w` through vLLM's Scheduler (a MoRIIO producer of this tree); per request what was
    seen, or why the drive itself could not finish (a stall, a scheduler error)."""
    from vllm.v1.request import RequestStatus

    scheduler = vllm_scheduler(
        model_dir, w.block, w.budget, w.pool, True, w.reserve, w.cap, w.policy
    )
    hasher = _block_hasher(w.block)
    connector = scheduler.connector.connector_scheduler
    # Upstream's own gate (0.32.0+, `_is_final_prefill_chunk`) is vLLM's code, not this fix's:
    # its leak (a resumed request G2 saves stays in the pending map) is not judged.
    upstream = hasattr(connector, UPSTREAM_HELPER)
    names = [router_id(f"w-r{i}") for i in range(len(w.asks))]
    asks = dict(zip(names, w.asks, strict=True))
    seen = {name: Seen(prompt=a.prompt) for name, a in asks.items()}
    build, matched = connector.build_connector_meta, scheduler.connector.get_num_new_matched_tokens
    step = 0

    def watched(output: Any) -> Any:
        for req_id, n in output.num_scheduled_tokens.items():
            if req_id in seen:
                before = seen_in_output(output, req_id)
                if before is None:
                    before = int(scheduler.requests[req_id].num_computed_tokens)
                seen[req_id].ran.append((step, before, int(n)))
                prompt = seen[req_id].prompt
                if asks[req_id].remote and before < prompt <= before + n and not seen[req_id].due:
                    blocks = scheduler.kv_cache_manager.get_block_ids(req_id)
                    seen[req_id].due = (step, _flat(blocks))
        meta = build(output)
        for req_id, save in (getattr(meta, "reqs_to_save", None) or {}).items():
            if req_id in seen:
                seen[req_id].saves.append((step, _flat(save.local_block_ids)))
        return meta

    def external(request: Any, computed: int, *args: Any, **kwargs: Any) -> Any:
        found, load_async = matched(request, computed, *args, **kwargs)
        ask = asks.get(request.request_id)
        if ask is None or not ask.external or request.num_computed_tokens:
            return found, load_async
        return max(found or 0, ask.external - computed, 0), False

    def preempting(request: Any, *args: Any, **kwargs: Any) -> Any:
        if request.request_id in seen:
            seen[request.request_id].preempted.append(step)
        return preempt(request, *args, **kwargs)

    acked: set[str] = set()
    preempt = scheduler._preempt_request
    with Swap() as swap:
        swap.attr(scheduler, "_preempt_request", preempting)
        swap.attr(connector, "build_connector_meta", watched)
        swap.attr(scheduler.connector, "get_num_new_matched_tokens", external)
        limit = 12 + 4 * sum(a.prompt + a.decode for a in w.asks) // max(w.budget, 1)
        for step in range(1, limit + len(w.asks) * 8):
            for i, (name, ask) in enumerate(asks.items()):
                if ask.arrives == step:
                    transfer = f"t-w{i}" if ask.remote else ""
                    extra = dict(block_hasher=hasher, priority=ask.priority)
                    request = new_request(name, ask.tokens(i), ask.decode, transfer, **extra)
                    scheduler.add_request(request)
            try:
                output = scheduler.schedule()
            except KeyError as exc:  # a sent request the connector looks up (0.27.1 and older)
                if exc.args[0] not in asks or not asks[exc.args[0]].remote:
                    raise
                r = names.index(exc.args[0])
                return (
                    seen,
                    f"the connector raised KeyError on r{r} at step {step} (an engine crash)",
                )
            done = {
                r
                for r, req in scheduler.requests.items()
                if RequestStatus.is_finished(req.status) and r not in acked
            }
            acked |= done
            run_step(scheduler, output, "num_tokens", done)
            arrived = all(a.arrives <= step for a in w.asks)
            if arrived and not scheduler.requests:
                for name, s in seen.items():
                    held = vars(connector).items()
                    s.left = [k for k, v in held if isinstance(v, dict | set) and name in v]
                    s.left = [k for k in s.left if k not in NOT_THE_GATES and not upstream]
                return seen, None
            # A step that only preempts (priority scheduling) schedules nothing: no stall.
            preempted = any(step in s.preempted for s in seen.values())
            if arrived and not (output.num_scheduled_tokens or done or preempted):
                return seen, f"the scheduler stalled at step {step}"
    return seen, f"not finished in {step} steps"


def _block_hasher(block: int) -> Any:
    """The block hasher vLLM's engine gives each request, so shared prefixes hit the cache
    (every release with a MoRIIO connector, 0.14.0 on, has it and its sha256)."""
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    sha256 = importlib.import_module("vllm.utils.hashing").sha256
    utils.init_none_hash(sha256)
    return utils.get_request_block_hasher(block, sha256)


def judge_workload(w: Workload, seen: dict[str, Seen], stall: str | None) -> list[str]:
    """What the reference model says went wrong, per request (empty: all right)."""
    wrong = []
    for i, (ask, s) in enumerate(zip(w.asks, seen.values(), strict=True)):
        steps = [st for st, _ in s.saves]
        if s.left:
            wrong.append(f"r{i} finished, still held in the connector's {', '.join(s.left)}")
        if not ask.remote:
            if s.saves:
                wrong.append(f"r{i} is not sent to a decode node but was saved at step(s) {steps}")
            continue
        if s.due is None:
            if stall is None:
                wrong.append(f"r{i} never computed its last prompt token (harness)")
            continue
        if steps != [s.due[0]]:
            when = f"at step(s) {steps}" if steps else "never"
            wrong.append(f"r{i} saved {when}, expected once at step {s.due[0]} ({_timeline(s)})")
        elif s.saves[0][1] != s.due[1]:
            sent, want = s.saves[0][1], s.due[1]
            wrong.append(f"r{i} sent blocks {sent}, expected its own {want} ({_timeline(s)})")
    if stall and not wrong:
        wrong.append(stall)
    return wrong


def _timeline(s: Seen) -> str:
    ran = ", ".join(f"step {st}: {before}+{n}" for st, before, n in s.ran)
    pre = f"; preempted at step(s) {s.preempted}" if s.preempted else ""
    return f"prompt {s.prompt}; computed+scheduled {ran}{pre}"


# One simplification of a request at a time: no external tokens, no shared prefix, no delay, no
# priority.
_PLAINER = (
    lambda ask: replace(ask, external=0),
    lambda ask: replace(ask, shared=0),
    lambda ask: replace(ask, arrives=1),
    lambda ask: replace(ask, priority=0),
)


def shrink(w: Workload, fails: Any) -> Workload:
    """A smaller workload that still fails (`fails(w)` true), found deterministically: drop
    requests, then drop each one's extras, then halve prompts; at most SHRINK_RUNS re-runs."""
    runs = iter(range(SHRINK_RUNS))

    def tries(candidate: Workload) -> bool:
        return next(runs, None) is not None and bool(fails(candidate))

    def fit(asks: tuple[Ask, ...]) -> Workload:
        need = max(-(-(a.prompt + a.decode) // w.block) for a in asks) + 1
        return replace(w, seed=None, pool=max(w.pool, need), asks=asks)

    i = len(w.asks) - 1
    while i >= 0 and len(w.asks) > 1:
        smaller = fit(w.asks[:i] + w.asks[i + 1 :])
        if tries(smaller):
            w = smaller
        i -= 1
    for i, ask in enumerate(w.asks):
        for plainer in _PLAINER:
            plain = plainer(ask)
            if plain != ask:
                simpler = fit((*w.asks[:i], plain, *w.asks[i + 1 :]))
                if tries(simpler):
                    w, ask = simpler, simpler.asks[i]
    return w


# Written workloads (found by a search over priority workloads with late arrivals; the generator's
# seeds 0-299 hold none): a new request is scheduled before a resumed one in a step, so the
# order of num_scheduled_tokens is not that of the cached requests (chunk-g1-scheduled-by-position).
WRITTEN = tuple(
    Workload(None, block, budget, pool, asks, False, cap, "priority")
    for block, budget, pool, cap, asks in (
        (16, 100, 28, 0, (Ask(127, 1, 63, 3, priority=2), Ask(86, 1, 86, 6), Ask(328), Ask(70, 1))),
        (32, 184, 13, 136, (Ask(250, 1, 250), Ask(145, priority=1), Ask(140, 1, 70, 3))),
    )
)


def probe_workloads(model_dir: str, checks: Checks, seeds: Any = range(WORKLOADS)) -> None:
    """The oracle over workloads `seeds`: a check per workload; the first failing one shrunk."""
    drive = Drive(model_dir)

    def shrunk(w: Workload, fails: Any) -> Workload:
        return shrink(drive.served(w), fails)

    probekit.seeded(checks, "workload", seeds, drive.generate, drive.wrongs, shrunk)
    written = range(1, len(WRITTEN) + 1)
    pick = lambda k: drive.served(WRITTEN[k - 1])  # noqa: E731
    probekit.seeded(checks, "written workload", written, pick, drive.wrongs, shrunk)
    if drive.all_remote:
        checks.note(f"every request sent to a decode node: {drive.all_remote}")


RELEASE_LOOKUP = "req, existing_blocks = self._reqs_need_pending_save[req_id]"


class Drive:
    """Workloads through this tree. vLLM 0.27.1 and older raise a KeyError at RELEASE_LOOKUP
    for a running request without kv_transfer_params that gets a block (vLLM's own, guarded
    since 0.28.0; a proxied prefill node gets none): there, once a workload shows it, every
    request is sent to a decode node. A KeyError raised by any other line is a failure."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir, self.all_remote = model_dir, ""

    def generate(self, seed: int) -> Workload:
        return self.served(generate(seed))

    def served(self, w: Workload) -> Workload:
        remote = tuple(replace(a, remote=True, decode=1) for a in w.asks)
        return replace(w, asks=remote) if self.all_remote else w

    def wrongs(self, w: Workload) -> tuple[list[str], str]:
        try:
            seen, stall = run_workload(self.served(w), self.model_dir)
        except KeyError as exc:
            local = {router_id(f"w-r{i}") for i, a in enumerate(w.asks) if not a.remote}
            line = traceback.extract_tb(exc.__traceback__)[-1].line
            if self.all_remote or exc.args[0] not in local or line != RELEASE_LOOKUP:
                raise
            self.all_remote = f"this release's connector cannot schedule one kept here ({exc!r})"
            return self.wrongs(w)
        wrong = judge_workload(self.served(w), seen, stall)
        pre = sum(len(s.preempted) for s in seen.values())
        hits = sum(1 for s in seen.values() if s.ran and s.ran[0][1] > 0)
        return wrong, f"{len(w.asks)} requests, {pre} preemption(s), {hits} starting with " + (
            "cached or external tokens"
        )


def workload_from(data: dict[str, Any]) -> Workload:
    """A Workload from its `dataclasses.asdict` form (JSON)."""
    asks = tuple(Ask(**ask) for ask in data["asks"])
    return Workload(**{**data, "asks": asks})


def serve_workloads(lines: Iterator[str], answer: Any) -> None:
    """The oracle for a test driver (probekit.serve), under the probe's setting."""
    mc = importlib.import_module(CONNECTOR)
    with scheduler_setting(mc) as model:
        probekit.serve(lines, answer, workload_from, Drive(model).wrongs)
