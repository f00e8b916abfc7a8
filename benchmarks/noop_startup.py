"""The no-op path's start-up, two k3patch sources side by side in one run (issue 29: `TARGETS`
read from each patch folder's files.txt instead of a table in patches/__init__.py).

    .venv/bin/python benchmarks/noop_startup.py [--before main] [--after worktree] [--runs 31]

Each source is installed (not editable) into its own venv, applied to its own copy of a real
0.31.0 tree, then `status` and `apply --quiet` run on it, interleaved run by run with the floor
(interpreter + sha256 of the target files), so that the machine's drift falls on both alike.
Prints medians and ratios to the floor; writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import ROOT, bench_python, pristine_tree, timed
from conftest import export_source


def install(source: str, work: Path) -> Path:
    """`source` (a git revision, or "worktree") installed into a venv of its own: its k3patch."""
    src = work / "src"
    src.mkdir(parents=True)
    if source == "worktree":
        export_source(src)
    else:
        archive = work / "src.tar"
        with open(archive, "wb") as out:
            subprocess.run(["git", "archive", source], cwd=ROOT, stdout=out, check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(src, filter="data")
    py = bench_python(work / "venv")
    pip = [sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps"]
    subprocess.run(
        [*pip, "--disable-pip-version-check", "--ignore-installed", str(src)], check=True
    )
    subprocess.run([py, "-m", "compileall", "-q", str(work / "venv" / "lib")], check=True)
    return work / "venv" / "bin" / "k3patch"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="main")
    parser.add_argument("--after", default="worktree")
    parser.add_argument("--version", default="0.31.0")
    parser.add_argument("--runs", type=int, default=31)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="k3patch-noop-"))
    os.chdir(work)  # never the checkout: `-c` puts the cwd first on sys.path
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPATH")
    }
    env["NO_COLOR"] = "1"
    sides = {}
    for label, source in (("before", args.before), ("after", args.after)):
        k3 = install(source, work / label)
        tree = work / label / "tree"
        shutil.copytree(
            pristine_tree(args.version), tree, ignore=shutil.ignore_patterns(".complete")
        )
        subprocess.run([str(k3), "apply", "--quiet", "--vllm", str(tree)], env=env, check=True)
        sides[label] = (k3, tree)
    py = str(sides["after"][0].parent / "python")
    ask = "import json, k3patch.patches as p; print(json.dumps(p.TARGETS))"
    listed = json.loads(subprocess.run([py, "-c", ask], capture_output=True, env=env).stdout)
    vllm = sides["after"][1] / "vllm"
    targets = [str(vllm / rel) for rel in listed if (vllm / rel).exists()]
    floor_code = "import hashlib,sys\nfor f in sys.argv[1:]: hashlib.sha256(open(f,'rb').read())"
    commands = {"floor": [py, "-c", floor_code, *targets]}
    for label, (k3, tree) in sides.items():
        commands[f"{label}: status"] = [str(k3), "status", "--vllm", str(tree)]
        commands[f"{label}: apply --quiet"] = [str(k3), "apply", "--quiet", "--vllm", str(tree)]
    samples: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.runs):
        for name, cmd in commands.items():
            elapsed, code, out = timed(cmd, env)
            if code != 0:
                raise SystemExit(f"{name} exited {code}: {out[-300:]}")
            samples[name].append(elapsed)
    # What changed, alone: importing k3patch.patches (TARGETS), timed inside the process.
    inside = "import time\nt = time.perf_counter()\nimport k3patch.patches\n"
    inside += "print(time.perf_counter() - t)"
    imports: dict[str, list[float]] = {label: [] for label in sides}
    for _ in range(args.runs):
        for label, (k3, _tree) in sides.items():
            cmd = [str(k3.parent / "python"), "-c", inside]
            out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
            imports[label].append(float(out))
    floor = statistics.median(samples["floor"])
    print(f"{args.runs} interleaved runs, vLLM {args.version}, {len(targets)} target files")
    print(f"{'what':34} {'median ms':>10} {'x floor':>8}")
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"{name:34} {median * 1e3:10.1f} {median / floor:8.2f}")
    for label, values in imports.items():
        print(
            f"{label}: import k3patch.patches (in-process) {statistics.median(values) * 1e3:.2f} ms"
        )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
