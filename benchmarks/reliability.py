"""The reliability campaign behind the README's "Reliability" table. Run by hand:

    .venv/bin/python benchmarks/reliability.py [--apply-runs 200] [--revert-runs 100]

Random SIGKILLs during real applies and reverts of a real vLLM tree, each followed by the
recovering run and a byte-for-byte comparison (tests/crash_campaign.py), plus a kill at every
named commit step. Prints a table and writes benchmarks/RELIABILITY.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import _copy_minimal, pristine_tree  # noqa: E402
from crash_campaign import campaign, k3, source_hashes  # noqa: E402

from k3patch import engine  # noqa: E402
from k3patch.registry import all_patches  # noqa: E402
from k3patch.tree import locate  # noqa: E402


def step_kills(pristine: Path, work: Path) -> tuple[int, int]:
    """Kill at every named commit step (both ops); returns (runs, mixed trees after recovery)."""
    plan = engine.apply(locate(pristine), check=True).plan
    assert plan is not None
    steps = [
        "blobs-written",
        "journal-written",
        *(f"replaced:{r}" for r in plan.new_texts),
        "replaced:.k3patch/state.json",
        "pycache-synced",
        "journal-removed",
    ]
    ref = work / "ref"
    shutil.copytree(pristine, ref)
    k3("apply", "--vllm", str(ref))
    patched, original = source_hashes(ref), source_hashes(pristine)
    runs = mixed = 0
    for op, start, want in (("apply", pristine, patched), ("revert", ref, original)):
        for step in steps:
            site = work / f"step-{op}-{runs}"
            shutil.copytree(start, site)
            import os
            import subprocess

            subprocess.run(
                [sys.executable, "-m", "k3patch", op, "--vllm", str(site)],
                env={**os.environ, "K3PATCH_TEST_CRASH_AT": step},
                capture_output=True,
            )
            k3(op, "--vllm", str(site))
            runs += 1
            mixed += source_hashes(site) != want
            shutil.rmtree(site)
    return runs, mixed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", default="0.31.0")
    parser.add_argument("--apply-runs", type=int, default=200)
    parser.add_argument("--revert-runs", type=int, default=100)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="k3patch-reliability-"))
    pristine = work / "pristine"
    _copy_minimal(pristine_tree(args.version), pristine, engine.target_files(all_patches()))
    started = time.time()
    rows = []
    failures: list[str] = []
    runs, mixed = step_kills(pristine, work)
    rows.append(("kill -9 at every named commit step (apply and revert)", runs, runs, mixed))
    for op, n, seed in (("apply", args.apply_runs, 11), ("revert", args.revert_runs, 12)):
        (work / op).mkdir()
        r = campaign(pristine, work / op, runs=n, op=op, seed=seed)
        failures += [f"{op}: {line}" for line in r.failures]
        rows.append(
            (
                f"kill -9 at a random moment during {op}",
                r.runs,
                r.killed_mid_run,
                r.mixed_after_recovery + r.status_disagreed + r.litter,
            )
        )
    lines = [
        f"# Reliability campaign ({time.strftime('%Y-%m-%d')}, vLLM {args.version} wheel, "
        f"{time.time() - started:.0f} s)",
        "",
        f"Command: `.venv/bin/python benchmarks/reliability.py --apply-runs {args.apply_runs} "
        f"--revert-runs {args.revert_runs}`",
        "",
        "| case | runs | killed while running | mixed or disagreeing trees after recovery |",
        "|---|---:|---:|---:|",
        *(f"| {case} | {runs} | {killed} | {bad} |" for case, runs, killed, bad in rows),
    ]
    if failures:
        lines += ["", "Failures:", "", *(f"- {line}" for line in failures)]
    text = "\n".join(lines) + "\n"
    print(text)
    (Path(__file__).resolve().parent / "RELIABILITY.md").write_text(text)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
