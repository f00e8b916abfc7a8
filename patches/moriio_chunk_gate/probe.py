"""moriio-chunk-gate's probes, in the verify child (no GPU, no network): the real
build_connector_meta driven step by step on moriio-group-routing's MoRIIO stand-ins (a few written
cases, then TABLE), then vLLM's own Scheduler.schedule() through SCHEDULED. The save must leave
once, with the final chunk, carrying every block allocated by then."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import itertools
import json
import logging
import pickle
import random
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from k3patch.patch import ProbeOutcome
from k3patch.probekit import Checks, Swap, call_accepted, source_of, stand_in
from k3patch.shapes import match

from ..moriio_group_routing.standins import CONNECTOR, drive_prefill, kv_params, stub_request
from .names import attribute_assignments

CHUNK = 2048  # max_num_batched_tokens in K3's recipe
K3_BLOCK = 5760  # K3's attention page padded to the KDA page
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

# The proxy's request id carries both nodes' ZMQ addresses (kv_params' ports): 0.23.0's
# add_new_req reads the decode peer's from it and raises without them (0.28.0 falls back).
_PEER = "host:127.0.0.1,handshake:6301,notify:61005"


def router_id(name: str) -> str:
    return f"{name}___prefill_addr_{_PEER}___decode_addr_{_PEER}_{'0' * 32}"


def _scheduler(mc: Any, block_size: int) -> Any:
    """A MoRIIO scheduler holding what build_connector_meta and update_state_after_alloc read:
    the request maps its own __init__ sets to {} (a release's, a fork's, a patch's), and the
    block sizes, group and mode its gates and block lists read."""
    init = source_of(mc.MoRIIOConnectorScheduler.__init__)
    assigned = attribute_assignments([init] if init else [], "self")
    empty = [a for a, v in assigned if any(match(e, v) is not None for e in ("{}", "dict()"))]
    state: dict[str, Any] = {name: {} for name in empty}
    state.update(
        mode=mc.MoRIIOMode.WRITE,
        block_size=block_size,  # 0.14.1-0.29.0 gate
        _full_attn_group_idx=0,  # 0.30.0-0.31.0 gate
        _full_attn_block_size=block_size,
        _has_mamba=False,  # 0.32.0+ (_clamp_to_prompt_blocks)
        blocks_per_sw=[0],
        _group_block_sizes=[block_size],
    )
    return stand_in(mc.MoRIIOConnectorScheduler, **state)


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


# The second probe: vLLM's own Scheduler on CPU, built as vLLM's unit tests build one (a MoRIIO
# producer, one full-attention group in K3's block, a config.json written here: no download).
MAX_LEN = 16384

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

# A model vLLM knows, small; only its config is read (the scheduler runs no model).
_PROBE_MODEL_CONFIG = (
    '{"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64, '
    '"num_attention_heads": 2, "num_hidden_layers": 1, "ffn_dim": 128, "vocab_size": 1000, '
    '"max_position_embeddings": 65536, "word_embed_proj_dim": 64}'
)


def _vllm_scheduler(
    model_dir: str,
    block: int = K3_BLOCK,
    budget: int = CHUNK,
    pool: int = 64,
    prefix_caching: bool = False,
    reserve: bool = True,
    cap: int = 0,
) -> Any:
    """vLLM's Scheduler with a MoRIIO producer, keyword arguments as this release takes them:
    `block`-token blocks, `budget` tokens a step, `pool` blocks."""
    torch = importlib.import_module("torch")
    vc = importlib.import_module("vllm.config")
    specs = importlib.import_module("vllm.v1.kv_cache_interface")
    scheduler = importlib.import_module("vllm.v1.core.sched.scheduler")
    structured_output = importlib.import_module("vllm.v1.structured_output")
    extra = {"host_ip": "127.0.0.1", "handshake_port": 6301, "notify_port": 6401}
    sched = dict(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=MAX_LEN)
    cache = dict(block_size=block, gpu_memory_utilization=0.9, cache_dtype="auto")
    config = vc.VllmConfig(
        model_config=vc.ModelConfig(
            model=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=MAX_LEN
        ),
        scheduler_config=call_accepted(
            vc.SchedulerConfig,
            **sched,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            scheduler_reserve_full_isl=reserve,
            long_prefill_token_threshold=cap,
        ),
        cache_config=call_accepted(vc.CacheConfig, **cache, enable_prefix_caching=prefix_caching),
        kv_transfer_config=vc.KVTransferConfig(
            kv_connector="MoRIIOConnector", kv_role="kv_producer", kv_connector_extra_config=extra
        ),
        device_config=vc.DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = pool
    spec = call_accepted(
        specs.FullAttentionSpec,
        block_size=block,
        num_kv_heads=1,
        head_size=1,
        dtype=torch.float32,
    )
    groups = [specs.KVCacheGroupSpec(["layer"], spec)]
    kv_cache = specs.KVCacheConfig(num_blocks=pool, kv_cache_tensors=[], kv_cache_groups=groups)
    return call_accepted(
        scheduler.Scheduler,
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=structured_output.StructuredOutputManager(config),
        block_size=block,
        log_stats=False,
    )


def _seen_in_output(output: Any, req_id: str) -> int | None:
    """The request's num_computed_tokens as scheduler_output tells it."""
    for new in getattr(output, "scheduled_new_reqs", None) or ():
        if new.req_id == req_id:
            return int(new.num_computed_tokens)
    cached = output.scheduled_cached_reqs
    if req_id in cached.req_ids:
        return int(cached.num_computed_tokens[list(cached.req_ids).index(req_id)])
    return None


def drive_scheduler(scheduler: Any, name: str, row: Prefill, checks: Checks) -> None:
    """One request through vLLM's Scheduler until it finishes: which steps' metadata carried the
    save, and `req.num_computed_tokens` inside build_connector_meta against scheduler_output.
    A truncated row is cut by the tree's own mamba_n1 truncation where it has one, else ours."""
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    req_id = router_id(name)
    fields = dict(request_id=req_id, prompt_token_ids=[1] * row.tokens, pooling_params=None)
    request = call_accepted(Request, sampling_params=SamplingParams(max_tokens=2), **fields)
    request.kv_transfer_params = {**kv_params("decode", f"t-{name}"), "do_remote_prefill": False}
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
            told = _seen_in_output(scheduler_output, req_id)
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
        scheduler.add_request(request)
        for step in range(1, len(row.chunks) + 4):
            output = scheduler.schedule()
            if req_id not in output.num_scheduled_tokens:
                break
            if req_id in getattr(output.kv_connector_metadata, "reqs_to_save", {}):
                saves.append(step)
            ids = list(output.num_scheduled_tokens)
            done = [scheduler.requests[r] for r in ids]
            sampled = [[7] if r.num_computed_tokens >= r.num_prompt_tokens else [] for r in done]
            ran: dict[str, Any] = dict(req_ids=ids, logprobs=None, prompt_logprobs_dict={})
            ran.update(req_id_to_index={r: i for i, r in enumerate(ids)}, pooler_output=[])
            model_output = call_accepted(ModelRunnerOutput, sampled_token_ids=sampled, **ran)
            scheduler.update_from_output(output, model_output)
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


@contextlib.contextmanager
def scheduler_setting(mc: Any) -> Iterator[str]:
    """What vLLM's Scheduler needs here, undone on exit; yields the directory of the model's
    config."""
    with Swap() as swap, tempfile.TemporaryDirectory(prefix="k3patch-probe-model-") as model:
        # The scheduler side sets the process-wide MoRIIO role: later probes get theirs back.
        swap.on_exit(mc.set_role, mc.get_role())
        logging.disable(logging.WARNING)
        swap.on_exit(logging.disable, logging.NOTSET)
        for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            swap.env(key, "1")
        # A fork's mamba_n1 truncates every request with this set; the rows say which to cut.
        swap.env("K3_MAMBA_N1_FORCE", None)
        # vLLM inspects the model class in a child interpreter unless its cache (keyed by the
        # release's model file) holds it: 10-15 s in a fresh container. Here, in this process
        # (CPU only, so nothing initialises a GPU), with a cache of its own.
        swap.env("VLLM_CACHE_ROOT", model)
        registry = importlib.import_module("vllm.model_executor.models.registry")
        swap.attr(registry, "_run_in_subprocess", lambda fn: fn())
        Path(model, "config.json").write_text(_PROBE_MODEL_CONFIG)
        yield model


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
            _direct(_scheduler(mc, row.block), [plan], checks, [row.label])
    with scheduler_setting(mc) as model:
        scheduler = _vllm_scheduler(model)
        for name, row in SCHEDULED:
            drive_scheduler(scheduler, name, row, checks)
        probe_workloads(model, checks)
    return checks.outcome(
        holds="the save is emitted once, with the final prefill chunk, by build_connector_meta "
        "driven directly and under vLLM's Scheduler ({ran} checks)",
        broken="wrong in {failed} of {ran} checks: {failures}",
    )


# ---------------------------------------------------------------------------------------------
# The oracle: generated workloads through vLLM's own Scheduler and the tree's MoRIIO connector.
# Reference model (what must happen, whatever the gate's code): each request sent to a decode
# node leaves in exactly one step's reqs_to_save, the step whose chunk computes its last prompt
# token (progress counted as the scheduler counts it: prefix-cache hits and tokens the connector
# reports as external included), carrying the request's own blocks as the scheduler holds them at
# that step; a request kept on this node is never sent. Workloads mix several requests per step,
# random prompts and chunk budgets, shared prefixes (cache hits), pools small enough to preempt,
# requests that sit out steps. The generator is seeded standard-library `random`: the same seed
# is the same workload on every machine.
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

    def describe(self) -> str:
        head = f"block {self.block}, budget {self.budget}, pool {self.pool} blocks"
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
        )
        asks.append(ask)
    need = max(-(-(a.prompt + a.decode) // block) for a in asks) + 1
    total = sum(-(-(a.prompt + a.decode) // block) for a in asks)
    # A tight pool, prompts admitted chunk by chunk and a cap that keeps several prompts growing
    # at once: preemption in mid-prefill.
    tight = rng.random() < 0.6
    pool = rng.randint(need, need + total // 4) if tight else total + 4
    cap = rng.randrange(budget // 4, budget) if rng.random() < 0.5 else 0
    return Workload(seed, block, budget, pool, tuple(asks), tight and rng.random() < 0.3, cap)


@dataclass
class Seen:
    """What the drive saw of one request: per step it ran (step, computed before, scheduled),
    its steps preempted, the saves (step, blocks sent), the step and blocks the model wants."""

    ran: list[tuple[int, int, int]] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    saves: list[tuple[int, list[int]]] = field(default_factory=list)
    due: tuple[int, list[int]] | None = None
    prompt: int = 0


def _flat(blocks: Any) -> list[int]:
    blocks = list(blocks or ())
    if blocks and isinstance(blocks[0], list | tuple):
        return [int(b) for group in blocks[:1] for b in group]
    return [int(b) for b in blocks]


def run_workload(w: Workload, model_dir: str) -> tuple[dict[str, Seen], str | None]:
    """`w` through vLLM's Scheduler (a MoRIIO producer of this tree); per request what was
    seen, or why the drive itself could not finish (a stall, a scheduler error)."""
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus

    scheduler = _vllm_scheduler(model_dir, w.block, w.budget, w.pool, True, w.reserve, w.cap)
    hasher = _block_hasher(w.block)
    connector = scheduler.connector.connector_scheduler
    names = [router_id(f"w-r{i}") for i in range(len(w.asks))]
    asks = dict(zip(names, w.asks, strict=True))
    seen = {name: Seen(prompt=a.prompt) for name, a in asks.items()}
    build, matched = connector.build_connector_meta, scheduler.connector.get_num_new_matched_tokens
    step = 0

    def watched(output: Any) -> Any:
        for req_id, n in output.num_scheduled_tokens.items():
            if req_id in seen:
                before = _seen_in_output(output, req_id)
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
                    sampling = SamplingParams(max_tokens=ask.decode, ignore_eos=True)
                    fields = dict(request_id=name, prompt_token_ids=ask.tokens(i))
                    request = call_accepted(
                        Request,
                        sampling_params=sampling,
                        pooling_params=None,
                        block_hasher=hasher,
                        **fields,
                    )
                    if ask.remote:
                        params = kv_params("decode", f"t-w{i}")
                        request.kv_transfer_params = {**params, "do_remote_prefill": False}
                    scheduler.add_request(request)
            output = scheduler.schedule()
            ids = list(output.num_scheduled_tokens)
            live = [scheduler.requests[r] for r in ids]
            sampled = [[7] if r.num_computed_tokens >= r.num_tokens else [] for r in live]
            done = {
                r
                for r, req in scheduler.requests.items()
                if RequestStatus.is_finished(req.status) and r not in acked
            }
            acked |= done
            ran: dict[str, Any] = dict(req_ids=ids, logprobs=None, prompt_logprobs_dict={})
            ran.update(req_id_to_index={r: i for i, r in enumerate(ids)}, pooler_output=[])
            if done:
                ran["kv_connector_output"] = _kv_output(finished_sending=done)
            model_output = call_accepted(ModelRunnerOutput, sampled_token_ids=sampled, **ran)
            scheduler.update_from_output(output, model_output)
            if all(a.arrives <= step for a in w.asks) and not scheduler.requests:
                return seen, None
            if all(a.arrives <= step for a in w.asks) and not ids and not done:
                return seen, f"the scheduler stalled at step {step}"
    return seen, f"not finished in {step} steps"


def _kv_output(**fields: Any) -> Any:
    outputs = importlib.import_module("vllm.v1.outputs")
    return call_accepted(outputs.KVConnectorOutput, **fields)


def _block_hasher(block: int) -> Any:
    """The block hasher vLLM's engine gives each request, so shared prefixes hit the cache;
    None where this release has none to give (its requests then hash themselves, or never)."""
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    if not hasattr(utils, "get_request_block_hasher"):
        return None
    try:
        sha256 = importlib.import_module("vllm.utils.hashing").sha256
    except (ImportError, AttributeError):
        sha256 = _sha256
    utils.init_none_hash(sha256)
    return utils.get_request_block_hasher(block, sha256)


def _sha256(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def judge_workload(w: Workload, seen: dict[str, Seen], stall: str | None) -> list[str]:
    """What the reference model says went wrong, per request (empty: all right)."""
    wrong = []
    for i, (ask, s) in enumerate(zip(w.asks, seen.values(), strict=True)):
        steps = [st for st, _ in s.saves]
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


# One simplification of a request at a time: no external tokens, no shared prefix, no delay.
_PLAINER = (
    lambda ask: replace(ask, external=0),
    lambda ask: replace(ask, shared=0),
    lambda ask: replace(ask, arrives=1),
)


def shrink(w: Workload, fails: Any) -> Workload:
    """A smaller workload that still fails (`fails(w)` true), found deterministically: drop
    requests, then drop each one's extras, then halve prompts; at most SHRINK_RUNS re-runs."""
    runs = 0

    def tries(candidate: Workload) -> bool:
        nonlocal runs
        if runs >= SHRINK_RUNS:
            return False
        runs += 1
        return bool(fails(candidate))

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


def probe_workloads(model_dir: str, checks: Checks, seeds: Any = range(WORKLOADS)) -> None:
    """The oracle over workloads `seeds`: a check per workload; the first failing one shrunk."""
    first: Workload | None = None
    for seed in seeds:
        w = generate(seed)
        try:
            seen, stall = run_workload(w, model_dir)
        except Exception as exc:  # this release's Scheduler cannot be driven so: a failure
            checks.fail(
                f"workload seed {seed}: cannot drive this tree: {type(exc).__name__}: {exc}"
            )
            return
        wrong = judge_workload(w, seen, stall)
        pre = sum(len(s.preempted) for s in seen.values())
        hits = sum(1 for s in seen.values() if s.ran and s.ran[0][1] > 0)
        line = (
            f"workload seed {seed} ({len(w.asks)} requests, {pre} preemption(s), {hits} starting "
            f"with cached or external tokens): "
        )
        checks.record(
            line + ("ok" if not wrong else "FAILED: " + "; ".join(wrong)),
            not wrong,
            f"workload seed {seed}: {wrong[0] if wrong else ''}"
            + (f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""),
        )
        if wrong and first is None:
            first = w
    if first is not None:

        def fails(c: Workload) -> bool:
            return bool(judge_workload(c, *run_workload(c, model_dir)))

        small = shrink(first, fails)
        wrong = judge_workload(small, *run_workload(small, model_dir))
        checks.fail(
            f"smallest failing case of seed {first.seed}: {small.describe()} -> "
            + "; ".join(wrong or ["(no longer fails)"])
        )


def workload_from(data: dict[str, Any]) -> Workload:
    """A Workload from its `dataclasses.asdict` form (JSON)."""
    asks = tuple(Ask(**ask) for ask in data["asks"])
    return Workload(**{**data, "asks": asks})


def serve_workloads(lines: Iterator[str], answer: Any) -> None:
    """The oracle for a test driver (hypothesis draws the workloads, its own interpreter has
    no vLLM): per JSON workload read from `lines`, `answer` gets the JSON list of what went
    wrong. Runs under the same setting as the probe."""
    mc = importlib.import_module(CONNECTOR)
    with Swap() as swap, scheduler_setting(mc) as model:
        swap.attr(mc, "get_role", lambda: mc.ROLE.PRODUCER)
        for line in lines:
            w = workload_from(json.loads(line))
            answer(json.dumps(judge_workload(w, *run_workload(w, model))))
