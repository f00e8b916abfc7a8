"""The behaviour probes of moriio-chunk-gate, run in the verify child (the tree's own
interpreter, no GPU, no network): the real build_connector_meta driven step by step, then vLLM's
own Scheduler.schedule() of the tree through the same chunked prompts."""

from __future__ import annotations

import ast
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from k3patch.model import ProbeOutcome
from k3patch.probekit import Swap
from k3patch.shapes import match

from . import MODULE

# --------------------------------------------------------------------------------------------
# The behaviour probe: the real build_connector_meta of the tree, driven step by step the way
# the scheduler drives it, on an object built without a cluster (only the attributes that
# build_connector_meta and update_state_after_alloc read). No GPU, no network.


@dataclass(frozen=True)
class ProbeRequest:
    req_id: str
    prompt: int
    # One (tokens scheduled, blocks newly allocated) per step; 0 blocks: new_block_ids is None.
    steps: tuple[tuple[int, int], ...]
    # The one step (1-based) whose metadata must carry the save; None: never (not a PD request).
    expect_step: int | None
    disagg: bool = True


@dataclass(frozen=True)
class ProbeCase:
    title: str
    block_size: int
    requests: tuple[ProbeRequest, ...]


PROBE_CASES = (
    ProbeCase(
        "K3: 2,611-token prompt, one 5,760-token block, chunks 2,048 + 563 (no new block)",
        5760,
        (
            ProbeRequest("k3-2611", 2611, ((2048, 1), (563, 0)), expect_step=2),
            # A request without kv_transfer_params beside it is never sent and never fails.
            ProbeRequest("local", 100, ((100, 1), (1, 0)), expect_step=None, disagg=False),
        ),
    ),
    ProbeCase(
        "K3: 5,000-token prompt, chunks 2,048 + 2,048 + 904",
        5760,
        (ProbeRequest("k3-3chunk", 5000, ((2048, 1), (2048, 0), (904, 0)), expect_step=3),),
    ),
    ProbeCase(
        "last chunk of 2 tokens: no slack",
        5760,
        (ProbeRequest("k3-2050", 2050, ((2048, 1), (2, 0)), expect_step=2),),
    ),
    ProbeCase(
        "16-token blocks, a new block every chunk: the full block list is sent",
        16,
        (ProbeRequest("small", 5000, ((2048, 128), (2048, 128), (904, 57)), expect_step=3),),
    ),
    ProbeCase(
        "a prompt in one chunk",
        5760,
        (ProbeRequest("short", 1000, ((1000, 1),), expect_step=1),),
    ),
)


def _flat(block_ids: Any) -> list[int]:
    items = list(block_ids)
    if items and isinstance(items[0], list | tuple):
        return [b for group in items for b in group]
    return [int(b) for b in items]


def _scheduler(mc: types.ModuleType, block_size: int) -> Any:
    sched = object.__new__(mc.MoRIIOConnectorScheduler)
    attrs: dict[str, Any] = {
        "mode": mc.MoRIIOMode.WRITE,
        "block_size": block_size,  # 0.14.1-0.29.0 gate
        "_full_attn_group_idx": 0,  # 0.30.0-0.31.0 gate
        "_full_attn_block_size": block_size,
        "_has_mamba": False,  # 0.32.0+ (_clamp_to_prompt_blocks)
        "blocks_per_sw": [0],
        "_group_block_sizes": [block_size],
        "_reqs_need_recv": {},
        "_reqs_need_save": {},
        "_reqs_need_pending_save": {},
        "_reqs_need_send": {},
        "_req_kv_params": {},
        "_reqs_save_mamba": {},  # the fork's mamba block ids (SITES.md 1)
        "transfer_id_to_request_id": {},
        "request_id_to_transfer_id": {},
    }
    # A fork or another patch may keep more per-request maps (the group-routing patch adds
    # `_reqs_save_groups`); whatever __init__ starts as an empty dict starts empty here too.
    for name in _empty_maps_of_init(mc.MoRIIOConnectorScheduler):
        attrs.setdefault(name, {})
    for name, value in attrs.items():
        setattr(sched, name, value)
    return sched


# `self.NAME = {}` or `= dict()`, annotated or not, as __init__ starts a per-request map (the
# parentheses make the annotated pattern's target "not simple", as an attribute target is).
_EMPTY_MAPS = tuple(
    f"{target} = {empty}"
    for target in ("HOLE_map", "(HOLE_map): HOLE_type")
    for empty in ("{}", "dict()")
)


def _empty_maps_of_init(cls: type[object]) -> list[str]:
    import inspect
    import textwrap

    try:
        source = textwrap.dedent(inspect.getsource(cls.__init__))
    except (OSError, TypeError):
        return []
    names = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Assign | ast.AnnAssign):
            continue
        for bound in filter(None, (match(p, node) for p in _EMPTY_MAPS)):
            target = bound["HOLE_map"]
            if isinstance(target, ast.Attribute) and match("self", target.value) is not None:
                names.append(target.attr)
    return names


def _kv_params(req_id: str) -> dict[str, Any]:
    return {
        "do_remote_decode": True,
        "transfer_id": f"t-{req_id}",
        "remote_engine_id": "decode-0",
        "remote_block_ids": [],
        "remote_host": "10.0.0.2",
        "remote_handshake_port": 6301,
        "remote_notify_port": 6401,
    }


@dataclass
class CaseRun:
    """What one case did: per request, the saves emitted as (step, flat block ids), and the
    block ids allocated to it step by step."""

    emitted: dict[str, list[tuple[int, list[int]]]]
    allocated: dict[str, list[list[int]]]


def run_case(mc: types.ModuleType, case: ProbeCase) -> CaseRun:
    """Drive the real build_connector_meta through one case, step by step."""
    sched = _scheduler(mc, case.block_size)
    requests = {
        r.req_id: types.SimpleNamespace(
            request_id=r.req_id,
            num_prompt_tokens=r.prompt,
            num_computed_tokens=0,
            kv_transfer_params=_kv_params(r.req_id) if r.disagg else None,
        )
        for r in case.requests
    }
    next_block = iter(range(1_000_000))
    run = CaseRun({r.req_id: [] for r in case.requests}, {r.req_id: [] for r in case.requests})
    for step in range(max(len(r.steps) for r in case.requests)):
        cached_ids: list[str] = []
        cached_blocks: list[Any] = []
        cached_computed: list[int] = []
        new_reqs: list[Any] = []
        scheduled: dict[str, int] = {}
        for spec in case.requests:
            if step >= len(spec.steps):
                continue
            tokens, n_blocks = spec.steps[step]
            ids = [next(next_block) for _ in range(n_blocks)]
            run.allocated[spec.req_id].append(ids)
            scheduled[spec.req_id] = tokens
            req = requests[spec.req_id]
            if step == 0:
                # A new request: the scheduler calls update_state_after_alloc first, which
                # records the blocks in the format this vLLM uses.
                blocks = types.SimpleNamespace(
                    get_block_ids=lambda allow_none=False, ids=ids: (ids,)
                )
                sched.update_state_after_alloc(req, blocks, 0)
                new_reqs.append(
                    types.SimpleNamespace(
                        req_id=spec.req_id, num_computed_tokens=req.num_computed_tokens
                    )
                )
            else:
                cached_ids.append(spec.req_id)
                cached_blocks.append((ids,) if ids else None)
                cached_computed.append(req.num_computed_tokens)
        output = types.SimpleNamespace(
            scheduled_new_reqs=new_reqs,
            # As the real SchedulerOutput carries them: each request's computed tokens
            # before this step (the older k3-chunk-gate script reads its progress from here).
            scheduled_cached_reqs=types.SimpleNamespace(
                req_ids=cached_ids, new_block_ids=cached_blocks, num_computed_tokens=cached_computed
            ),
            num_scheduled_tokens=scheduled,
            new_block_ids_to_zero=None,
            kv_connector_block_state=None,
        )
        meta = sched.build_connector_meta(output)
        for req_id, req_meta in meta.reqs_to_save.items():
            run.emitted[req_id].append((step + 1, _flat(req_meta.local_block_ids)))
        # After build_connector_meta the scheduler advances the computed tokens.
        for req_id, tokens in scheduled.items():
            requests[req_id].num_computed_tokens += tokens
    return run


def _saves(steps: list[int], chunks: int) -> str:
    if not steps:
        return f"no save in {chunks} chunks"
    return f"save at chunk {', '.join(map(str, steps))} of {chunks}"


def judge_case(case: ProbeCase, run: CaseRun) -> list[tuple[str, bool]]:
    """One (line, ok) per request of a case."""
    out = []
    for spec in case.requests:
        got = run.emitted[spec.req_id]
        steps = [step for step, _ in got]
        want = [] if spec.expect_step is None else [spec.expect_step]
        expected = f"chunk {want[0]} only" if want else "none"
        line = (
            f"{case.title} [{spec.req_id}]: {_saves(steps, len(spec.steps))}, expected {expected}"
        )
        ok = steps == want
        if ok and got:
            sent = got[0][1]
            blocks = [b for ids in run.allocated[spec.req_id][: spec.expect_step] for b in ids]
            if sent != blocks:
                ok = False
                line += f"; sent blocks {sent[:8]} ({len(sent)}), allocated {len(blocks)}"
        out.append((line, ok))
    return out


def direct_results() -> list[tuple[str, bool]]:
    """The direct drive of build_connector_meta: one (line, ok) per request of every case."""
    import importlib

    mc = importlib.import_module(MODULE)
    results: list[tuple[str, bool]] = []
    with Swap() as swap:
        # The producer role is process-global state set at connector start; pin it here.
        swap.attr(mc, "get_role", lambda: mc.ROLE.PRODUCER)
        for case in PROBE_CASES:
            results.extend(judge_case(case, run_case(mc, case)))
    return results


def _outcome(results: list[tuple[str, bool]], passed: str) -> ProbeOutcome:
    checks = tuple(line for line, _ in results)
    failures = [line for line, ok in results if not ok]
    if failures:
        summary = f"wrong in {len(failures)} of {len(results)} checks: " + "; ".join(failures)
        return ProbeOutcome(False, summary, checks)
    return ProbeOutcome(True, f"{passed} ({len(results)} checks)", checks)


# --------------------------------------------------------------------------------------------
# The second probe: vLLM's own `Scheduler.schedule()` of the tree drives the MoRIIO connector's
# scheduler side through chunked prefills, built on CPU the way vLLM's unit tests build one
# (a VllmConfig with a MoRIIO producer, one full-attention KV-cache group, a request with
# `do_remote_decode`), with a model config read from a config.json written here (no download,
# no tokenizer). The request's KV block is bigger than a chunk, as K3's padded pages are. It
# also records what `req.num_computed_tokens` holds inside build_connector_meta.

SCHEDULER_BLOCK = 5760
SCHEDULER_CHUNK = 2048


@dataclass(frozen=True)
class SchedulerCase:
    req_id: str
    prompt: int
    final_chunk: int  # the one chunk whose step must carry the save


SCHEDULER_CASES = (
    SchedulerCase("sched-2611", 2611, 2),  # 2,048 + 563 in one 5,760-token block
    SchedulerCase("sched-2050", 2050, 2),  # a last chunk of 2 tokens: no slack
    SchedulerCase("sched-5000", 5000, 3),  # 2,048 + 2,048 + 904
)

# A model vLLM knows, small; only its config is read (the scheduler runs no model).
_PROBE_MODEL_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "ffn_dim": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 65536,
    "word_embed_proj_dim": 64,
}


def _accepted(func: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments `func` takes (signatures differ between vLLM releases)."""
    import inspect

    params = inspect.signature(func).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _vllm_scheduler(model_dir: str) -> Any:
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    max_len = 16384
    model = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=max_len
    )
    scheduler_config = SchedulerConfig(
        **_accepted(
            SchedulerConfig,
            max_num_seqs=4,
            max_num_batched_tokens=SCHEDULER_CHUNK,
            max_model_len=max_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        )
    )
    cache = CacheConfig(
        **_accepted(
            CacheConfig,
            block_size=SCHEDULER_BLOCK,
            gpu_memory_utilization=0.9,
            cache_dtype="auto",
            enable_prefix_caching=False,
        )
    )
    transfer = KVTransferConfig(
        kv_connector="MoRIIOConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={
            "host_ip": "127.0.0.1",
            "handshake_port": 6301,
            "notify_port": 6401,
        },
    )
    config = VllmConfig(
        model_config=model,
        scheduler_config=scheduler_config,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    num_blocks = 64
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(
        **_accepted(
            FullAttentionSpec,
            block_size=SCHEDULER_BLOCK,
            num_kv_heads=1,
            head_size=1,
            dtype=torch.float32,
        )
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    return Scheduler(
        **_accepted(
            Scheduler.__init__,
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=SCHEDULER_BLOCK,
            log_stats=False,
        )
    )


@dataclass
class SchedulerRun:
    """Per chunk (1-based): whether the step's connector metadata carried the save, and
    `req.num_computed_tokens` inside build_connector_meta beside what scheduler_output says."""

    chunks: int = 0
    saves: list[int] = field(default_factory=list)
    seen: list[tuple[int, int | None]] = field(default_factory=list)
    # The prompt length the connector compares with (a fork's mamba_n1 truncates it by one).
    prompt: int = 0


def _seen_in_output(output: Any, req_id: str) -> int | None:
    for new in getattr(output, "scheduled_new_reqs", None) or ():
        if new.req_id == req_id:
            return int(new.num_computed_tokens)
    cached = output.scheduled_cached_reqs
    if req_id in cached.req_ids:
        return int(cached.num_computed_tokens[list(cached.req_ids).index(req_id)])
    return None


def drive_scheduler(scheduler: Any, case: SchedulerCase) -> SchedulerRun:
    """One request through vLLM's Scheduler until its prefill is done."""
    import dataclasses

    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    request = Request(
        **_accepted(
            Request.__init__,
            request_id=case.req_id,
            prompt_token_ids=[1] * case.prompt,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
        )
    )
    request.kv_transfer_params = {**_kv_params(case.req_id), "do_remote_prefill": False}
    run = SchedulerRun()
    connector = scheduler.connector.connector_scheduler
    build = connector.build_connector_meta

    def watched(scheduler_output: Any) -> Any:
        if case.req_id in scheduler_output.num_scheduled_tokens:
            live = scheduler.requests[case.req_id]
            run.seen.append(
                (int(live.num_computed_tokens), _seen_in_output(scheduler_output, case.req_id))
            )
            run.prompt = int(live.num_prompt_tokens)
        return build(scheduler_output)

    connector.build_connector_meta = watched
    try:
        scheduler.add_request(request)
        for _ in range(case.final_chunk + 3):
            output = scheduler.schedule()
            if case.req_id not in output.num_scheduled_tokens:
                break
            run.chunks += 1
            meta = output.kv_connector_metadata
            if case.req_id in getattr(meta, "reqs_to_save", {}):
                run.saves.append(run.chunks)
            ids = list(output.num_scheduled_tokens)
            done = {
                r: scheduler.requests[r].num_computed_tokens
                >= scheduler.requests[r].num_prompt_tokens
                for r in ids
            }
            fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
            values: dict[str, Any] = {
                "req_ids": ids,
                "req_id_to_index": {r: i for i, r in enumerate(ids)},
                "sampled_token_ids": [[7] if done[r] else [] for r in ids],
                "logprobs": None,
                "prompt_logprobs_dict": {},
                "pooler_output": [],
            }
            scheduler.update_from_output(
                output, ModelRunnerOutput(**{k: v for k, v in values.items() if k in fields})
            )
    finally:
        connector.build_connector_meta = build
    return run


def judge_scheduler(case: SchedulerCase, run: SchedulerRun) -> list[tuple[str, bool]]:
    want = [case.final_chunk]
    line = (
        f"Scheduler.schedule() [{case.req_id}]: {_saves(run.saves, run.chunks)}, "
        f"expected chunk {case.final_chunk} only"
    )
    out = [(line, run.saves == want and run.chunks == case.final_chunk)]
    live = [str(a) for a, _ in run.seen]
    told = [str(b) for _, b in run.seen]
    fresh = all(a == b for a, b in run.seen) and bool(run.seen)
    out.append(
        (
            f"Scheduler.schedule() [{case.req_id}]: inside build_connector_meta "
            f"(num_prompt_tokens {run.prompt}) "
            f"req.num_computed_tokens = {', '.join(live)} at chunks 1-{len(run.seen)}; "
            f"scheduler_output says {', '.join(told)}"
            + (" (the count before this step's chunk, not stale)" if fresh else " (STALE)"),
            fresh,
        )
    )
    return out


def probe_scheduler() -> list[tuple[str, bool]]:
    import importlib
    import json
    import logging
    import os
    import tempfile

    results: list[tuple[str, bool]] = []
    # The connector's scheduler side sets the process-wide MoRIIO role; later probes in this
    # process get back the role they had.
    mc = importlib.import_module(MODULE)
    role = mc.get_role()
    logging.disable(logging.WARNING)
    try:
        with Swap() as swap, tempfile.TemporaryDirectory(prefix="k3patch-probe-model-") as model:
            for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
                swap.env(key, "1")
            with open(os.path.join(model, "config.json"), "w") as handle:
                json.dump(_PROBE_MODEL_CONFIG, handle)
            scheduler = _vllm_scheduler(model)
            for case in SCHEDULER_CASES:
                results.extend(judge_scheduler(case, drive_scheduler(scheduler, case)))
    finally:
        mc.set_role(role)
        logging.disable(logging.NOTSET)
    return results


def probe_chunk_gate() -> ProbeOutcome:
    """Both probes: the direct drive of build_connector_meta, then vLLM's own Scheduler."""
    return _outcome(
        [*direct_results(), *probe_scheduler()],
        "the save is emitted once, with the final prefill chunk, by build_connector_meta "
        "driven directly and under vLLM's Scheduler",
    )
