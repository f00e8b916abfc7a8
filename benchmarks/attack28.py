"""Issue 28's attack rows (tests/mutation_rows/*_attack.py), run without touching the harness.

    .venv/bin/python benchmarks/attack28.py variants [--only ID]...   # harness-format rows
    .venv/bin/python benchmarks/attack28.py tree-rows [--only ID]...
                                           [--recorded SURVIVED|verify|status]

`variants` runs each VARIANT through benchmarks/mutants.py's own functions (export, baseline,
scratch copy, run_tree: apply with the mutated declaration, then verify): A killed by apply,
P killed by probes, S survived. mutation_rows/__init__.py names only the four tables, so
`benchmarks/mutants.py` itself does not see these rows.

`tree-rows` makes each TreeRow: a copy of the cached tree (after `k3patch apply` of this
checkout where base is "applied"), the hand edit, then `k3patch status --only PATCH` and
`k3patch verify --only PATCH --python .venv-vllm/bin/python`; it prints the outcome beside the
one recorded (status: no longer applied/satisfied; verify: a probe failed; SURVIVED).
Exit 1 when an outcome differs from the recorded one.
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
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import mutants  # noqa: E402
from mutation_rows import (  # noqa: E402
    aiter_mla_gfx942_attack,
    kda_gather_diagnostic_attack,
    moriio_chunk_gate_attack,
    moriio_group_routing_attack,
)
from mutation_rows.attack_common import TreeRow  # noqa: E402

MODULES = (
    moriio_chunk_gate_attack,
    moriio_group_routing_attack,
    kda_gather_diagnostic_attack,
    aiter_mla_gfx942_attack,
)
VARIANTS = tuple(v for m in MODULES for v in m.VARIANTS)
TREE_ROWS: tuple[TreeRow, ...] = tuple(r for m in MODULES for r in m.TREE_ROWS)
K3PATCH = ROOT / ".venv" / "bin" / "k3patch"
TREE_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


def run_variants(chosen: list) -> int:
    with tempfile.TemporaryDirectory(prefix="k3patch-attack-") as tmp:
        work = Path(tmp)
        clean = mutants.export("HEAD", work / "export")
        errors = mutants.table_errors(clean / "k3patch" / "patches", chosen)
        for vid, why in errors.items():
            print(f"TABLE ERROR {vid}: {why}", flush=True)
        base = mutants.scratch_copy(clean, None, work / "base")
        bad = set()
        for patch, tree in sorted({(v.patch, t) for v in chosen for t in v.trees}):
            got = mutants.run_tree(base, None, patch, tree, work)
            print(f"baseline {patch} on {tree}: {got.outcome} ({got.detail})", flush=True)
            if got.outcome != "S":
                bad.add((patch, tree))
        survived = 0
        for v in chosen:
            if v.id in errors:
                continue
            where = work / v.id
            where.mkdir()
            lib = mutants.scratch_copy(clean, v, where)
            for tree in v.trees:
                if (v.patch, tree) in bad:
                    print(f"{v.id} {tree} E: baseline fails", flush=True)
                    continue
                t = mutants.run_tree(lib, v, v.patch, tree, where)
                note = " (declared equivalent)" if t.outcome == "S" and v.equivalent else ""
                survived += t.outcome == "S" and not v.equivalent
                print(f"{v.id} {tree} {t.outcome}{note}: {t.detail}", flush=True)
            shutil.rmtree(where, ignore_errors=True)
    return 1 if errors or survived else 0


def edit(text: str, edits: tuple[tuple[str, ...], ...]) -> str:
    for e in edits:
        if len(e) == 2:
            before, after = e
        else:
            first, last, after = e
            assert text.count(first) == 1, f"span start found {text.count(first)} times"
            start = text.index(first)
            end = text.index(last, start + len(first)) + len(last)
            before = text[start:end]
        assert text.count(before) == 1, f"{before.splitlines()[0]!r} not found exactly once"
        text = text.replace(before, after, 1)
    return text


def run_tree_row(row: TreeRow, work: Path) -> tuple[str, str]:
    site = work / f"{row.id}@{row.tree}"
    shutil.copytree(mutants.source_tree(row.tree), site, ignore=shutil.ignore_patterns(".complete"))
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
    if row.base == "applied":
        subprocess.run([str(K3PATCH), "apply", "--vllm", str(site)], capture_output=True, env=env)
    path = site / row.file
    path.write_text(edit(path.read_text(encoding="utf-8"), row.edits), encoding="utf-8")
    st = subprocess.run(
        [str(K3PATCH), "status", "--vllm", str(site), "--only", row.patch, "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    verdict = next(
        (p["verdict"] for p in json.loads(st.stdout).get("patches", []) if p["id"] == row.patch),
        "missing",
    )
    if verdict not in ("applied", "satisfied"):
        return "status", f"status reads {verdict}"
    vf = subprocess.run(
        [
            str(K3PATCH),
            "verify",
            "--vllm",
            str(site),
            "--only",
            row.patch,
            "--python",
            str(TREE_PYTHON),
        ],
        capture_output=True,
        text=True,
        env=env,
    )
    if vf.returncode == 0:
        return "SURVIVED", f"status {verdict}; every probe passed"
    failed = [ln.strip() for ln in vf.stdout.splitlines() if "probe failed" in ln]
    return "verify", (failed[0] if failed else vf.stdout.strip()[-300:])[:300]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("variants", "tree-rows"))
    parser.add_argument("--only", action="append", default=[])
    parser.add_argument("--recorded", action="append", default=[])
    args = parser.parse_args()
    if args.what == "variants":
        return run_variants([v for v in VARIANTS if not args.only or v.id in args.only])
    rows = [
        r
        for r in TREE_ROWS
        if (not args.only or r.id in args.only)
        and (not args.recorded or r.recorded in args.recorded)
    ]
    differ = 0
    with tempfile.TemporaryDirectory(prefix="k3patch-attack-") as tmp:
        for row in rows:
            got, detail = run_tree_row(row, Path(tmp))
            same = "as recorded" if got == row.recorded else f"RECORDED {row.recorded}"
            differ += got != row.recorded
            eq = " (declared equivalent)" if got == "SURVIVED" and row.equivalent else ""
            print(f"{row.patch} {row.id} {row.tree}: {got}{eq} [{same}] {detail}", flush=True)
            shutil.rmtree(Path(tmp) / f"{row.id}@{row.tree}", ignore_errors=True)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
