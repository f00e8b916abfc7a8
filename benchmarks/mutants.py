"""The mutation check (issue 19): wrong fixes that k3patch itself would write and read as applied,
each held against apply's own re-check, verify's probes on real trees, and a named test subset.

    .venv/bin/python benchmarks/mutants.py [--only VARIANT]... [--patch ID]... [--trees T,...]
                                           [--written ROUND]... [--source HEAD|worktree]
                                           [--tests survivors|all|none] [--no-write] [--list]

The rows live with the patches: one table per patch, tests/mutation_rows/<folder>.py (VARIANTS),
each row marked with the round it was written in (`written`: "issue 19", or "issue 28" for the
wrong fixes written before issue 28 extended the probes); the report counts kills per patch and
round. Each VARIANT is a few substitutions in a patch's declared post-image (the text `apply`
writes, which is also the shape `status` reads as k3patch's), each of which must occur exactly
once in today's file: a variant whose anchor moved is a table error, reported, never skipped
quietly. Per variant:
1. k3patch's `k3patch/` and `patches/` (from the last commit by default: others' uncommitted
   edits are not what is measured) are copied into a temp dir laid out as the installed package,
   and the substitutions are made there;
2. per tree (upstream wheels and the fork trees of tests/forktree, each where the patch is
   pending) a fresh full copy is made, read pending with the scratch k3patch, and applied: a
   refusal, or the patch not reading applied afterwards, is "killed by apply";
3. `k3patch verify --json` of the scratch k3patch, with the tree interpreter
   (.venv-vllm/bin/python), runs the mutated patch's probe (the two MoRIIO patches together:
   they share moriio_connector.py and chunk gate's probe drives group routing's code): a failed
   probe or a module broken by the patch is "killed by probes";
4. the patch's own test file (TESTS below; `-m "not verify" -x`, the scratch copy's tests
   against the scratch k3patch) is "killed by tests" when it fails: by default only for the
   variants that apply and the probes let through (what only tests catch; `--tests all` runs
   it for every variant, about 15-50 s each). Every tree, and every test subset that runs, is
   first run on the unmutated copy: a kill against a failing baseline is none.
A survivor stays only with a declared reason (`equivalent=`) why it behaves as the real fix.

The report (stdout, and the "Mutants" section of benchmarks/RESULTS.md unless --no-write or a
partial run) gives per variant the trees and their outcome: A killed by apply, P killed by
probes, S survived.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEV_PYTHON = ROOT / ".venv" / "bin" / "python"
TREE_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"

# The rows live with the patches, one table per patch (tests/mutation_rows/<folder>.py), found
# there; nothing here names a patch.
sys.path.insert(0, str(ROOT / "tests"))
from mutation_rows import FOLDERS, TABLES, VARIANTS, Sub, Variant  # noqa: E402

from k3patch.patches import declared_files  # noqa: E402

__all__ = ["TABLES", "VARIANTS", "Sub", "Variant"]

# Which probes verify runs for a patch's variants: its own and those of every patch that reads a
# file it reads (the two MoRIIO patches share moriio_connector.py, and chunk gate's probe drives
# group routing's code).
READS = {p: set(declared_files(str(ROOT / "patches" / folder))) for p, folder in FOLDERS.items()}
VERIFY_WITH = {p: tuple(q for q in TABLES if READS[p] & READS[q]) for p in TABLES}
# The test subset per patch ("killed by tests"): the patch's own file, without verify children.
TESTS = {p: (f"tests/test_{folder}.py",) for p, folder in FOLDERS.items()}
TEST_ARGS = ("-q", "-x", "-p", "no:cacheprovider", "-m", "not verify")
TEST_TIMEOUT = 240


# --------------------------------------------------------------------------------------------
# The table against today's declarations (also what tests/test_mutants_table.py checks).


def table_errors(patches_dir: Path, variants: Sequence[Variant] = VARIANTS) -> dict[str, str]:
    """variant id -> why its substitutions cannot be made exactly once; empty when all can."""
    errors: dict[str, str] = {}
    for v in variants:
        texts: dict[str, str | None] = {}  # each file as the variant's earlier subs left it
        for sub in v.subs:
            path = patches_dir / sub.file
            if sub.file not in texts:
                texts[sub.file] = path.read_text(encoding="utf-8") if path.is_file() else None
            text = texts[sub.file]
            original = path.read_text(encoding="utf-8") if path.is_file() else ""
            count = 0 if text is None else min(text.count(sub.old), original.count(sub.old))
            if count != 1 or sub.old == sub.new or text is None:
                first = sub.old.strip().splitlines()[0] if sub.old.strip() else repr(sub.old)
                why = "no change" if sub.old == sub.new else f"found {count} times (want 1)"
                errors[v.id] = f"{sub.file}: `{first}` {why}"
                break
            texts[sub.file] = text.replace(sub.old, sub.new, 1)
    return errors


def mutated(patches_dir: Path, variant: Variant) -> dict[str, str]:
    """The declaration files as the variant changes them (file -> text)."""
    texts: dict[str, str] = {}
    for sub in variant.subs:
        text = texts.get(sub.file) or (patches_dir / sub.file).read_text(encoding="utf-8")
        texts[sub.file] = text.replace(sub.old, sub.new, 1)
    return texts


# --------------------------------------------------------------------------------------------
# Running a variant.


@dataclass
class TreeResult:
    tree: str
    outcome: str  # "A" killed by apply, "P" killed by probes, "S" survived, "E" error
    detail: str = ""


@dataclass
class Result:
    variant: Variant
    trees: list[TreeResult] = field(default_factory=list)
    tests: str = ""  # "killed", "passed", "not run", or an error
    tests_detail: str = ""
    error: str = ""

    @property
    def by_apply(self) -> bool:
        return bool(self.trees) and all(t.outcome == "A" for t in self.trees)

    @property
    def by_probes(self) -> bool:
        return any(t.outcome == "P" for t in self.trees)

    @property
    def survived(self) -> bool:
        return any(t.outcome == "S" for t in self.trees)

    def verdict(self) -> str:
        if self.error or any(t.outcome == "E" for t in self.trees):
            return "error"
        if self.survived:
            return "survived (equivalent)" if self.variant.equivalent else "SURVIVED"
        return "killed by apply" if self.by_apply else "killed by probes"


def export(source: str, dest: Path) -> Path:
    """k3patch/, patches/ (as k3patch/patches), tests/, fixtures/ and pyproject.toml of the
    checkout: the last commit (HEAD) or the working tree as it is."""
    parts = ["k3patch", "patches", "tests", "fixtures", "pyproject.toml"]
    raw = dest / "raw"
    raw.mkdir(parents=True)
    if source == "worktree":
        for part in parts:
            src = ROOT / part
            if src.is_dir():
                shutil.copytree(src, raw / part, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(src, raw / part)
    else:
        archive = dest / "src.tar"
        with open(archive, "wb") as out:
            subprocess.run(["git", "archive", source, *parts], cwd=ROOT, stdout=out, check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(raw, filter="data")
    lib = dest / "lib"
    lib.mkdir()
    shutil.copytree(raw / "k3patch", lib / "k3patch")
    # k3patch/patches is a link to ../patches in the checkout: copied above as its files.
    shutil.copytree(raw / "patches", lib / "k3patch" / "patches", dirs_exist_ok=True)
    for part in ("tests", "fixtures", "pyproject.toml"):
        if (raw / part).is_dir():
            shutil.copytree(raw / part, lib / part)
        elif (raw / part).exists():
            shutil.copy2(raw / part, lib / part)
    return lib


def scratch_copy(clean: Path, variant: Variant | None, where: Path) -> Path:
    lib = where / "lib"
    shutil.copytree(clean, lib)
    if variant is not None:
        for rel, text in mutated(clean / "k3patch" / "patches", variant).items():
            (lib / "k3patch" / "patches" / rel).write_text(text, encoding="utf-8")
    return lib


def source_tree(name: str) -> Path:
    """A cached read-only tree: "0.31.0" (an upstream wheel) or "fork-a" (tests/forktree)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import conftest

    if name.startswith("fork-"):
        return conftest.built_fork_tree(name.removeprefix("fork-"))
    return conftest.pristine_tree(name)


def k3patch(lib: Path, *args: str, timeout: int = 600) -> tuple[int, dict, str]:
    env = {**os.environ, "PYTHONPATH": str(lib), "NO_COLOR": "1", "K3PATCH_NO_FASTPATH": "1"}
    env.pop("PYTHONSAFEPATH", None)
    proc = subprocess.run(
        [str(DEV_PYTHON), "-m", "k3patch", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=lib.parent,  # never the checkout: `-m` puts the cwd first on sys.path
        timeout=timeout,
    )
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:
        data = {}
    return proc.returncode, data, (proc.stderr or proc.stdout).strip()[-400:]


def _verdict(data: dict, patch: str) -> tuple[str, str]:
    for p in data.get("patches", []):
        if p["id"] == patch:
            bad = [s for s in p.get("sites", []) if s["verdict"] != "applied"]
            return p["verdict"], (bad[0]["site"] + ": " + bad[0]["detail"]) if bad else ""
    return "missing", data.get("error", "")


def run_tree(lib: Path, variant: Variant | None, patch: str, tree: str, work: Path) -> TreeResult:
    site = work / f"tree-{tree}"
    shutil.copytree(source_tree(tree), site, ignore=shutil.ignore_patterns(".complete"))
    try:
        rc, data, err = k3patch(lib, "status", "--vllm", str(site), "--only", patch)
        before, _ = _verdict(data, patch)
        if before != "pending":
            return TreeResult(tree, "E", f"{patch} reads {before} before apply, not pending {err}")
        rc, data, err = k3patch(lib, "apply", "--vllm", str(site))
        after, why = _verdict(data, patch)
        if rc != 0 or after != "applied":
            return TreeResult(tree, "A", f"apply exit {rc}, {patch} {after}: {why or err}"[:300])
        only = [a for p in VERIFY_WITH[patch] for a in ("--only", p)]
        args = ("verify", "--vllm", str(site), "--python", str(TREE_PYTHON), *only)
        rc, data, err = k3patch(lib, *args)
        if "verify" not in data:
            return TreeResult(tree, "E", f"verify exit {rc}: {err}")
        failed = []
        for check in data["verify"]["patches"]:
            broken = [m["module"] for m in check["modules"] if m["status"] != "ok"]
            probe = check["probe"]
            if broken:
                failed.append(f"{check['id']}: module {broken[0]} {check['modules'][0]['reason']}")
            elif probe["ok"] is False:
                failed.append(f"{check['id']}: {probe['summary']}")
            elif not probe["ran"]:
                failed.append(f"{check['id']}: probe not run")
        if failed:
            return TreeResult(tree, "P", "; ".join(failed)[:400])
        return TreeResult(tree, "S", "applied; every probe passed")
    finally:
        shutil.rmtree(site, ignore_errors=True)


def run_tests(lib: Path, patch: str) -> tuple[str, str]:
    env = {**os.environ, "PYTHONPATH": str(lib), "NO_COLOR": "1"}
    cmd = [str(DEV_PYTHON), "-m", "pytest", *TEST_ARGS, *TESTS[patch]]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=env, cwd=lib, timeout=TEST_TIMEOUT
        )
    except subprocess.TimeoutExpired:
        return "timeout", f"over {TEST_TIMEOUT} s"
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    last = proc.stdout.strip().splitlines()[-1:] or ["no output"]
    if proc.returncode == 0:
        return "passed", last[0]
    if proc.returncode == 1:
        return "killed", (failed[0] if failed else last[0])[:300]
    return "error", f"pytest exit {proc.returncode}: {last[0]}"[:300]


# --------------------------------------------------------------------------------------------
# The report.


def report_lines(results: list[Result], errors: dict[str, str], baseline: list[str]) -> list[str]:
    lines = ["| variant | patch | what it changes | trees | apply | probes | tests | result |"]
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in results:
        v = r.variant
        trees = ", ".join(f"{t.tree}: {t.outcome}" for t in r.trees) or "-"
        apply = "killed" if r.by_apply else "accepted"
        probes = "killed" if r.by_probes else "-" if r.by_apply else "passed"
        lines.append(
            f"| `{v.id}` | {v.patch} | {v.what} | {trees} | {apply} | {probes} | {r.tests} "
            f"| {r.verdict()} |"
        )
    for vid, why in errors.items():
        lines.append(f"| `{vid}` | | TABLE ERROR: {why} | | | | | error |")
    lines += ["", *count_lines(results), ""]
    total = len(results)
    count = {
        "apply": sum(r.verdict() == "killed by apply" for r in results),
        "probes": sum(r.verdict() == "killed by probes" for r in results),
        "equivalent": sum(r.verdict() == "survived (equivalent)" for r in results),
        "survived": sum(r.verdict() == "SURVIVED" for r in results),
        "error": sum(r.verdict() == "error" for r in results),
    }
    only_tests = [
        r.variant.id for r in results if r.verdict() == "SURVIVED" and r.tests == "killed"
    ]
    lines += [
        "",
        f"{total} variants run: {count['apply']} killed by apply, {count['probes']} killed by "
        f"probes, {count['survived']} survived, {count['equivalent']} survived as declared "
        f"equivalent, {count['error']} errors; {len(errors)} table errors.",
        f"Killed by the test subset too: {sum(r.tests == 'killed' for r in results)}; survivors "
        f"that only the tests catch: {', '.join(only_tests) or 'none'}.",
        "",
        "Baseline (the unmutated copy): " + "; ".join(baseline),
        "",
        "Survivors and their reasons:",
        "",
    ]
    for r in results:
        if r.survived:
            why = r.variant.equivalent or "NONE DECLARED: a probe case is missing"
            alive = ", ".join(t.tree for t in r.trees if t.outcome == "S")
            lines.append(f"- `{r.variant.id}` (survived on {alive}): {why}")
    if not any(r.survived for r in results):
        lines.append("- none")
    lines += ["", "Kills, what caught each (first failing check per tree):", ""]
    for r in results:
        for t in r.trees:
            if t.outcome in ("A", "P", "E"):
                lines.append(f"- `{r.variant.id}` {t.tree} ({t.outcome}): {t.detail}")
        if r.tests == "killed":
            lines.append(f"- `{r.variant.id}` tests: {r.tests_detail}")
    return lines


def count_lines(results: list[Result]) -> list[str]:
    """The kill count per patch and per round of rows (`written`): what apply killed, what the
    probes killed, what survived (declared equivalent apart)."""
    lines = [
        "| patch | rows written | rows | killed by apply | killed by probes | survived "
        "| survived (declared equivalent) | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    groups: dict[tuple[str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.variant.patch, r.variant.written), []).append(r)
    for (patch, written), rs in sorted(groups.items()):
        verdicts = [r.verdict() for r in rs]
        counts = [
            verdicts.count(v)
            for v in (
                "killed by apply",
                "killed by probes",
                "SURVIVED",
                "survived (equivalent)",
                "error",
            )
        ]
        lines.append(f"| {patch} | {written} | {len(rs)} | " + " | ".join(map(str, counts)) + " |")
    return lines


def write_results(lines: list[str], command: str, tests: str) -> None:
    today = datetime.date.today().isoformat()
    section = [
        "## Mutants",
        "",
        f"`{command}`, {today} (A: killed by apply, P: killed by probes, S: survived; tests: "
        f"{', '.join(t for ts in TESTS.values() for t in ts)} with `{' '.join(TEST_ARGS)}`, "
        f"run on {'the variants verify let through' if tests == 'survivors' else tests}):",
        "",
        *lines,
        "",
    ]
    text = RESULTS.read_text(encoding="utf-8") if RESULTS.exists() else ""
    start = text.find("\n## Mutants\n")
    if start == -1:
        new = text.rstrip("\n") + "\n\n" + "\n".join(section)
    else:
        end = text.find("\n## ", start + 1)
        tail = text[end:] if end != -1 else "\n"
        old = text[start : end if end != -1 else len(text)]
        new = text[: start + 1] + "\n".join(section) + kept_subsections(old) + tail
    RESULTS.write_text(new, encoding="utf-8")


KEPT = "\n### Kept: "


def kept_subsections(section: str) -> str:
    """The `### Kept: ...` subsections of the old Mutants section, each to the next heading:
    counts measured against probes of an earlier day (issue 28's baseline), which a re-run
    against today's probes cannot reproduce, so a full run carries them over."""
    kept = []
    at = section.find(KEPT)
    while at != -1:
        end = section.find("\n#", at + 1)
        kept.append(section[at : end if end != -1 else len(section)].rstrip("\n"))
        at = section.find(KEPT, at + 1)
    return "".join(part + "\n" for part in kept)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[], metavar="VARIANT")
    parser.add_argument("--patch", action="append", default=[], metavar="ID")
    parser.add_argument("--trees", help="comma-separated; each variant runs on those it lists")
    parser.add_argument(
        "--written",
        action="append",
        default=[],
        metavar="ROUND",
        help='only the rows of this round ("issue 19", "issue 28")',
    )
    parser.add_argument("--source", default="HEAD", help="a git revision, or 'worktree'")
    parser.add_argument(
        "--tests",
        choices=("survivors", "all", "none"),
        default="survivors",
        help="run the test subset on the variants verify let through (default), on all, or none",
    )
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    parser.add_argument("--list", action="store_true", help="print the table and exit")
    args = parser.parse_args(argv)

    known = {v.id for v in VARIANTS}
    unknown = [vid for vid in args.only if vid not in known]
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; see --list")
    chosen = [
        v
        for v in VARIANTS
        if (not args.only or v.id in args.only)
        and (not args.patch or v.patch in args.patch)
        and (not args.written or v.written in args.written)
    ]
    trees_wanted = set(args.trees.split(",")) if args.trees else None
    if args.list:
        for v in chosen:
            print(f"{v.id:36} {v.patch:22} {v.written:9} {','.join(v.trees):15} {v.what}")
        return 0

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="k3patch-mutants-") as tmp:
        work = Path(tmp)
        clean = export(args.source, work / "export")
        errors = table_errors(clean / "k3patch" / "patches", chosen)
        for vid, why in errors.items():
            print(f"TABLE ERROR {vid}: {why}", file=sys.stderr, flush=True)
        runnable = [v for v in chosen if v.id not in errors]

        def trees_of(v: Variant) -> list[str]:
            return [t for t in v.trees if trees_wanted is None or t in trees_wanted]

        # The baseline: the unmutated copy applies and verifies on every tree, tests pass.
        baseline: list[str] = []
        bad_base: set[tuple[str, str]] = set()
        base = scratch_copy(clean, None, work / "base")
        for patch, tree in sorted({(v.patch, t) for v in runnable for t in trees_of(v)}):
            got = run_tree(base, None, patch, tree, work)
            baseline.append(f"{patch} on {tree}: {got.outcome} ({got.detail})")
            print("baseline", baseline[-1], flush=True)
            if got.outcome != "S":
                bad_base.add((patch, tree))
        base_tests: dict[str, str] = {}

        def tests_pass_unmutated(patch: str) -> bool:
            if patch not in base_tests:
                base_tests[patch], detail = run_tests(base, patch)
                baseline.append(f"tests of {patch}: {base_tests[patch]} ({detail})")
                print("baseline", baseline[-1], flush=True)
            return base_tests[patch] == "passed"

        results = []
        for v in runnable:
            result = Result(v)
            where = work / v.id
            where.mkdir()
            lib = scratch_copy(clean, v, where)
            for tree in trees_of(v):
                if (v.patch, tree) in bad_base:
                    result.trees.append(TreeResult(tree, "E", "the unmutated baseline fails here"))
                    continue
                try:
                    result.trees.append(run_tree(lib, v, v.patch, tree, where))
                except Exception as exc:  # one variant's failure is reported, not the run's end
                    result.trees.append(TreeResult(tree, "E", f"{type(exc).__name__}: {exc}"))
            if args.tests == "none" or (args.tests == "survivors" and not result.survived):
                result.tests = "not run"
            elif not tests_pass_unmutated(v.patch):
                result.tests = "baseline fails"
            else:
                result.tests, result.tests_detail = run_tests(lib, v.patch)
            shutil.rmtree(where, ignore_errors=True)
            trees = ", ".join(f"{t.tree}: {t.outcome}" for t in result.trees)
            print(f"{v.id}: {result.verdict()} [{trees}] tests {result.tests}", flush=True)
            for t in result.trees:
                print(f"    {t.tree} {t.outcome}: {t.detail}", flush=True)
            results.append(result)

    elapsed = time.monotonic() - started
    lines = report_lines(results, errors, baseline)
    lines.append("")
    lines.append(f"Wall time {elapsed / 60:.1f} min.")
    print("\n".join(lines))
    full = not (args.only or args.patch or args.trees or args.written)
    if full and not args.no_write:
        command = "benchmarks/mutants.py" + (f" --source {args.source}" if args.source else "")
        command += f" --tests {args.tests}" if args.tests != "survivors" else ""
        write_results(lines, ".venv/bin/python " + command, args.tests)
    return 1 if errors or any(r.verdict() in ("SURVIVED", "error") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
