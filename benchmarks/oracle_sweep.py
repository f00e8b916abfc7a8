"""verify's probes on every tree where a patch is pending (issue 28): per tree and pending patch,
the probe on the unpatched tree (run as verify runs it, through tests/probe_child: verify itself
refuses pending patches) must fail naming a seed and a shrunk case where the patch has an oracle,
and `k3patch verify` after `k3patch apply` must pass.

    .venv/bin/python benchmarks/oracle_sweep.py [--json FILE] [TREE...]

TREE: a cached tree of ~/.cache/k3patch/trees (0.23.0 ... 0.34.0, fork-a-<hash> ...); default all.
Prints a Markdown table (and the JSON with --json).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
import probe_child  # noqa: E402

from k3patch.registry import all_patches  # noqa: E402

TREES = Path.home() / ".cache" / "k3patch" / "trees"
PYTHON = str(ROOT / ".venv-vllm" / "bin" / "python")
ORACLE = {"moriio-chunk-gate": "workload", "moriio-group-routing": "batch"}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "k3patch", *args], capture_output=True, text=True, check=False
    )


def named(summary: str, noun: str) -> str:
    """The first failing seed and the smallest failing case the summary names, or why not."""
    seed = re.search(rf"{noun} seed (\d+): ", summary)
    small = re.search(rf"smallest failing {noun} of seed \d+: ([^;]*(?:;[^;]*)?)", summary)
    if not seed or not small:
        return "NO SEED/CASE NAMED"
    return f"seed {seed[1]}; smallest: {small[1][:160]}"


def sweep(name: str, scratch: Path) -> list[dict]:
    site = scratch / name
    shutil.copytree(TREES / name, site, ignore=shutil.ignore_patterns(".complete"))
    status = json.loads(cli("status", "--vllm", str(site), "--json").stdout)
    pending = [p["id"] for p in status["patches"] if p["verdict"] == "pending"]
    patches = {p.id: p for p in all_patches()}
    rows = []
    for pid in pending:
        start = time.monotonic()
        probe = probe_child.run_probe(patches[pid], PYTHON, site)
        row = {"tree": name, "patch": pid, "unpatched_ok": probe["ok"]}
        row["unpatched_s"] = round(time.monotonic() - start, 1)
        row["named"] = named(probe["summary"], ORACLE[pid]) if pid in ORACLE else "-"
        row["unpatched_summary"] = probe["summary"][:300]
        rows.append(row)
    applied = cli("apply", "--vllm", str(site), "--quiet")
    start = time.monotonic()
    found = json.loads(cli("verify", "--vllm", str(site), "--python", PYTHON, "--json").stdout)
    wall = round(time.monotonic() - start, 1)
    for row in rows:
        check = next(p for p in found["verify"]["patches"] if p["id"] == row["patch"])
        probe = check.get("probe") or {}
        row.update(apply_rc=applied.returncode, verdict=check["verdict"], verify_s=wall)
        row.update(applied_ok=probe.get("ok"), applied_summary=str(probe.get("summary"))[:300])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", nargs="*")
    parser.add_argument("--json")
    args = parser.parse_args()
    names = args.trees or sorted(p.name for p in TREES.iterdir() if p.is_dir())
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="k3oracle-sweep-") as scratch:
        for name in names:
            rows += sweep(name, Path(scratch))
            for row in rows[-4:]:
                print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print("| tree | pending patch | unpatched probe | seed and shrunk case named | applied probe |")
    print("|---|---|---|---|---|")
    for r in rows:
        un = "fails" if r["unpatched_ok"] is False else "PASSES"
        ap = "passes" if r.get("applied_ok") else f"FAILS ({r.get('verdict')})"
        print(f"| {r['tree']} | {r['patch']} | {un} | {r['named']} | {ap} |")
    bad = [r for r in rows if r["unpatched_ok"] is not False or not r.get("applied_ok")]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
