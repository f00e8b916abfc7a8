"""Issue 28 item 5: after preemption and resumption, which per-group block lists does the fixed
MoRIIO connector send? The chunk-gate oracle's seeded workloads through vLLM's own Scheduler, run
in a tree's interpreter; for each request that was preempted and saved, the save's
`local_block_ids` and moriio-group-routing's per-group lists, against the scheduler's blocks.

    .venv-vllm/bin/python benchmarks/preemption_groups.py SITE SEEDS

SITE: a tree with both MoRIIO patches applied (a copy of a fork tree after `k3patch apply`);
SEEDS: comma-separated workload seeds (0,5,13,27,28,33 preempt on fork a).

Measured 2026-12-05 on fork a, seeds 5,13,28: k3patch's earlier growth (before the resume branch)
sent 3 of 3 preempted requests' lists with their blocks twice (`[[10, 8, 9, 10, 8, 9, 11, 12]]`
for `[10, 8, 9, 11, 12]`); today's post-image sends 0 wrong. verify's routing probe judges the
same (patches/moriio_group_routing/resumes.py, over the chunk-gate oracle's 40 seeds)."""

import importlib
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, sys.argv[1])
for name, where in (("k3patch", ROOT / "k3patch"), ("k3patch.patches", ROOT / "patches")):
    module = types.ModuleType(name)
    module.__path__ = [str(where)]
    sys.modules[name] = module

from k3patch.patches.moriio_chunk_gate import workloads  # noqa: E402
from k3patch.patches.moriio_group_routing.forms import FIELD_NAME  # noqa: E402

mc = importlib.import_module(workloads.CONNECTOR)
build = mc.MoRIIOConnectorScheduler.build_connector_meta
sent: dict[str, list] = {}


def recorded(self, output):
    meta = build(self, output)
    for req_id, save in (getattr(meta, "reqs_to_save", None) or {}).items():
        sent.setdefault(req_id, []).append((list(save.local_block_ids), getattr(save, FIELD_NAME)))
    return meta


mc.MoRIIOConnectorScheduler.build_connector_meta = recorded
doubled = 0
with workloads.scheduler_setting(mc) as model:
    for seed in map(int, sys.argv[2].split(",")):
        sent.clear()
        seen, _ = workloads.run_workload(workloads.generate(seed), model)
        for req_id, s in seen.items():
            for local, groups in sent.get(req_id, []) if s.preempted else []:
                want = s.due[1] if s.due else None
                ok = groups is not None and groups[0] == want
                doubled += not ok
                print(f"seed {seed} {req_id[:5]} preempted at {s.preempted}, saved at {s.saves}")
                print(f"  scheduler's blocks {want}\n  local_block_ids   {local}")
                print(f"  per-group lists   {groups}{'' if ok else '  <- WRONG'}")
print(f"{doubled} preempted request(s) sent per-group lists other than their blocks")
