"""moriio-chunk-gate's behaviour probes, run in the verify child (the tree's own interpreter, no
GPU, no network): the real build_connector_meta driven step by step on moriio-group-routing's
MoRIIO stand-ins, then vLLM's own Scheduler.schedule() of the tree through the same chunked
prompts."""

from __future__ import annotations

import importlib
import itertools
import logging
import os
import tempfile
from typing import Any

from k3patch.model import ProbeOutcome, attribute_assignments
from k3patch.probekit import Checks, Swap, call_accepted, source_of, stand_in
from k3patch.shapes import match

from ..moriio_group_routing.probe import CONNECTOR, drive_prefill, kv_params, stub_request

# (request id, prompt, (tokens, new blocks) per step, the one step (from 1) whose metadata must
# carry the save, None: no kv_transfer_params, never sent), per case with title and block size.
Request = tuple[str, int, tuple[tuple[int, int], ...], int | None]
DIRECT_CASES: tuple[tuple[str, int, tuple[Request, ...]], ...] = (
    (
        "K3: 2,611-token prompt, one 5,760-token block, chunks 2,048 + 563 (no new block)",
        5760,
        (
            ("k3-2611", 2611, ((2048, 1), (563, 0)), 2),
            # A request without kv_transfer_params beside it is never sent and never fails.
            ("local", 100, ((100, 1), (1, 0)), None),
        ),
    ),
    (
        "K3: 5,000-token prompt, chunks 2,048 + 2,048 + 904",
        5760,
        (("k3-3chunk", 5000, ((2048, 1), (2048, 0), (904, 0)), 3),),
    ),
    ("last chunk of 2 tokens: no slack", 5760, (("k3-2050", 2050, ((2048, 1), (2, 0)), 2),)),
    (
        "16-token blocks, a new block every chunk: the full block list is sent",
        16,
        (("small", 5000, ((2048, 128), (2048, 128), (904, 57)), 3),),
    ),
    ("a prompt in one chunk", 5760, (("short", 1000, ((1000, 1),), 1),)),
)

# The request maps build_connector_meta reads in some release (`_reqs_save_mamba`: the fork's,
# SITES.md 1); a fork's or patch's own (`_reqs_save_groups`) are what __init__ sets to {}.
REQUEST_MAPS = (
    "_reqs_need_recv _reqs_need_save _reqs_need_pending_save _reqs_need_send _req_kv_params "
    "_reqs_save_mamba transfer_id_to_request_id request_id_to_transfer_id"
).split()


def _scheduler(mc: Any, block_size: int) -> Any:
    """A MoRIIO scheduler holding what build_connector_meta and update_state_after_alloc read."""
    init = source_of(mc.MoRIIOConnectorScheduler.__init__)
    assigned = attribute_assignments([init] if init else [], "self")
    empty = [a for a, v in assigned if any(match(e, v) is not None for e in ("{}", "dict()"))]
    state: dict[str, Any] = {name: {} for name in [*REQUEST_MAPS, *empty]}
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
    saved = ", ".join(map(str, steps))
    return f"save at chunk {saved} of {chunks}" if steps else f"no save in {chunks} chunks"


def _direct_case(scheduler: Any, title: str, requests: tuple[Request, ...], checks: Checks) -> None:
    """The real build_connector_meta through one case, a check per request."""
    counter = itertools.count()  # block ids in allocation order, step by step across requests
    allocated: dict[str, list[list[int]]] = {req_id: [] for req_id, *_ in requests}
    for step in range(max(len(steps) for _, _, steps, _ in requests)):
        for req_id, _, steps, _ in requests:
            if step < len(steps):
                allocated[req_id].append(list(itertools.islice(counter, steps[step][1])))
    plans = [
        (
            stub_request(req_id, prompt, kv_params("decode", f"t-{req_id}") if want else None),
            [(tokens, [ids]) for (tokens, _), ids in zip(steps, allocated[req_id], strict=True)],
        )
        for req_id, prompt, steps, want in requests
    ]
    emitted: dict[str, list[tuple[int, list[int]]]] = {req_id: [] for req_id, *_ in requests}
    for step, saves in enumerate(drive_prefill(scheduler, plans), 1):
        for req_id, meta in saves.items():
            ids = list(meta.local_block_ids)
            nested = ids and isinstance(ids[0], list | tuple)
            emitted[req_id].append((step, [*itertools.chain(*ids)] if nested else [*map(int, ids)]))
    for req_id, _, steps, want in requests:
        got = emitted[req_id]
        saved = [step for step, _ in got]
        expected = f"chunk {want} only" if want else "none"
        line = f"{title} [{req_id}]: {_saves(saved, len(steps))}, expected {expected}"
        ok = saved == ([] if want is None else [want])
        blocks = [b for ids in allocated[req_id][:want] for b in ids]
        if ok and got and got[0][1] != blocks:
            ok = False
            line += f"; sent blocks {got[0][1][:8]} ({len(got[0][1])}), allocated {len(blocks)}"
        checks.record(line, ok)


# The second probe: vLLM's own `Scheduler.schedule()` drives the connector's scheduler side
# through chunked prefills, built on CPU as vLLM's unit tests build one (a MoRIIO producer, one
# full-attention group, a config.json written here: no download, no tokenizer), with a block
# bigger than a chunk as K3's padded pages are; it also records `req.num_computed_tokens`.
BLOCK = 5760
CHUNK = 2048
MAX_LEN = 16384

# (request id, prompt, the one chunk whose step must carry the save)
SCHEDULER_CASES = (
    ("sched-2611", 2611, 2),  # 2,048 + 563 in one 5,760-token block
    ("sched-2050", 2050, 2),  # a last chunk of 2 tokens: no slack
    ("sched-5000", 5000, 3),  # 2,048 + 2,048 + 904
)

# A model vLLM knows, small; only its config is read (the scheduler runs no model).
_PROBE_MODEL_CONFIG = (
    '{"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64, '
    '"num_attention_heads": 2, "num_hidden_layers": 1, "ffn_dim": 128, "vocab_size": 1000, '
    '"max_position_embeddings": 65536, "word_embed_proj_dim": 64}'
)


def _vllm_scheduler(model_dir: str) -> Any:
    """vLLM's Scheduler with a MoRIIO producer, keyword arguments as this release takes them."""
    torch = importlib.import_module("torch")
    vc = importlib.import_module("vllm.config")
    specs = importlib.import_module("vllm.v1.kv_cache_interface")
    scheduler = importlib.import_module("vllm.v1.core.sched.scheduler")
    structured_output = importlib.import_module("vllm.v1.structured_output")
    extra = {"host_ip": "127.0.0.1", "handshake_port": 6301, "notify_port": 6401}
    sched = dict(max_num_seqs=4, max_num_batched_tokens=CHUNK, max_model_len=MAX_LEN)
    cache = dict(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto")
    config = vc.VllmConfig(
        model_config=vc.ModelConfig(
            model=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=MAX_LEN
        ),
        scheduler_config=call_accepted(
            vc.SchedulerConfig, **sched, enable_chunked_prefill=True, is_encoder_decoder=False
        ),
        cache_config=call_accepted(vc.CacheConfig, **cache, enable_prefix_caching=False),
        kv_transfer_config=vc.KVTransferConfig(
            kv_connector="MoRIIOConnector", kv_role="kv_producer", kv_connector_extra_config=extra
        ),
        device_config=vc.DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = 64
    spec = call_accepted(
        specs.FullAttentionSpec, block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    groups = [specs.KVCacheGroupSpec(["layer"], spec)]
    kv_cache = specs.KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups)
    return call_accepted(
        scheduler.Scheduler,
        vllm_config=config,
        kv_cache_config=kv_cache,
        structured_output_manager=structured_output.StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=False,
    )


def _seen_in_output(output: Any, req_id: str) -> int | None:
    for new in getattr(output, "scheduled_new_reqs", None) or ():
        if new.req_id == req_id:
            return int(new.num_computed_tokens)
    cached = output.scheduled_cached_reqs
    if req_id in cached.req_ids:
        return int(cached.num_computed_tokens[list(cached.req_ids).index(req_id)])
    return None


def drive_scheduler(scheduler: Any, req_id: str, prompt: int, final: int, checks: Checks) -> None:
    """One request through vLLM's Scheduler until its prefill is done: whether each chunk's
    connector metadata carried the save, and `req.num_computed_tokens` inside
    build_connector_meta beside what scheduler_output says."""
    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    fields = dict(request_id=req_id, prompt_token_ids=[1] * prompt, pooling_params=None)
    request = call_accepted(Request, sampling_params=SamplingParams(max_tokens=1), **fields)
    request.kv_transfer_params = {**kv_params("decode", f"t-{req_id}"), "do_remote_prefill": False}
    chunks, saves = 0, []
    seen: list[tuple[int, int | None]] = []
    prompts: list[int] = []  # the prompt the connector compares with (mamba_n1 truncates it)
    connector = scheduler.connector.connector_scheduler
    build = connector.build_connector_meta

    def watched(scheduler_output: Any) -> Any:
        if req_id in scheduler_output.num_scheduled_tokens:
            live = scheduler.requests[req_id]
            seen.append((int(live.num_computed_tokens), _seen_in_output(scheduler_output, req_id)))
            prompts.append(int(live.num_prompt_tokens))
        return build(scheduler_output)

    with Swap() as swap:
        swap.attr(connector, "build_connector_meta", watched)
        scheduler.add_request(request)
        for _ in range(final + 3):
            output = scheduler.schedule()
            if req_id not in output.num_scheduled_tokens:
                break
            chunks += 1
            if req_id in getattr(output.kv_connector_metadata, "reqs_to_save", {}):
                saves.append(chunks)
            ids = list(output.num_scheduled_tokens)
            done = [scheduler.requests[r] for r in ids]
            sampled = [[7] if r.num_computed_tokens >= r.num_prompt_tokens else [] for r in done]
            ran: dict[str, Any] = dict(req_ids=ids, logprobs=None, prompt_logprobs_dict={})
            ran.update(req_id_to_index={r: i for i, r in enumerate(ids)}, pooler_output=[])
            model_output = call_accepted(ModelRunnerOutput, sampled_token_ids=sampled, **ran)
            scheduler.update_from_output(output, model_output)
    head = f"Scheduler.schedule() [{req_id}]:"
    line = f"{head} {_saves(saves, chunks)}, expected chunk {final} only"
    checks.record(line, saves == [final] and chunks == final)
    fresh = all(a == b for a, b in seen) and bool(seen)
    checks.record(
        f"{head} inside build_connector_meta (num_prompt_tokens {prompts[-1] if prompts else 0}) "
        f"req.num_computed_tokens = {', '.join(str(a) for a, _ in seen)} at chunks "
        f"1-{len(seen)}; scheduler_output says {', '.join(str(b) for _, b in seen)}"
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
    with Swap() as swap, tempfile.TemporaryDirectory(prefix="k3patch-probe-model-") as model:
        # The scheduler side sets the process-wide MoRIIO role: later probes get theirs back.
        swap.on_exit(mc.set_role, mc.get_role())
        logging.disable(logging.WARNING)
        swap.on_exit(logging.disable, logging.NOTSET)
        for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            swap.env(key, "1")
        with open(os.path.join(model, "config.json"), "w") as handle:
            handle.write(_PROBE_MODEL_CONFIG)
        scheduler = _vllm_scheduler(model)
        for req_id, prompt, final in SCHEDULER_CASES:
            drive_scheduler(scheduler, req_id, prompt, final, checks)
    return checks.outcome(
        holds="the save is emitted once, with the final prefill chunk, by build_connector_meta "
        "driven directly and under vLLM's Scheduler ({ran} checks)",
        broken="wrong in {failed} of {ran} checks: {failures}",
    )
