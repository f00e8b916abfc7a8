"""Verdicts of every patch on every real vLLM wheel in a range, for comparing two k3patch
versions (run by hand; wheels come from the same cache as the tests).

    .venv/bin/python benchmarks/verdict_sweep.py [--k3patch SRC] [--out FILE] VERSION...

--k3patch SRC runs another checkout of k3patch (its `k3patch/` and `patches/` are laid out as
an importable package in a temp dir); default: the installed one. Prints one line per version
and patch: verdict and shape(s); --out writes the same as JSON.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import pristine_tree


def k3patch_env(src: str | None, scratch: Path) -> dict[str, str]:
    env = {**os.environ, "NO_COLOR": "1", "K3PATCH_NO_FASTPATH": "1"}
    if src:
        lib = scratch / "lib"
        shutil.copytree(Path(src) / "k3patch", lib / "k3patch")
        shutil.copytree(Path(src) / "patches", lib / "k3patch" / "patches")
        env["PYTHONPATH"] = str(lib)
    return env


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("versions", nargs="+")
    parser.add_argument("--k3patch", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="k3sweep-"))
    env = k3patch_env(args.k3patch, scratch)
    table: dict[str, dict[str, dict[str, object]]] = {}
    for version in args.versions:
        site = scratch / f"site-{version}"
        shutil.copytree(pristine_tree(version), site, ignore=shutil.ignore_patterns(".complete"))
        proc = subprocess.run(
            [sys.executable, "-m", "k3patch", "status", "--vllm", str(site), "--json"],
            capture_output=True,
            text=True,
            env=env,
            cwd=scratch,
        )
        data = json.loads(proc.stdout)
        row = {}
        for patch in data.get("patches", []):
            shapes = sorted({f"{s['verdict']}:{s['shape']}" for s in patch["sites"]})
            row[patch["id"]] = {"verdict": patch["verdict"], "shapes": shapes}
            print(f"{version:8} {patch['id']:22} {patch['verdict']:15} {'; '.join(shapes)[:150]}")
        table[version] = row
        shutil.rmtree(site)
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(scratch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
