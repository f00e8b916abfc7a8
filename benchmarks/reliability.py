"""The reliability campaigns behind the README's "Reliability" table. Run by hand:

    .venv/bin/python benchmarks/reliability.py [--only NAME ...] [--apply-runs 200] ...

On a real vLLM tree (default 0.31.0): random kill -9 / SIGTERM / SIGINT during real applies
and reverts, each followed by the recovering run and a byte-for-byte comparison
(tests/crash_campaign.py), a kill at every named commit step; tampered records and journals,
planted symlinks, racing applies and reverts, a concurrent writer during the commit, and
upgrade-then-revert across real wheels; a FIFO at every file k3patch reads (issue 21: every
target, a target's pyc, dist-info METADATA and RECORD, `_version.py`, the record, the journal)
under status, apply, revert, verify's preflight and the plugin, and during recovery, each run
bounded so that a hang is counted, never waited out. Each campaign is one row; `--only` runs
some of them and keeps the other rows of benchmarks/RELIABILITY.md as they were (so that a
2-core machine can run them in turns, each run under ten minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from conftest import _copy_minimal, pristine_tree, tree_hashes  # noqa: E402
from crash_campaign import ENV, campaign, k3, source_hashes, upgrade  # noqa: E402

from k3patch import engine, scan  # noqa: E402
from k3patch.registry import all_patches  # noqa: E402
from k3patch.tree import locate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "RELIABILITY.md"
Row = tuple[str, int, str, int]  # case, runs, what was seen, failures


def targets() -> list[str]:
    return scan.target_files(all_patches())


def fresh(pristine: Path, work: Path, name: str) -> Path:
    site = work / name
    if site.exists():
        shutil.rmtree(site)
    shutil.copytree(pristine, site, symlinks=True)
    return site


def step_kills(pristine: Path, work: Path) -> tuple[int, int]:
    """Kill at every named commit step (both ops); returns (runs, mixed trees after recovery)."""
    plan = engine.apply(locate(pristine), check=True).plan
    assert plan is not None
    steps = [
        "journal-written",
        "blobs-written",
        *(f"replaced:{r}" for r in plan.new_texts),
        "replaced:.k3patch/state.json",
        "bytecode-removed",
        "kept-removed",
        "journal-removed",
    ]
    ref = fresh(pristine, work, "ref")
    k3("apply", "--vllm", str(ref))
    patched, original = source_hashes(ref), source_hashes(pristine)
    runs = mixed = 0
    for op, start, want in (("apply", pristine, patched), ("revert", ref, original)):
        # A revert's commit replaces the sources only; its record goes after the blobs.
        for step in [s for s in steps if op == "apply" or not s.endswith("state.json")]:
            site = fresh(start, work, f"step-{op}-{runs}")
            subprocess.run(
                [sys.executable, "-m", "k3patch", op, "--vllm", str(site)],
                env={**ENV, "K3PATCH_TEST_CRASH_AT": step},
                capture_output=True,
            )
            k3(op, "--vllm", str(site))
            runs += 1
            mixed += source_hashes(site) != want
            shutil.rmtree(site)
    return runs, mixed


# -- tampered records, journals and planted symlinks -----------------------------------------


def _record(site: Path) -> dict:
    return json.loads((site / "vllm/.k3patch/state.json").read_text())


def _set_record(site: Path, data: object) -> None:
    text = data if isinstance(data, str) else json.dumps(data)
    (site / "vllm/.k3patch/state.json").write_text(text)


def _first_file(data: dict) -> tuple[str, dict]:
    return next(iter(data["files"].items()))


def _tamper_cases(outside: Path) -> dict[str, Callable[[Path], None]]:
    victim = outside / "victim.py"

    def with_file(rel: str) -> Callable[[Path], None]:
        def tamper(site: Path) -> None:
            data = _record(site)
            _, fs = _first_file(data)
            data["files"][rel] = {**fs, "applied": engine.sha256(victim.read_bytes())}
            _set_record(site, data)

        return tamper

    def field(mutate: Callable[[dict], object]) -> Callable[[Path], None]:
        return lambda site: _set_record(site, mutate(_record(site)))

    def journal(path: str) -> Callable[[Path], None]:
        def tamper(site: Path) -> None:
            entry = {"path": path, "before": None, "after": engine.sha256(victim.read_bytes())}
            (site / "vllm/.k3patch/journal.json").write_text(
                json.dumps({"op": "apply", "files": [entry]})
            )

        return tamper

    def link(rel: str, to: Path) -> Callable[[Path], None]:
        def tamper(site: Path) -> None:
            path = site / "vllm" / rel
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
            path.symlink_to(to)

        return tamper

    def blob_name(site: Path) -> None:
        data = _record(site)
        rel, fs = _first_file(data)
        data["files"][rel] = {**fs, "original": "../../../victim.py"}
        _set_record(site, data)

    return {
        "files: ../ path out": with_file("../../victim.py"),
        "files: absolute path": with_file(str(victim)),
        "files: a vLLM file that is no target": with_file("envs.py"),
        "scan: path out": field(lambda d: {**d, "scan": {**d["scan"], "../x.py": None}}),
        "blob name with ../": blob_name,
        "journal: absolute path": journal(str(victim)),
        "journal: ../ path": journal("../../victim.py"),
        "journal: truncated": lambda s: (s / "vllm/.k3patch/journal.json").write_text('{"op"'),
        "future schema": field(lambda d: {**d, "schema_version": 2}),
        "truncated record": lambda s: _set_record(s, json.dumps(_record(s))[:300]),
        "missing files": field(lambda d: {k: v for k, v in d.items() if k != "files"}),
        "missing results": field(lambda d: {k: v for k, v in d.items() if k != "results"}),
        "missing patch_set": field(lambda d: {k: v for k, v in d.items() if k != "patch_set"}),
        "mistyped files (list)": field(lambda d: {**d, "files": [1, 2]}),
        "mistyped hash (int)": field(
            lambda d: {**d, "files": {k: {**v, "applied": 7} for k, v in d["files"].items()}}
        ),
        "mistyped patches (str)": field(lambda d: {**d, "patches": "all"}),
        "mistyped result": field(lambda d: {**d, "results": [{"patch": None}]}),
        "record not an object": lambda s: _set_record(s, "[]"),
        "state.json a symlink out": link(".k3patch/state.json", victim),
        "blobs/ a symlink out": link(".k3patch/blobs", outside),
        ".k3patch a symlink out": link(".k3patch", outside),
        "state dir a regular file": lambda s: (
            (
                shutil.rmtree(s / "vllm/.k3patch"),
                (s / "vllm/.k3patch").write_text(""),
            )
            and None
        ),
        "journal a directory": lambda s: (s / "vllm/.k3patch/journal.json").mkdir() and None,
        "__pycache__ a symlink out (beside every file apply or revert writes)": lambda s: (
            [
                link(f"{d}/__pycache__".lstrip("/"), outside)(s)
                for d in {os.path.dirname(rel) for rel in targets()}
            ]
            and None
        ),
        "distributed/ a symlink out": lambda s: (
            (
                shutil.copytree(s / "vllm/distributed", outside / "distributed"),
                link("distributed", outside / "distributed")(s),
            )
            and None
        ),
    }


def tampered(pristine: Path, work: Path) -> tuple[int, int, list[str]]:
    """Every tamper on an applied tree whose one file is back to its original (so apply has
    work): apply, revert and status each must give a documented code, no internal error, and
    change nothing outside the tree; apply and revert must change nothing at all when they
    refuse, and a damaged record must never be rewritten."""
    runs = cases = 0
    failures: list[str] = []
    for name in _tamper_cases(work / "outside"):
        outside = work / "outside"
        if outside.exists():
            shutil.rmtree(outside)
        outside.mkdir()
        (outside / "victim.py").write_text("precious\n")
        tamper_now = _tamper_cases(outside)[name]
        site = fresh(pristine, work, "tampered")
        k3("apply", "--vllm", str(site))
        data = _record(site)
        rel, fs = _first_file(data)
        blob = site / "vllm/.k3patch/blobs" / fs["original"]
        (site / "vllm" / rel).write_bytes(blob.read_bytes())
        tamper_now(site)
        cases += 1
        outside_before = tree_hashes(outside)
        for command in ("status", "apply", "revert", "status"):
            before = tree_hashes(site)
            proc = k3(command, "--vllm", str(site))
            runs += 1
            text = proc.stdout + proc.stderr
            problem = None
            if "internal error" in text or "Traceback" in text or proc.returncode == 2:
                problem = f"rc {proc.returncode}: {text.strip()[-200:]}"
            elif tree_hashes(outside) != outside_before:
                problem = "wrote outside the tree"
            elif command != "status" and proc.returncode != 3:
                problem = f"not refused (rc {proc.returncode}): {text.strip()[-200:]}"
            elif command != "status" and tree_hashes(site) != before:
                problem = "refused but changed the tree"
            elif (
                command == "apply"
                and proc.returncode == 0
                and source_hashes(site) != (source_hashes(site))
            ):
                problem = "mixed"
            if problem:
                failures.append(f"{name}: {command}: {problem}")
        shutil.rmtree(site)
    return cases, runs, failures


def planted_temp_links(pristine: Path, work: Path, runs: int, seed: int) -> tuple[int, int]:
    """Symlinks to a victim at the old predictable temp names (every pid near ours) and at
    random new-style names beside every target and in .k3patch/; apply then revert must leave
    the victim's bytes and mode alone and the tree whole."""
    rng = random.Random(seed)
    written = 0
    original = source_hashes(pristine)
    for i in range(runs):
        site = fresh(pristine, work, f"planted-{i}")
        victim = work / f"victim-{i}"
        victim.write_text("root's file\n")
        os.chmod(victim, 0o600)
        dirs = {(site / "vllm" / rel).parent for rel in targets()} | {site / "vllm/.k3patch"}
        (site / "vllm/.k3patch/blobs").mkdir(parents=True)
        dirs.add(site / "vllm/.k3patch/blobs")
        # The pid the next k3patch process will most likely get: just after a throwaway one.
        base = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True)
        near = [str(int(base.stdout) + d) for d in range(1, 41)]
        for directory in dirs:
            names = [p.name for p in directory.iterdir() if p.is_file()] + [
                "state.json",
                "journal.json",
            ]
            for name in names:
                for suffix in near + [f"{rng.getrandbits(64):016x}" for _ in range(3)]:
                    link = directory / f".{name}.k3patch-tmp.{suffix}"
                    if not link.exists():
                        link.symlink_to(victim)
        ok = k3("apply", "--vllm", str(site)).returncode == 0
        ok &= k3("revert", "--vllm", str(site)).returncode == 0
        ok &= victim.read_text() == "root's file\n" and (victim.stat().st_mode & 0o777) == 0o600
        got = {k: v for k, v in source_hashes(site).items() if ".k3patch-tmp." not in k}
        written += not ok or got != original
        shutil.rmtree(site)
        victim.unlink()
    return runs, written


# -- races -------------------------------------------------------------------------------


def racing(
    pristine: Path, work: Path, rounds: int, each: int
) -> tuple[int, dict[str, int], list[str]]:
    """`rounds` times, `each` applies and `each` reverts started together on one tree."""
    messages: dict[str, None] = {}
    site = fresh(pristine, work, "racing")
    original = source_hashes(site)
    ref = fresh(pristine, work, "racing-ref")
    k3("apply", "--vllm", str(ref))
    patched = source_hashes(ref)
    seen = {"internal errors": 0, "spurious conflicts": 0, "environment errors": 0, "mixed": 0}
    for _ in range(rounds):
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "k3patch",
                    op,
                    "--quiet" if op == "apply" else "--json",
                    "--vllm",
                    str(site),
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=ENV,
            )
            for op in ["apply", "revert"] * each
        ]
        for proc in procs:
            out, err = proc.communicate()
            if proc.returncode != 0:
                text = (err or out).decode(errors="replace").strip().splitlines()
                messages.setdefault(f"rc {proc.returncode}: {text[-1] if text else ''}")
            if proc.returncode == 2:
                seen["internal errors"] += 1
            elif proc.returncode == 1:
                seen["spurious conflicts"] += 1
            elif proc.returncode not in (0,):
                seen["environment errors"] += 1
        now = source_hashes(site)
        status = k3("status", "--vllm", str(site)).returncode
        if now not in (original, patched) or status != (0 if now == patched else 1):
            seen["mixed"] += 1
    shutil.rmtree(site)
    return rounds, seen, list(messages)[:10]


def concurrent_writer(pristine: Path, work: Path, runs: int, seed: int) -> tuple[int, int, int]:
    """A writer edits a target (in place or by rename, as editors do) at a random moment of an
    apply. Its edit must survive in every run, and no run may leave a journal that blocks the
    next one. Returns (runs, edits that landed while apply ran, lost edits or blocked trees)."""
    rng = random.Random(seed)
    scratch = fresh(pristine, work, "writer-scratch")
    start = time.perf_counter()
    k3("apply", "--vllm", str(scratch))
    window = time.perf_counter() - start
    shutil.rmtree(scratch)
    during = bad = 0
    target_rel = targets()[0]
    for i in range(runs):
        site = fresh(pristine, work, f"writer-{i}")
        target = site / "vllm" / target_rel
        marker = f"# edited by the other writer {i}\n".encode()
        proc = subprocess.Popen(
            [sys.executable, "-m", "k3patch", "apply", "--quiet", "--vllm", str(site)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=ENV,
        )
        # Most runs aim at the end of the apply, where the commit is.
        time.sleep(window * rng.uniform(0.6, 1.05))
        data = target.read_bytes() + marker
        if i % 2:
            with open(target, "r+b") as handle:
                handle.write(data)
        else:
            tmp = target.with_name(".writer-tmp")
            tmp.write_bytes(data)
            os.replace(tmp, target)
        during += proc.poll() is None
        proc.wait()
        follow = k3("apply", "--quiet", "--vllm", str(site))
        if marker not in target.read_bytes() or follow.returncode == 3:
            bad += 1
        shutil.rmtree(site)
    return runs, during, bad


# -- upgrade and reinstall -----------------------------------------------------------------


def upgrades(work: Path) -> tuple[int, list[str]]:
    """Apply on one version, install another over it (k3patch's state stays), then apply and
    revert (or revert straight away): the tree must end as the new version's own files, and
    revert must never write the old version's originals."""
    failures: list[str] = []
    runs = 0
    for old, new in (
        ("0.29.0", "0.31.0"),
        ("0.31.0", "0.33.0"),
        ("0.31.0", "0.31.0"),
        ("0.29.0", "0.33.0"),
    ):
        new_root = pristine_tree(new)
        for reapply in (True, False):
            site = work / f"upgrade-{old}-{new}-{reapply}"
            _copy_minimal(pristine_tree(old), site, targets())
            k3("apply", "--vllm", str(site))
            upgrade(site, new_root, targets())
            upgraded = source_hashes(site)
            if reapply:
                k3("apply", "--vllm", str(site))
            proc = k3("revert", "--vllm", str(site))
            runs += 1
            got = source_hashes(site)
            if proc.returncode == 0 and got != upgraded:
                failures.append(f"{old}->{new} reapply={reapply}: revert wrote other bytes")
            elif proc.returncode == 1 and got != (upgraded if not reapply else got):
                failures.append(f"{old}->{new}: refused but changed files")
            elif proc.returncode not in (0, 1):
                failures.append(f"{old}->{new} reapply={reapply}: rc {proc.returncode}")
            elif reapply and proc.returncode != 0:
                failures.append(f"{old}->{new}: revert after apply refused: {proc.stdout}")
            shutil.rmtree(site)
    return runs, failures


# -- FIFOs at every file k3patch reads ---------------------------------------------------------

PLUGIN = "import sys; from k3patch import plugin; print(plugin.preflight_problem(sys.argv[1]))"


def _bounded(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str] | None:
    """The finished process, or None when it ran past `timeout` (a hang: killed)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def _fifo(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(path):
        path.unlink()
    os.mkfifo(path)


def _second_dist_info(site: Path) -> Path:
    """What `pip install --target --upgrade` leaves: an older install's dist-info beside."""
    old = site / "vllm-0.0.1.dist-info"
    old.mkdir()
    (old / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.0.1\n")
    return old


def fifo_places(pristine: Path, work: Path) -> list[tuple[str, str, Callable[[Path], None]]]:
    """(name, tree state, plant) for a FIFO at every file k3patch reads. `tree state` is
    "pending" (as installed) or "applied"; plant(site) puts the FIFO there."""
    present = [rel for rel in targets() if (pristine / "vllm" / rel).exists()]
    plan = engine.apply(locate(pristine), check=True).plan
    assert plan is not None
    written = list(plan.new_texts)
    tag = sys.implementation.cache_tag
    dist = next(pristine.glob("vllm-*.dist-info")).name

    def pyc(rel: str) -> str:
        stem = os.path.basename(rel)[: -len(".py")]
        return f"vllm/{os.path.dirname(rel)}/__pycache__/{stem}.{tag}.pyc".replace("//", "/")

    def at(rel: str) -> Callable[[Path], None]:
        return lambda site: _fifo(site / rel)

    def record_of_two(site: Path) -> None:
        _fifo(_second_dist_info(site) / "RECORD")

    def version_py(site: Path) -> None:
        shutil.rmtree(site / dist)
        _fifo(site / "vllm/_version.py")

    places: list[tuple[str, str, Callable[[Path], None]]] = []
    for state in ("pending", "applied"):
        places += [(f"target {rel}", state, at(f"vllm/{rel}")) for rel in present]
    places += [(f"pyc of {rel}", "pending", at(pyc(rel))) for rel in written]
    places += [
        ("dist-info METADATA", "applied", at(f"{dist}/METADATA")),
        ("dist-info RECORD (two dist-infos)", "applied", record_of_two),
        ("vllm/_version.py (no dist-info)", "pending", version_py),
        ("state record", "applied", at("vllm/.k3patch/state.json")),
        ("journal", "applied", at("vllm/.k3patch/journal.json")),
    ]
    return places


def fifos(pristine: Path, work: Path, timeout: float) -> tuple[int, int, int, list[str]]:
    """A FIFO at every file k3patch reads, under every command; then FIFOs met by recovery.
    Returns (places, runs, hangs, failures): a hang is a run past `timeout`; a failure is a
    hang, a traceback or internal error, or another code than the one documented (3 where the
    command reads the FIFO)."""
    runs = hangs = 0
    failures: list[str] = []
    py = [sys.executable, "-m", "k3patch"]
    places = fifo_places(pristine, work)
    written = _written(pristine)
    for name, state, plant in places:
        site = fresh(pristine, work, "fifo")
        if state == "applied":
            k3("apply", "--vllm", str(site))
        plant(site)
        # Revert last: where it does not read the FIFO it succeeds and removes the record.
        commands = {
            "plugin": [sys.executable, "-c", PLUGIN, str(site / "vllm")],
            "status": [*py, "status", "--vllm", str(site)],
            # verify's preflight: what it reads before its child (a child that prints
            # nothing: the interpreter is not what is measured here).
            "verify": [*py, "verify", "--python", "/bin/true", "--vllm", str(site)],
            "apply": [*py, "apply", "--vllm", str(site)],
            "revert": [*py, "revert", "--vllm", str(site)],
        }
        for command, cmd in commands.items():
            proc = _bounded(cmd, timeout)
            runs += 1
            if proc is None:
                hangs += 1
                failures.append(f"fifo {name}: {command}: hung (> {timeout:g} s)")
                continue
            text = proc.stdout + proc.stderr
            # What each command reads: status, verify and the plugin no bytecode; revert only
            # the record, the journal, the dist-info and the files apply wrote.
            reads = not (name.startswith("pyc") and command in ("status", "plugin", "verify"))
            if command == "plugin":  # a tree with no record: it hashes no target
                reads = reads and (state == "applied" or not name.startswith("target"))
            if command == "revert":
                reads = state == "applied" and not (
                    name.startswith("target") and name[len("target ") :] not in written
                )
            if "Traceback" in text or "internal error" in text:
                failures.append(f"fifo {name}: {command}: {text.strip()[-200:]}")
            elif command == "plugin":
                if reads and "regular" not in proc.stdout:
                    failures.append(f"fifo {name}: plugin did not name it: {proc.stdout.strip()}")
            elif reads and proc.returncode != 3:
                failures.append(f"fifo {name}: {command}: rc {proc.returncode}: {text[-200:]}")
        shutil.rmtree(site)
    # Recovery: a run killed mid-commit, then a FIFO where the recovering run must look.
    recovered = 0
    for op in ("apply", "revert"):
        for where in ("pyc", "record", "target"):
            site = fresh(pristine, work, "fifo-recovery")
            if op == "revert":
                k3("apply", "--vllm", str(site))
            first = written[0]
            crash = {**ENV, "K3PATCH_TEST_CRASH_AT": f"replaced:{first}"}
            subprocess.run([*py, op, "--vllm", str(site)], capture_output=True, env=crash)
            if not (site / "vllm/.k3patch/journal.json").exists():
                failures.append(f"recovery {op} {where}: the crash left no journal")
                continue
            stem = os.path.basename(first)[: -len(".py")]
            tag = sys.implementation.cache_tag
            rel = {
                "pyc": f"vllm/{os.path.dirname(first)}/__pycache__/{stem}.{tag}.pyc",
                "record": "vllm/.k3patch/state.json",
                "target": f"vllm/{first}",
            }[where]
            _fifo(site / rel.replace("//", "/"))
            proc = _bounded([*py, op, "--vllm", str(site)], timeout)
            runs += 1
            recovered += 1
            if proc is None:
                hangs += 1
                failures.append(f"recovery {op} with a FIFO {where}: hung (> {timeout:g} s)")
            elif "Traceback" in proc.stderr or "internal error" in proc.stderr:
                failures.append(f"recovery {op} {where}: {proc.stderr.strip()[-200:]}")
            elif proc.returncode != (0 if where == "pyc" else 3):
                failures.append(f"recovery {op} {where}: rc {proc.returncode}: {proc.stderr}")
            shutil.rmtree(site)
    return len(places) + recovered, runs, hangs, failures


def _written(pristine: Path) -> list[str]:
    plan = engine.apply(locate(pristine), check=True).plan
    assert plan is not None
    return list(plan.new_texts)


# -- the table -----------------------------------------------------------------------------


def _add(row: Row, line: str) -> Row:
    """A row of this run added to the same campaign's row of an earlier run (--add)."""
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) != 4 or re.sub(r"\d+", "#", cells[2]) != re.sub(r"\d+", "#", row[2]):
        return row
    earlier = iter(int(n) for n in re.findall(r"\d+", cells[2]))
    seen = re.sub(r"\d+", lambda m: str(int(m.group()) + next(earlier)), row[2])
    return (row[0], row[1] + int(cells[1]), seen, row[3] + int(cells[3]))


BEGIN = "<!-- reliability.py: begin -->"
FINISH = "<!-- reliability.py: end -->"


def merge(rows: list[Row], header: str, command: str, add: bool = False) -> str:
    """This script's block of RELIABILITY.md with these rows replaced (or, with `add`, summed
    into) and every other row of the block kept. Only the block's own rows are read: the page
    holds other tables (benchmarks/faults.py's, the history) whose rows look alike."""
    old: dict[str, str] = {}
    for line in own_block(RESULTS.read_text() if RESULTS.exists() else "").splitlines():
        match = re.match(r"^\| (.+?) \| \d+ \|", line)
        if match and not line.startswith("| case"):
            old[match.group(1)] = line
    for row in rows:
        if add and row[0] in old:
            row = _add(row, old[row[0]])
        case, runs, seen, failures = row
        old[case] = f"| {case} | {runs} | {seen} | {failures} |"
    lines = [
        header,
        "",
        f"Last command: `{command}`. Rows of campaigns not run by it are kept from earlier runs.",
        "",
        "| case | runs | seen | failures |",
        "|---|---:|---|---:|",
        *old.values(),
        "",
        "A failure is: a tree that is neither fully patched nor fully original after the",
        "recovering run (or `status` disagreeing with it, or temp files left); for tampering, an",
        "exit code other than the documented one (apply and revert must refuse with 3), an",
        "internal error, a byte written outside the tree, or a refusal that changed the tree; for",
        "planted links, the victim's bytes or mode changed; for racing, any internal error,",
        "conflict, environment error, or a mixed tree after a round; for the other writer, its",
        "edit missing afterwards or a journal that blocks the next apply; for upgrades, revert",
        "writing anything but the new version's own files; for FIFOs, a run past the timeout (a",
        "hang), a traceback or internal error, or any code but 3 from a command that reads the",
        "FIFO (for the plugin, a message that does not name it).",
    ]
    return "\n".join(lines) + "\n"


def own_block(text: str) -> str:
    """The part of RELIABILITY.md between this script's markers ("" when there is none)."""
    if BEGIN not in text or FINISH not in text:
        return ""
    return text.split(BEGIN, 1)[1].split(FINISH, 1)[0]


def write_block(block: str) -> None:
    """RELIABILITY.md with this script's block replaced and everything else kept as it is (the
    page's title, benchmarks/faults.py's block, the history); a page without the markers gets
    the block at its end."""
    text = RESULTS.read_text() if RESULTS.exists() else "# Reliability campaigns\n"
    wrapped = f"{BEGIN}\n{block.rstrip()}\n{FINISH}"
    if BEGIN in text and FINISH in text:
        before, rest = text.split(BEGIN, 1)
        text = before + wrapped + rest.split(FINISH, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + wrapped + "\n"
    RESULTS.write_text(text)


CAMPAIGNS = (
    "steps",
    "kill9",
    "signals",
    "tampered",
    "planted",
    "racing",
    "writer",
    "upgrade",
    "fifos",
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", default="0.31.0")
    parser.add_argument("--only", nargs="*", choices=CAMPAIGNS, default=list(CAMPAIGNS))
    parser.add_argument("--apply-runs", type=int, default=200)
    parser.add_argument("--revert-runs", type=int, default=100)
    parser.add_argument("--signal-runs", type=int, default=40, help="per signal and op")
    parser.add_argument("--planted-runs", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--racers", type=int, default=16, help="applies (and reverts) a round")
    parser.add_argument("--writer-runs", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fifo-timeout", type=float, default=60.0, help="seconds: a hang")
    parser.add_argument(
        "--add", action="store_true", help="add this run's counts to the rows already there"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="k3patch-reliability-"))
    pristine = work / "pristine"
    _copy_minimal(pristine_tree(args.version), pristine, targets())
    started = time.time()
    rows: list[Row] = []
    failures: list[str] = []
    s = args.seed
    if "steps" in args.only:
        runs, mixed = step_kills(pristine, work)
        rows.append(
            ("kill -9 at every named commit step (apply and revert)", runs, f"{runs} killed", mixed)
        )
    if "kill9" in args.only:
        for op, n, seed in (
            ("apply", args.apply_runs, 11 + s),
            ("revert", args.revert_runs, 12 + s),
        ):
            (work / op).mkdir()
            r = campaign(pristine, work / op, runs=n, op=op, seed=seed)
            failures += [f"{op}: {line}" for line in r.failures]
            bad = r.mixed_after_recovery + r.status_disagreed + r.litter
            rows.append(
                (
                    f"kill -9 at a random moment during {op}",
                    r.runs,
                    f"{r.killed_mid_run} killed while running",
                    bad,
                )
            )
    if "signals" in args.only:
        for sig in (signal.SIGTERM, signal.SIGINT):
            for op in ("apply", "revert"):
                where = work / f"{sig.name}-{op}"
                where.mkdir()
                r = campaign(pristine, where, runs=args.signal_runs, op=op, seed=21 + s, sig=sig)
                failures += [f"{sig.name} {op}: {line}" for line in r.failures]
                bad = r.mixed_after_recovery + r.status_disagreed + r.litter
                rows.append(
                    (
                        f"{sig.name} at a random moment during {op}",
                        r.runs,
                        f"{r.killed_mid_run} signalled while running",
                        bad,
                    )
                )
    if "tampered" in args.only:
        cases, runs, found = tampered(pristine, work)
        failures += found
        rows.append(
            (
                f"tampered records and journals, planted symlinks ({cases} kinds; status, "
                "apply, revert, status each)",
                runs,
                "documented code, nothing outside the tree, nothing changed on refusal",
                len(found),
            )
        )
    if "planted" in args.only:
        runs, written = planted_temp_links(pristine, work, args.planted_runs, 31 + s)
        rows.append(
            (
                "symlinks planted at the next 40 pids' old-style temp names and at random "
                "new-style ones, beside every target and in .k3patch/, apply then revert",
                runs,
                "victim file's bytes and mode kept, tree whole",
                written,
            )
        )
    if "racing" in args.only:
        rounds, seen, found = racing(pristine, work, args.rounds, args.racers)
        failures += found
        bad = sum(seen.values())
        rows.append(
            (
                f"{args.racers} applies + {args.racers} reverts racing on one tree, per round",
                rounds,
                ", ".join(f"{v} {k}" for k, v in seen.items()),
                bad,
            )
        )
    if "writer" in args.only:
        runs, during, bad = concurrent_writer(pristine, work, args.writer_runs, 41 + s)
        rows.append(
            (
                "another writer edits a target during apply (in place or by rename)",
                runs,
                f"{during} edits landed while apply ran; lost edits or blocked trees",
                bad,
            )
        )
    if "upgrade" in args.only:
        runs, found = upgrades(work)
        failures += found
        rows.append(
            (
                "upgrade or reinstall over an applied tree (0.29->0.31, 0.31->0.33, "
                "0.31->0.31, 0.29->0.33), then revert (with and without a new apply)",
                runs,
                "the new version's own files; never the old originals",
                len(found),
            )
        )
    if "fifos" in args.only:
        places, runs, hangs, found = fifos(pristine, work, args.fifo_timeout)
        failures += found
        rows.append(
            (
                "a FIFO at every file k3patch reads (each target present, pending and applied; "
                "the pycs of the targets apply writes; dist-info METADATA and RECORD; "
                "`_version.py`; the record; the journal) under status, apply, revert, verify's "
                "preflight and the plugin, and met by the recovery of a killed apply and revert",
                runs,
                f"{places} places, {hangs} hangs",
                len(found),
            )
        )
    header = (
        f"Last run {time.strftime('%Y-%m-%d')}, vLLM {args.version} wheel, "
        f"{time.time() - started:.0f} s."
    )
    command = "benchmarks/reliability.py " + " ".join(sys.argv[1:])
    text = merge(rows, header, command, args.add)
    if failures:
        text += "\nFailures of the last run:\n\n" + "".join(f"- {f}\n" for f in failures)
    print(text)
    write_block(text)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
