"""vLLM's own Scheduler on CPU, built as vLLM's unit tests build one (a MoRIIO producer, one
full-attention group in K3's block, a config.json written here: no download), with the tree's
MoRIIO connector as its producer: what the workload oracle (workloads.py) and probe.py's Scheduler
rows share (the scheduler and its setting, a request as the router sends it, the model's side of a
step)."""

from __future__ import annotations

import contextlib
import importlib
import logging
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from k3patch.probekit import Swap, call_accepted

from ..moriio_group_routing.standins import kv_params

CHUNK = 2048  # max_num_batched_tokens in K3's recipe
K3_BLOCK = 5760  # K3's attention page padded to the KDA page

# The proxy's request id carries both nodes' ZMQ addresses (kv_params' ports): 0.23.0's
# add_new_req reads the decode peer's from it and raises without them (0.28.0 falls back).
_PEER = "host:127.0.0.1,handshake:6301,notify:61005"


def router_id(name: str) -> str:
    return f"{name}___prefill_addr_{_PEER}___decode_addr_{_PEER}_{'0' * 32}"


MAX_LEN = 16384

# A model vLLM knows, small; only its config is read (the scheduler runs no model).
_PROBE_MODEL_CONFIG = (
    '{"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64, '
    '"num_attention_heads": 2, "num_hidden_layers": 1, "ffn_dim": 128, "vocab_size": 1000, '
    '"max_position_embeddings": 65536, "word_embed_proj_dim": 64}'
)


def vllm_scheduler(
    model_dir: str,
    block: int = K3_BLOCK,
    budget: int = CHUNK,
    pool: int = 64,
    prefix_caching: bool = False,
    reserve: bool = True,
    cap: int = 0,
    policy: str = "fcfs",
) -> Any:
    """vLLM's Scheduler with a MoRIIO producer, keyword arguments as this release takes them:
    `block`-token blocks, `budget` tokens a step, `pool` blocks."""
    torch = importlib.import_module("torch")
    vc = importlib.import_module("vllm.config")
    specs = importlib.import_module("vllm.v1.kv_cache_interface")
    scheduler = importlib.import_module("vllm.v1.core.sched.scheduler")
    structured_output = importlib.import_module("vllm.v1.structured_output")
    extra = {"host_ip": "127.0.0.1", "handshake_port": 6301, "notify_port": 6401}
    sched = dict(
        max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=MAX_LEN, policy=policy
    )
    sched.update(enable_chunked_prefill=True, is_encoder_decoder=False)
    sched.update(scheduler_reserve_full_isl=reserve, long_prefill_token_threshold=cap)
    cache = dict(block_size=block, gpu_memory_utilization=0.9, cache_dtype="auto")
    config = vc.VllmConfig(
        model_config=vc.ModelConfig(
            model=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=MAX_LEN
        ),
        scheduler_config=call_accepted(vc.SchedulerConfig, **sched),
        cache_config=call_accepted(vc.CacheConfig, **cache, enable_prefix_caching=prefix_caching),
        kv_transfer_config=vc.KVTransferConfig(
            kv_connector="MoRIIOConnector", kv_role="kv_producer", kv_connector_extra_config=extra
        ),
        device_config=vc.DeviceConfig("cpu"),
    )
    config.cache_config.num_gpu_blocks = pool
    spec = dict(block_size=block, num_kv_heads=1, head_size=1, dtype=torch.float32)
    spec = call_accepted(specs.FullAttentionSpec, **spec)
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


def new_request(
    req_id: str, tokens: list[int], max_tokens: int, transfer: str, **extra: Any
) -> Any:
    """A vLLM Request as a proxied prefill node gets it: sent to a decode node (KV transfer
    `transfer`) unless `transfer` is empty; `extra`: Request's keywords this release may take."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    fields = dict(request_id=req_id, prompt_token_ids=tokens, pooling_params=None, **extra)
    request = call_accepted(Request, sampling_params=sampling, **fields)
    if transfer:
        request.kv_transfer_params = {**kv_params("decode", transfer), "do_remote_prefill": False}
    return request


def run_step(scheduler: Any, output: Any, until: str, sent: set[str]) -> None:
    """The model's side of a step: a token for each scheduled request whose computed tokens
    reach its `until` (num_tokens or num_prompt_tokens); `sent`: the KV sends that finished."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    ids = list(output.num_scheduled_tokens)
    live = [scheduler.requests[r] for r in ids]
    sampled = [[7] if r.num_computed_tokens >= getattr(r, until) else [] for r in live]
    ran: dict[str, Any] = dict(req_ids=ids, logprobs=None, prompt_logprobs_dict={})
    ran.update(req_id_to_index={r: i for i, r in enumerate(ids)}, pooler_output=[])
    if sent:
        ran["kv_connector_output"] = call_accepted(KVConnectorOutput, finished_sending=sent)
    model_output = call_accepted(ModelRunnerOutput, sampled_token_ids=sampled, **ran)
    scheduler.update_from_output(output, model_output)


def seen_in_output(output: Any, req_id: str) -> int | None:
    """The request's num_computed_tokens as scheduler_output tells it."""
    for new in output.scheduled_new_reqs:
        if new.req_id == req_id:
            return int(new.num_computed_tokens)
    cached = output.scheduled_cached_reqs
    if req_id in cached.req_ids:
        return int(cached.num_computed_tokens[list(cached.req_ids).index(req_id)])
    return None


@contextlib.contextmanager
def scheduler_setting(mc: Any) -> Iterator[str]:
    """What vLLM's Scheduler needs here, undone on exit; yields the directory of the model's
    config."""
    with Swap() as swap, tempfile.TemporaryDirectory(prefix="k3patch-probe-model-") as model:
        # The scheduler side sets the process-wide MoRIIO role: later probes get theirs back.
        swap.on_exit(mc.set_role, mc.get_role())
        # Every Scheduler here drives the tree's connector as a MoRIIO producer.
        swap.attr(mc, "get_role", lambda: mc.ROLE.PRODUCER)
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
