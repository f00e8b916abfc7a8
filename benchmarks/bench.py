"""Entrypoint-grade speed of k3patch on a real vLLM tree, against floors measured in the same run.

Run by hand (not in CI):  .venv/bin/python benchmarks/bench.py [--version 0.31.0] [--runs 15]
Prints a table of medians and writes benchmarks/RESULTS.md. k3patch is installed as a regular
(non-editable) package into a temporary dir first, so the numbers are what users get.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import pristine_tree  # noqa: E402

LEGACY_DIR = Path(__file__).resolve().parent / "legacy"


def timed(cmd: list[str], env: dict[str, str], cwd: str | None = None) -> tuple[float, int, str]:
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    return time.perf_counter() - start, proc.returncode, proc.stdout


def median_of(runs: int, make_cmd, env, setup=None, expect: int | None = 0) -> float:
    samples = []
    for _ in range(runs):
        if setup:
            setup()
        elapsed, code, out = timed(make_cmd(), env)
        if expect is not None and code != expect:
            raise SystemExit(f"{make_cmd()} exited {code}: {out[-500:]}")
        samples.append(elapsed)
    return statistics.median(samples)


def bench_python(where: Path) -> str:
    """A fresh venv that sees this interpreter's packages (libcst, typer, rich) but not its
    editable install of k3patch: a dev venv's editable finder maps `k3patch.patches` to the
    checkout and would win over the installed copy, so the numbers would be of whatever the
    checkout holds at that moment. A `.pth` line adds a directory without running the `.pth`
    files inside it."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    purelib = sysconfig.get_paths()["purelib"]
    site = next((where / "lib").glob("python*/site-packages"))
    (site / "bench-deps.pth").write_text(purelib + "\n")
    return str(where / "bin" / "python")


def write_section(path: Path, section: str) -> None:
    """`section` (a `## ` heading and its text) in place of the file's section of the same
    heading word, or after the file's title; other sections (mutants, ...) stay."""
    head = section.split("(", 1)[0]
    text = path.read_text() if path.exists() else "# k3patch benchmark results\n\n"
    parts = text.split("\n## ")
    kept = [p for p in parts[1:] if not ("## " + p).startswith(head)]
    path.write_text(
        "\n## ".join([parts[0].rstrip("\n") + "\n", section.removeprefix("## "), *kept])
    )


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0))  # what `taskset` left this run, not the host's count
    cores = f"{usable} cores" if usable == os.cpu_count() else f"{usable} of {os.cpu_count()} cores"
    return f"{cores}, {cpu}, Python {platform.python_version()}, {platform.system()}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", default="0.31.0")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of concurrent applies")
    parser.add_argument(
        "--source",
        default=str(ROOT),
        help="the k3patch source to install and measure (default: this checkout; e.g. a "
        "`git archive HEAD` export, to leave uncommitted work out)",
    )
    parser.add_argument("--no-verify", action="store_true")
    parser.add_argument("--verify-python", default=os.environ.get("K3PATCH_TEST_VLLM_PYTHON"))
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="k3patch-bench-"))
    py = bench_python(work / "venv")
    # Installed into the bench venv as a user installs it, and run through the `k3patch`
    # console script pip writes, as an entrypoint runs it (that script imports `re` itself).
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            py,
            "install",
            "--quiet",
            "--no-deps",
            "--no-compile",
            "--disable-pip-version-check",
            # The dev venv's k3patch (editable) is visible through bench-deps.pth: install
            # the measured source anyway, into the bench venv itself.
            "--ignore-installed",
            args.source,
        ],
        check=True,
    )
    install = Path(next((work / "venv" / "lib").glob("python*/site-packages")))
    subprocess.run([py, "-m", "compileall", "-q", str(install / "k3patch")], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE",)}
    env.update(NO_COLOR="1")
    env.pop("PYTHONPATH", None)
    os.chdir(work)
    k3 = [str(work / "venv" / "bin" / "k3patch")]

    src = pristine_tree(args.version)
    fresh = work / "fresh"
    patched = work / "patched"
    shutil.copytree(src, patched, ignore=shutil.ignore_patterns(".complete"))
    out = subprocess.run(
        [*k3, "apply", "--vllm", str(patched), "--json"], env=env, capture_output=True, text=True
    )
    applied = json.loads(out.stdout)
    verdicts = {p["id"]: p["verdict"] for p in applied["patches"]}

    sys.path.insert(0, str(install))
    from k3patch.registry import all_patches
    from k3patch.scan import target_files

    targets = [str(patched / "vllm" / rel) for rel in target_files(all_patches())]
    existing = [t for t in targets if os.path.exists(t)]

    def reset_fresh() -> None:
        if fresh.exists():
            shutil.rmtree(fresh)
        shutil.copytree(src, fresh, ignore=shutil.ignore_patterns(".complete"))

    rows: list[tuple[str, float, str, float | None]] = []
    n = args.runs
    floor_pass = median_of(n, lambda: [py, "-c", "pass"], env)
    hash_code = (
        "import hashlib,sys\n"
        "for f in sys.argv[1:]:\n"
        "    hashlib.sha256(open(f,'rb').read()).hexdigest()\n"
    )
    floor_hash = median_of(n, lambda: [py, "-c", hash_code, *existing], env)
    floor_libcst = median_of(n, lambda: [py, "-c", "import libcst"], env)
    # The floor a cold apply is held to (issue 20): `import libcst`, then for the files apply
    # rewrites `parse_module` + one no-op CSTTransformer pass + `.code`, plus `ast.parse` of
    # every target file it reads. Which files apply rewrites: the ones it wrote on `patched`.
    rewritten = [
        str(src / "vllm" / rel.removeprefix("vllm/"))
        for rel in applied["written"]
        if rel.endswith(".py") and (src / "vllm" / rel.removeprefix("vllm/")).exists()
    ]
    if not rewritten:
        raise SystemExit(f"apply --json named no written file: {applied.get('written')}")
    read = [t.replace(str(patched), str(src)) for t in existing]
    codemod_floor = (
        "import ast, sys, libcst\n"
        "n = int(sys.argv[1])\n"
        "for f in sys.argv[2:2 + n]:\n"
        "    m = libcst.parse_module(open(f).read())\n"
        "    m.visit(libcst.CSTTransformer()).code\n"
        "for f in sys.argv[2 + n:]:\n"
        "    ast.parse(open(f, 'rb').read())\n"
    )
    floor_cmd = [py, "-c", codemod_floor, str(len(rewritten)), *rewritten, *read]
    floor_codemod = median_of(n, lambda: floor_cmd, env)
    rows += [
        ("floor: python -c pass", floor_pass, "", None),
        (f"floor: interpreter + sha256 of {len(existing)} target files", floor_hash, "", None),
        ("floor: python -c 'import libcst'", floor_libcst, "", None),
        (
            f"floor: import libcst + parse, no-op pass, .code of the {len(rewritten)} rewritten "
            f"files + ast.parse of {len(read)} read",
            floor_codemod,
            "",
            None,
        ),
    ]

    status = median_of(n, lambda: [*k3, "status", "--vllm", str(patched)], env)
    rows.append(("k3patch status, patched tree (no-op)", status, "hash floor", status / floor_hash))
    quiet = median_of(n, lambda: [*k3, "apply", "--quiet", "--vllm", str(patched)], env)
    rows.append(
        ("k3patch apply --quiet, patched tree (no-op)", quiet, "hash floor", quiet / floor_hash)
    )
    full_status = median_of(
        n, lambda: [*k3, "status", "--vllm", str(patched)], {**env, "K3PATCH_NO_FASTPATH": "1"}
    )
    rows.append(
        ("k3patch status, full path forced", full_status, "hash floor", full_status / floor_hash)
    )

    # Cold apply and 32 concurrent applies, in every output mode an entrypoint or a person
    # may use (stdout is a pipe here, as in `docker logs`). Each mode against the same floors.
    cold_runs = max(5, n)
    rounds = args.rounds
    writers_seen: list[int] = []
    reference_tree: dict[str, str] | None = None
    for label, mode in (("human", []), ("--quiet", ["--quiet"]), ("--json", ["--json"])):
        # On a shared machine the load drifts within a run: each cold apply is paired with an
        # `import libcst` taken right after it, and the ratio is the median of the pairs.
        colds, ratios = [], []
        for _ in range(cold_runs):
            reset_fresh()
            elapsed, code, out = timed([*k3, "apply", *mode, "--vllm", str(fresh)], env)
            if code != 0:
                raise SystemExit(f"cold apply {label} exited {code}: {out[-500:]}")
            floor, _, _ = timed(floor_cmd, env)
            colds.append(elapsed)
            ratios.append(elapsed / floor)
        rows.append(
            (
                f"k3patch apply {label}, fresh tree (cold)",
                statistics.median(colds),
                "libcst floor (paired)",
                statistics.median(ratios),
            )
        )
        conc_samples, conc_ratios = [], []
        for _ in range(rounds):
            # Paired as above: a cold apply of the same mode right before each round, so that
            # a drift of the machine's speed between rounds cancels out of the ratio.
            reset_fresh()
            cold_before, code, out = timed([*k3, "apply", *mode, "--vllm", str(fresh)], env)
            if code != 0:
                raise SystemExit(f"cold apply {label} exited {code}: {out[-500:]}")
            reset_fresh()
            cmd = [*k3, "apply", *mode, "--vllm", str(fresh)]

            def one_apply(_: int, cmd: list[str] = cmd) -> subprocess.CompletedProcess[str]:
                return subprocess.run(cmd, env=env, capture_output=True, text=True)

            start = time.perf_counter()
            with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
                results = list(pool.map(one_apply, range(args.concurrency)))
            conc_samples.append(time.perf_counter() - start)
            conc_ratios.append(conc_samples[-1] / cold_before)
            codes = [r.returncode for r in results]
            if any(codes):
                raise SystemExit(f"concurrent apply {label} exit codes: {codes}")
            if mode == ["--json"]:
                writers_seen.append(sum(1 for r in results if json.loads(r.stdout)["written"]))
            litter = [p for p in fresh.rglob("*") if ".k3patch-tmp." in p.name]
            if litter:
                raise SystemExit(f"temp litter left: {litter}")
            # Every mode must leave the same bytes (the state record aside: it is per run).
            tree = {
                str(p.relative_to(fresh)): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(fresh.rglob("*.py"))
            }
            if reference_tree is None:
                reference_tree = tree
            elif tree != reference_tree:
                raise SystemExit(f"concurrent apply {label} left other bytes than the first run")
        conc = statistics.median(conc_samples)
        paired = statistics.median(conc_ratios)
        rows.append(
            (
                f"{args.concurrency} concurrent apply {label}, one fresh tree (wall)",
                conc,
                "one cold apply, same mode (paired)",
                paired,
            )
        )

    legacy = sorted(LEGACY_DIR.glob("*.py"))
    legacy_samples = []
    for _ in range(n):
        start = time.perf_counter()
        for script in legacy:
            subprocess.run([py, str(script), str(patched / "vllm")], env=env, capture_output=True)
        legacy_samples.append(time.perf_counter() - start)
    legacy_time = statistics.median(legacy_samples)
    rows.append(
        (
            f"older way: {len(legacy)} scripts, one interpreter each (substring check)",
            legacy_time,
            "hash floor",
            legacy_time / floor_hash,
        )
    )

    if not args.no_verify and args.verify_python:
        verify = median_of(
            2, lambda: [*k3, "verify", "--vllm", str(patched), "--python", args.verify_python], env
        )
        rows.append(("k3patch verify (imports + probes)", verify, "", None))

    lines = [
        f"## Speed ({time.strftime('%Y-%m-%d')}, benchmarks/bench.py)",
        "",
        f"Machine: {machine()}.",
        f"Tree: real vLLM {args.version} wheel (.py files + METADATA). Patch verdicts after apply: "
        + ", ".join(f"{k} {v}" for k, v in verdicts.items())
        + ".",
        f"Command: `.venv/bin/python benchmarks/bench.py --version {args.version} --runs {n} "
        f"--rounds {rounds}" + ("" if args.source == str(ROOT) else " --source EXPORT") + "` "
        f"(medians of {n} runs; cold apply {cold_runs} runs per mode, each paired with an "
        f"libcst floor run right after it; concurrency {rounds} rounds per mode, each paired "
        f"with a cold apply right before it; writers per "
        f"--json round: {writers_seen}). Source measured: "
        + ("this checkout" if args.source == str(ROOT) else f"{args.source}")
        + ". Every k3patch run's stdout is a pipe, as in `docker logs`.",
        "",
        "| what | median | ratio to | ratio |",
        "|---|---:|---|---:|",
    ]
    for what, seconds, against, ratio in rows:
        ratio_text = f"{ratio:.2f}x" if ratio is not None else ""
        lines.append(f"| {what} | {seconds * 1000:.1f} ms | {against} | {ratio_text} |")
    report = "\n".join(lines) + "\n"
    print(report)
    write_section(Path(__file__).resolve().parent / "RESULTS.md", report)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
