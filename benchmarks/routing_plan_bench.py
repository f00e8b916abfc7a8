"""What moriio-group-routing's transfer plan costs per request, offsets keyed per layer (k3patch's
first post-image) or per KV-cache group and tensor geometry (today's), on a real fork tree.

The fork tree (tests/forktree: the vLLM 0.28.0 wheel + the recipe's older scripts) is patched by
this checkout's `k3patch apply`; a copy gets the per-layer key back (the one line that differs).
In the tree's own interpreter (torch CPU) each copy's real `MoRIIOWriter._prepare_transfer_plan`
runs once per layer of a request, with the tree's real `_compute_block_transfer_offsets`,
`compute_block_transfer_offsets`, `merge_contiguous_blocks` and k3patch's group map over a real
KVCacheConfig: K3's layout, three KDA groups of 23 layers (the 69 KDA layers of
kda_sync_bench.py) and one MLA group of 23, MLA caches (blocks, block size, 576) bf16, blocks
of 5760 tokens (attention pages padded to the KDA page, shared/SITES.md section 2). Tensors are
on torch's meta device (only shape, stride and dtype are read). How the fork lays out KDA state
for MoRIIO is not public: a KDA layer gets a split K/V tensor that 0.28.0's geometry code takes,
the j-th layer of every KDA group sharing one, as vLLM backs them; without Mamba prefix caching
a KDA group holds one block per request. Block ids are drawn from a shuffled pool (a fragmented
cache, so no run of blocks merges).

The floor, measured in the same run on the same tree: the same plan calls with every offsets
lookup a hit (the plan's cost were offsets free). Ratios against it; medians of --repeat runs.

    .venv/bin/python benchmarks/routing_plan_bench.py [--python PY] [--tokens 8192,131072,900000]
        [--block-size 5760] [--layers 23] [--repeat 15] [--json OUT]

PY: an interpreter with torch and vLLM's pure-Python deps (default $K3PATCH_TEST_VLLM_PYTHON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from conftest import pristine_tree  # noqa: E402
from forktree import BASE_VERSION, build  # noqa: E402

ENGINE = "vllm/distributed/kv_transfer/kv_connector/v1/moriio/moriio_engine.py"
GROUP_KEY = "geometry_key = (_k3patch_group, *_get_write_geometry_key(layer_cache))"
LAYER_KEY = "geometry_key = (task.layer_name, *_get_write_geometry_key(layer_cache))"

CHILD = r"""
import json, random, statistics, sys, time, weakref
from types import SimpleNamespace
sys.path.insert(0, sys.argv[1])
import torch
from vllm.v1 import kv_cache_interface as kvi
from vllm.distributed.kv_transfer.kv_connector.v1.moriio import (
    moriio_common as common, moriio_connector as connector, moriio_engine as engine,
    moriio_layout as layout)
tokens, block_size, per_group, repeat = map(int, sys.argv[2:6])
blocks = -(-tokens // block_size)
pool = max(4 * blocks, 1024)
mla = kvi.MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=576,
                           dtype=torch.bfloat16)
kda = kvi.MambaSpec(block_size=block_size, shapes=((4, 2048), (32, 128, 128)),
                    dtypes=(torch.bfloat16, torch.float32))
names = [[f"model.layers.{4 * j + g}.{'mla' if g == 3 else 'kda'}" for j in range(per_group)]
         for g in range(4)]
groups = [kvi.KVCacheGroupSpec(n, mla if g == 3 else kda) for g, n in enumerate(names)]
config = kvi.KVCacheConfig(num_blocks=pool, kv_cache_tensors=[], kv_cache_groups=groups)
meta = dict(device="meta", dtype=torch.bfloat16)
shared = [torch.empty((2, pool, block_size, 1, 64), **meta) for _ in range(per_group)]
caches = {n: shared[j] for g in range(3) for j, n in enumerate(names[g])}
caches.update({n: torch.empty((pool, block_size, 576), **meta) for n in names[3]})

worker = object.__new__(connector.MoRIIOConnectorWorker)
worker.__dict__.update(
    kv_caches=caches, layer_to_spec=layout.build_layer_to_spec(config), world_size=1,
    model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 1),
    layer_name_to_local_kv_cache_metadata={n: [b""] for n in sorted(caches)})
group_of_layer, _ = connector._k3patch_kv_cache_group_index(config)
worker._k3patch_group_of_layer = group_of_layer
writer = object.__new__(engine.MoRIIOWriter)
writer._worker_ref = weakref.ref(worker)
rng = random.Random(0)
ids = list(range(pool))
rng.shuffle(ids)
local = [ids[:blocks] if g == 3 else [ids[blocks + g]] for g in range(4)]
rng.shuffle(ids)
remote = [ids[:blocks] if g == 3 else [ids[blocks + g]] for g in range(4)]
peer = SimpleNamespace(num_blocks=pool)
layers = [n for g in names for n in g]
tasks = [SimpleNamespace(layer_name=n, k3patch_group_block_ids=local, request_id="r",
                         transfer_id="t") for n in layers]

def one_request(offsets=None):
    info = common.RemoteAllocInfo(block_ids=remote[3], k3patch_group_block_ids=remote)
    if offsets is not None:
        info.transfer_offsets.update(offsets)
    start = time.perf_counter()
    for task in tasks:
        writer._prepare_transfer_plan(task, info, peer)
    return time.perf_counter() - start, info

calls = []
real = worker._compute_block_transfer_offsets
worker._compute_block_transfer_offsets = lambda *a, **k: calls.append(a[0]) or real(*a, **k)
_, warm = one_request()
del worker._compute_block_transfer_offsets
plans = {t.layer_name: writer._prepare_transfer_plan(t, warm, peer) for t in tasks}
sends = {n: (p.transfer_local_offsets, p.transfer_remote_offsets, p.transfer_sizes)
         for n, p in plans.items()}
times = [one_request()[0] for _ in range(repeat)]
floor = [one_request(warm.transfer_offsets)[0] for _ in range(repeat)]
print(json.dumps(dict(
    blocks=blocks, layers=len(layers), offsets_calls=len(calls),
    plan_s=statistics.median(times), floor_s=statistics.median(floor),
    sends=sorted(json.dumps([n, *s]) for n, s in sends.items()))))
"""


def prepare(scratch: Path) -> dict[str, Path]:
    """Fork tree a after this checkout's apply, and a copy with the per-layer key."""
    group, layer = scratch / "group", scratch / "per-layer"
    build("a", pristine_tree(BASE_VERSION), group)
    env = {**os.environ, "NO_COLOR": "1"}
    apply = [sys.executable, "-m", "k3patch", "apply", "--vllm", str(group), "--quiet"]
    only = [*apply, "--only", "moriio-group-routing"]
    proc = subprocess.run(only, env=env, cwd=scratch, stdout=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise SystemExit(f"k3patch apply exited {proc.returncode}")
    shutil.copytree(group, layer)
    text = (layer / ENGINE).read_text()
    if text.count(GROUP_KEY) != 1:
        raise SystemExit(f"the applied engine has {text.count(GROUP_KEY)} `{GROUP_KEY}`")
    (layer / ENGINE).write_text(text.replace(GROUP_KEY, LAYER_KEY))
    return {"per-layer": layer, "group": group}


def measure(python: str, site: Path, tokens: int, args: argparse.Namespace) -> dict:
    cmd = [python, "-c", CHILD, str(site), str(tokens), str(args.block_size), str(args.layers)]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    out = subprocess.run([*cmd, str(args.repeat)], capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"the timing child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--python", default=os.environ.get("K3PATCH_TEST_VLLM_PYTHON"))
    parser.add_argument("--tokens", default="8192,131072,900000")
    parser.add_argument("--block-size", type=int, default=5760)
    parser.add_argument("--layers", type=int, default=23, help="layers per KV-cache group")
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not args.python:
        parser.error("--python or K3PATCH_TEST_VLLM_PYTHON: an interpreter with torch")
    scratch = Path(tempfile.mkdtemp(prefix="k3routing-bench-"))
    sites = prepare(scratch)
    rows = []
    print(
        f"K3 layout: 3 KDA groups + 1 MLA group, {args.layers} layers each; "
        f"blocks of {args.block_size} tokens; median of {args.repeat} requests"
    )
    head = "tokens  blocks  keying     offsets calls  plan ms/request  floor ms  x floor"
    print(head)
    for tokens in (int(t) for t in args.tokens.split(",")):
        got = {name: measure(args.python, site, tokens, args) for name, site in sites.items()}
        if got["per-layer"]["sends"] != got["group"]["sends"]:
            raise SystemExit(f"{tokens} tokens: the two keyings plan different transfers")
        floor = got["group"]["floor_s"]
        for name, r in got.items():
            print(
                f"{tokens:>7} {r['blocks']:>6}  {name:9} {r['offsets_calls']:>5} of "
                f"{r['layers']:<5} {1e3 * r['plan_s']:>12.3f} {1e3 * floor:>11.3f} "
                f"{r['plan_s'] / floor:>7.1f}"
            )
            rows.append({"tokens": tokens, "keying": name, "floor_s": floor, **r, "sends": None})
        ratio = got["per-layer"]["plan_s"] / got["group"]["plan_s"]
        print(f"        per-layer / group {ratio:.1f}x; the same sends on all {r['layers']} layers")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    shutil.rmtree(scratch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
