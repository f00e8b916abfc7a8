"""Verdicts of every patch on real vLLM wheels, for comparing two k3patch versions and for
meeting a new vLLM release (run by hand; wheels come from the same cache as the tests).

    .venv/bin/python benchmarks/verdict_sweep.py [--k3patch SRC] [--out FILE] [VERSION...]
    .venv/bin/python benchmarks/verdict_sweep.py --newest [--k3patch SRC] [--out FILE]
    .venv/bin/python benchmarks/verdict_sweep.py --compare OLD.json NEW.json

No VERSION: every release the project knows (tests/conftest.py KNOWN_RELEASES). --k3patch SRC
runs another checkout of k3patch (its `k3patch/` and `patches/` are laid out as an importable
package in a temp dir); default: the installed one. Prints one line per version and patch:
verdict and shape(s), and under it any shape met outside the versions it was declared for;
--out writes the same as JSON.

--newest asks the package registry (`pip index versions vllm`) for its newest vLLM release,
downloads that wheel into the cache, prints its verdicts, and says whether the tables know it.
Exit 1 when they do not, or a patch drifted, or a shape was met outside its declared versions:
each is work for a maintainer (check the verdicts, then add the release to KNOWN_RELEASES, the
shapes' ranges, the tests' tables and README). 0 otherwise.

--compare prints every verdict and shape that differs between two --out files (exit 1 if any).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import KNOWN_RELEASES, pristine_tree

OUTSIDE = "a known shape, but seen in vLLM"


def k3patch_env(src: str | None, scratch: Path) -> dict[str, str]:
    env = {**os.environ, "NO_COLOR": "1", "K3PATCH_NO_FASTPATH": "1"}
    if src:
        lib = scratch / "lib"
        shutil.copytree(Path(src) / "k3patch", lib / "k3patch")
        shutil.copytree(Path(src) / "patches", lib / "k3patch" / "patches", dirs_exist_ok=True)
        env["PYTHONPATH"] = str(lib)
    return env


def newest_release() -> str:
    """The newest vLLM release on the registry pip is configured for (pre-releases left out,
    as pip leaves them out of an install). `pip index` is marked experimental: should it fail,
    a download of `vllm` with no version (the wheel pip would install) names it instead."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", "vllm"], capture_output=True, text=True
    )
    found = re.search(r"^vllm \(([^)]+)\)", proc.stdout, re.MULTILINE)
    if found:
        return found.group(1)
    with tempfile.TemporaryDirectory(prefix="k3newest-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "vllm", "-d", tmp]
        if subprocess.run(cmd).returncode != 0:
            raise SystemExit("verdict_sweep: the registry named no vLLM release (see pip above)")
        (wheel,) = Path(tmp).glob("vllm-*.whl")
        return wheel.name.split("-")[1]


def sweep(versions: list[str], env: dict[str, str], scratch: Path) -> dict[str, dict]:
    table: dict[str, dict[str, dict[str, object]]] = {}
    for version in versions:
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
        row: dict[str, dict[str, object]] = {}
        for patch in data.get("patches", []):
            shapes = sorted({f"{s['verdict']}:{s['shape']}" for s in patch["sites"]})
            outside = sorted(
                {
                    f"{s['shape']}: {s['detail'][s['detail'].index(OUTSIDE) :]}"
                    for s in patch["sites"]
                    if OUTSIDE in s["detail"]
                }
            )
            row[patch["id"]] = {"verdict": patch["verdict"], "shapes": shapes, "outside": outside}
            print(f"{version:8} {patch['id']:22} {patch['verdict']:15} {'; '.join(shapes)[:150]}")
            for note in outside:
                print(f"{'':8} {'':22} {'':15} {note}")
        table[version] = row
        shutil.rmtree(site)
    return table


def report_newest(version: str, row: dict[str, dict]) -> int:
    known = version in KNOWN_RELEASES
    drifted = [pid for pid, r in row.items() if r["verdict"] == "drifted"]
    outside = [pid for pid, r in row.items() if r["outside"]]
    print(
        f"vllm {version} is the newest release on the registry; "
        + (
            "the tables know it (tests/conftest.py KNOWN_RELEASES)"
            if known
            else f"NEW: the tables know up to {KNOWN_RELEASES[-1]}"
        )
    )
    if drifted:
        print(f"drifted on {version}: {', '.join(drifted)}")
    if outside:
        print(f"shapes met outside their declared versions: {', '.join(outside)}")
    return 0 if known and not drifted and not outside else 1


def compare(old_path: str, new_path: str) -> int:
    old, new = json.loads(Path(old_path).read_text()), json.loads(Path(new_path).read_text())
    changes = {"in one sweep only": 0, "verdict": 0, "shapes": 0}
    for version in sorted(set(old) | set(new), key=Version):
        a, b = old.get(version), new.get(version)
        if a is None or b is None:
            print(f"{version}: only in {'new' if a is None else 'old'}")
            changes["in one sweep only"] += 1
            continue
        for pid in sorted(set(a) | set(b)):
            pa, pb = a.get(pid, {}), b.get(pid, {})
            for key in ("verdict", "shapes"):
                if pa.get(key) != pb.get(key):
                    print(f"{version} {pid}: {key} {pa.get(key)} -> {pb.get(key)}")
                    changes[key] += 1
    counts = "; ".join(f"{key}: {n}" for key, n in changes.items())
    print(f"versions: {len(new)}; {counts}")
    return 1 if any(changes.values()) else 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("versions", nargs="*")
    parser.add_argument("--k3patch", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--newest", action="store_true")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare)
    if args.newest and args.versions:
        parser.error("--newest takes no VERSION")
    versions = [newest_release()] if args.newest else args.versions or list(KNOWN_RELEASES)
    scratch = Path(tempfile.mkdtemp(prefix="k3sweep-"))
    try:
        table = sweep(versions, k3patch_env(args.k3patch, scratch), scratch)
    finally:
        shutil.rmtree(scratch)
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return report_newest(versions[0], table[versions[0]]) if args.newest else 0


if __name__ == "__main__":
    sys.exit(main())
