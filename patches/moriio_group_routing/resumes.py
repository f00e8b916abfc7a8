"""moriio-group-routing's oracle through vLLM's own Scheduler (probe.py's last check): the
chunk-gate oracle's seeded workloads (several requests a step, pools small enough to preempt in
mid-prefill, resumptions), the tree's MoRIIO connector their producer. Reference model: each save
carries, besides its `local_block_ids`, per KV-cache group the request's blocks as the scheduler
holds them at the save's step, every block exactly once, in allocation order. A request resumed
after preemption is where k3patch's earlier form went wrong: vLLM lists all its blocks as new
(CachedRequestData.resumed_req_ids), and that form joined them to the lists captured again at
its resumption, so the decode node got every block twice. This scheduler has one KV-cache group
(a full-attention spec, as the chunk-gate oracle builds it); several groups are batches.py's."""

from __future__ import annotations

import importlib
from functools import partial
from typing import Any

from k3patch import probekit
from k3patch.probekit import Checks, Swap

from ..moriio_chunk_gate import workloads
from .forms import FIELD_NAME
from .standins import CONNECTOR

# The chunk-gate oracle's seeds; on fork a, 6 of the 40 workloads save 7 resumed requests.
RESUME_SEEDS = range(workloads.WORKLOADS)


def probe_resumes(checks: Checks, seeds: Any = RESUME_SEEDS) -> None:
    """A check per workload through this tree's Scheduler, each save's per-group lists judged;
    the first failing one shrunk (the chunk-gate oracle's shrinker)."""
    connector = importlib.import_module(CONNECTOR)
    scheduler_class = connector.MoRIIOConnectorScheduler
    build = scheduler_class.build_connector_meta

    def wrongs(w: workloads.Workload, model_dir: str) -> tuple[list[str], str]:
        sent: dict[str, list[Any]] = {}

        def recorded(connector: Any, output: Any) -> Any:
            meta = build(connector, output)
            for req_id, save in (getattr(meta, "reqs_to_save", None) or {}).items():
                sent.setdefault(req_id, []).append(getattr(save, FIELD_NAME, None))
            return meta

        with Swap() as swap:
            swap.attr(scheduler_class, "build_connector_meta", recorded)
            seen, _ = workloads.run_workload(w, model_dir)
        wrong = []
        resumed = 0
        for i, (req_id, s) in enumerate(seen.items()):
            if s.due is None:
                continue  # never due: whether and when it leaves is moriio-chunk-gate's question
            resumed += bool(s.preempted and s.saves)
            for (step, _), groups in zip(s.saves, sent.get(req_id, []), strict=False):
                if step != s.due[0]:
                    continue  # a save at another step: moriio-chunk-gate's question
                want = [s.due[1]]
                if groups != want:
                    pre = f", preempted at step(s) {s.preempted}" if s.preempted else ""
                    wrong.append(
                        f"r{i} saved at step {step} with per-group lists {groups}, expected its "
                        f"blocks once each {want}{pre}"
                    )
        return wrong, f"{len(w.asks)} requests, {resumed} saved after a preemption"

    with workloads.scheduler_setting(connector) as model:
        oracle = partial(wrongs, model_dir=model)
        probekit.seeded(
            checks, "scheduler workload", seeds, workloads.generate, oracle, workloads.shrink
        )
