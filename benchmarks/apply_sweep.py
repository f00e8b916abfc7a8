"""Apply, apply again, revert on every real tree, for comparing two k3patch versions (run by
hand; wheels and fork trees come from the tests' builders and cache).

    .venv/bin/python benchmarks/apply_sweep.py [--k3patch SRC] --out FILE [TREE...]
    .venv/bin/python benchmarks/apply_sweep.py --compare OLD.json NEW.json [--diffs DIR]

A TREE is a vLLM version (`0.31.0`) or a fork tree (`fork-a`, `fork-d`, ...); default: every
release the project knows from 0.14.1 on (tests/conftest.py KNOWN_RELEASES) and every fork
tree. Per tree it records the status verdicts and shapes, apply's exit code, the sha256 and text
of every file apply wrote, whether a second apply changed any byte, and whether revert gave back
the pristine bytes. `--compare` prints every verdict,
shape or exit-code difference and every file whose written bytes differ (with `--diffs DIR`, a
unified diff of the two versions' written text per file).
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import KNOWN_RELEASES, pristine_tree
from forktree import BASE_VERSION, TREES, build

# From the first release with the MoRIIO connector, where three of the four patches have sites.
WHEELS = KNOWN_RELEASES[KNOWN_RELEASES.index("0.14.1") :]


EMPTY_CWD = tempfile.mkdtemp(prefix="k3applysweep-cwd-")


def k3patch_env(src: str | None, scratch: Path) -> dict[str, str]:
    env = {**os.environ, "NO_COLOR": "1", "K3PATCH_NO_FASTPATH": "1"}
    if src:
        lib = scratch / "lib"
        shutil.copytree(Path(src) / "k3patch", lib / "k3patch", symlinks=False)
        shutil.copytree(Path(src) / "patches", lib / "k3patch" / "patches", dirs_exist_ok=True)
        env["PYTHONPATH"] = str(lib)
    return env


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".k3patch" not in p.parts and "__pycache__" not in p.parts
    }


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "k3patch", *args]
    # From an empty directory, not the caller's: `-m` puts the working directory first on
    # sys.path, and from the checkout's root that imports the checkout's k3patch instead of the
    # --k3patch copy (a baseline run measured half-edited work that way).
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=EMPTY_CWD)


def run_json(env: dict[str, str], *args: str) -> dict:
    """A --json run's object; a run that printed none says what it wrote to stderr."""
    proc = run(env, *args, "--json")
    try:
        return json.loads(proc.stdout)
    except ValueError:
        raise SystemExit(
            f"k3patch {' '.join(args)} --json exited {proc.returncode} with no "
            f"JSON; stderr: {proc.stderr[-2000:]}"
        ) from None


def sweep_tree(name: str, site: Path, env: dict[str, str]) -> dict[str, object]:
    pristine = snapshot(site)
    status = run_json(env, "status", "--vllm", str(site))
    verdicts = {
        p["id"]: {
            "verdict": p["verdict"],
            "shapes": sorted({f"{s['verdict']}:{s['shape']}" for s in p["sites"]}),
        }
        for p in status.get("patches", [])
    }
    first = run(env, "apply", "--vllm", str(site), "--json")
    applied = snapshot(site)
    written = sorted(rel for rel, h in applied.items() if pristine.get(rel) != h)
    texts = {rel: (site / rel).read_text(errors="replace") for rel in written}
    second = run(env, "apply", "--vllm", str(site), "--json")
    second_same = snapshot(site) == applied
    after_status = run_json(env, "status", "--vllm", str(site))
    revert = run(env, "revert", "--vllm", str(site), "--json")
    row = {
        "verdicts": verdicts,
        "apply_rc": first.returncode,
        "after": {p["id"]: p["verdict"] for p in after_status.get("patches", [])},
        "written": {rel: applied[rel] for rel in written},
        "texts": texts,
        "second_apply_rc": second.returncode,
        "second_apply_same_bytes": second_same,
        "revert_rc": revert.returncode,
        "revert_exact": snapshot(site) == pristine,
    }
    print(
        f"{name:10} apply {first.returncode} again {second.returncode} revert "
        f"{revert.returncode} exact {row['revert_exact']} idem {second_same} wrote {len(written)} "
        + " ".join(f"{k}={v['verdict']}" for k, v in verdicts.items()),
        flush=True,
    )
    return row


def sweep(args: argparse.Namespace) -> int:
    scratch = Path(tempfile.mkdtemp(prefix="k3applysweep-"))
    env = k3patch_env(args.k3patch, scratch)
    names = args.trees or [*WHEELS, *(f"fork-{t}" for t in TREES)]
    table: dict[str, object] = {}
    for name in names:
        site = scratch / f"site-{name}"
        if name.startswith("fork-"):
            build(name[5:], pristine_tree(BASE_VERSION), site)
        else:
            shutil.copytree(pristine_tree(name), site, ignore=shutil.ignore_patterns(".complete"))
        table[name] = sweep_tree(name, site, env)
        shutil.rmtree(site)
    Path(args.out).write_text(json.dumps(table, indent=1, sort_keys=True))
    return 0


def compare(old_path: str, new_path: str, diffs: str | None) -> int:
    old, new = json.loads(Path(old_path).read_text()), json.loads(Path(new_path).read_text())
    problems = 0
    layout = 0
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a is None or b is None:
            print(f"{name}: only in {'new' if a is None else 'old'}")
            problems += 1
            continue
        for key in ("verdicts", "apply_rc", "after", "second_apply_rc", "revert_rc"):
            if a[key] != b[key]:
                print(f"{name}: {key} differs: {a[key]} -> {b[key]}")
                problems += 1
        for key, what in (
            ("revert_exact", "revert is not byte-exact"),
            ("second_apply_same_bytes", "a second apply changed bytes"),
        ):
            if not b[key]:
                print(f"{name}: {what}")
                problems += 1
        if sorted(a["written"]) != sorted(b["written"]):
            print(f"{name}: written files differ: {sorted(a['written'])} -> {sorted(b['written'])}")
            problems += 1
        for rel in sorted(set(a["written"]) & set(b["written"])):
            if a["written"][rel] != b["written"][rel]:
                layout += 1
                print(f"{name}: {rel}: written bytes differ (layout)")
                if diffs:
                    out = Path(diffs) / f"{name}--{rel.replace('/', '_')}.diff"
                    out.parent.mkdir(parents=True, exist_ok=True)
                    out.write_text(
                        "".join(
                            difflib.unified_diff(
                                a["texts"][rel].splitlines(True),
                                b["texts"][rel].splitlines(True),
                                f"old/{rel}",
                                f"new/{rel}",
                            )
                        )
                    )
    print(f"trees: {len(new)}; differences: {problems}; files laid out differently: {layout}")
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("trees", nargs="*")
    parser.add_argument("--k3patch", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    parser.add_argument("--diffs", default=None)
    args = parser.parse_args()
    if args.compare:
        return compare(*args.compare, args.diffs)
    if not args.out:
        parser.error("--out is required without --compare")
    return sweep(args)


if __name__ == "__main__":
    sys.exit(main())
