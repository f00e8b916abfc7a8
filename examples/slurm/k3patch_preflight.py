#!/usr/bin/env python3
"""Multi-node preflight: every node of a Slurm job must carry the same patched vLLM tree.

A Kimi-K3 deployment spans two nodes (pipeline parallel) or four (MoRIIO prefill/decode).
Group routing must be on both sides of a MoRIIO pair: the decode node sends its per-group block
ids, the prefill node writes into them; a node without the fix fails only at the first
transfer, or answers without the context. So before `vllm serve` starts, this script runs
`k3patch status --json` once per node (`srun --ntasks-per-node=1`), compares the digests and
the verdicts across nodes, and fails fast naming the odd node(s).

    # inside the allocation (sbatch/salloc), after the nodes applied the patches:
    python3 k3patch_preflight.py [--expect DIGEST] [--timeout SECONDS] [-- STATUS ARGS...]
    # from a login node, against a running job:
    python3 k3patch_preflight.py --jobid 12345 -- --vllm /opt/venv/lib/python3.12/site-packages

Arguments after `--` go to `k3patch status` on every node (e.g. `--vllm PATH`). `--srun-arg`
passes an argument to srun (repeatable; e.g. `--srun-arg=--container-image=IMAGE`).
K3PATCH_BIN names the k3patch command on the nodes (default: k3patch).

Exit codes (one per outcome; when several apply, the first in this list wins):
  5  a node did not answer (unreachable, srun failed there, or past --timeout): named
  6  k3patch failed on a node (no vLLM found, not a vLLM tree, ...): named, with its error
  4  the nodes differ (digest or verdicts): the odd node(s) named, with what differs
  1  every node is the same, but a patch is pending or drifted there (or not --expect)
  2  usage: not inside an allocation and no --jobid, srun or squeue missing, bad arguments
  0  every node reports the same digest and every patch applied, satisfied or not applicable

Standard library only: it runs with whatever python3 the login or batch node has.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from typing import Any, TextIO

OK, ATTENTION, USAGE, DIFFER, UNREACHABLE, FAILED = 0, 1, 2, 4, 5, 6
GOOD = ("applied", "satisfied", "not applicable")
WIDTH = 100

# What each task runs on its node: its name, k3patch's JSON, k3patch's exit code. Each line
# comes back prefixed with the task number (`srun --label`).
TASK = (
    'printf "K3PATCH-NODE %s\\n" "${SLURMD_NODENAME:-$(hostname -s)}"; '
    '"${K3PATCH_BIN:-k3patch}" status --json "$@"; '
    'printf "K3PATCH-RC %s\\n" "$?"'
)


def say(text: str, stream: TextIO = sys.stdout) -> None:
    for line in textwrap.wrap(
        text, WIDTH, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False
    ):
        print(line, file=stream)


def expand_nodelist(spec: str) -> list[str]:
    """Slurm's compressed host list ("gpu[01-03,07],login1") as names, in order."""
    names: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", spec):
        names.extend(_expand_one(part.strip()))
    return [n for n in names if n]


def _expand_one(part: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", part)
    if not match:
        return [part]
    head, tail = part[: match.start()], part[match.end() :]
    out: list[str] = []
    for item in match.group(1).split(","):
        low, _, high = item.partition("-")
        if high:
            width = len(low)
            values = [str(i).zfill(width) for i in range(int(low), int(high) + 1)]
        else:
            values = [low]
        for value in values:
            out.extend(_expand_one(head + value + tail))
    return out


def job_nodes(jobid: str, from_environment: bool) -> list[str]:
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "") if from_environment else ""
    if not nodelist:
        if not shutil.which("squeue"):
            raise SystemExit(_usage("squeue is not on PATH: cannot find the job's nodes"))
        proc = subprocess.run(
            ["squeue", "-h", "-j", jobid, "-o", "%N"], capture_output=True, text=True
        )
        nodelist = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
        if proc.returncode != 0 or not nodelist:
            why = (proc.stderr.strip() or "no nodes listed").splitlines()[0]
            raise SystemExit(_usage(f"job {jobid} has no nodes ({why}); is it running?"))
    return expand_nodelist(nodelist)


def _usage(message: str) -> int:
    say(f"k3patch preflight: error: {message}", sys.stderr)
    return USAGE


def run_tasks(
    jobid: str, nodes: list[str], status_args: list[str], srun_args: list[str], timeout: float
) -> tuple[dict[str, list[str]], str]:
    """Every task's output lines by task number, and srun's stderr."""
    cmd = [
        "srun",
        f"--jobid={jobid}",
        f"--nodes={len(nodes)}",
        f"--ntasks={len(nodes)}",
        "--ntasks-per-node=1",
        "--overlap",
        "--label",
        "--kill-on-bad-exit=0",
        *srun_args,
        "bash",
        "-c",
        TASK,
        "k3patch-preflight-task",
        *status_args,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        stdout = _text(exc.stdout)
        stderr = _text(exc.stderr) + f"\nsrun did not finish within {timeout:g} s"
    lines: dict[str, list[str]] = {}
    for line in stdout.splitlines():
        task, sep, rest = line.partition(": ")
        if sep and task.strip().isdigit():
            lines.setdefault(task.strip(), []).append(rest)
    return lines, stderr


def srun_reason(stderr: str, nodes: list[str]) -> str:
    """srun's error line that says why `nodes` did not answer: the first that names one of them,
    else the last. srun ends with a summary ("srun: Job step aborted") after the line that names
    the node and the cause ("Task launch ... failed on node n2: Communication connection
    failure")."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if any(re.search(rf"(?<![\w-]){re.escape(node)}(?![\w-])", line) for node in nodes):
            return line
    return lines[-1] if lines else ""


def _text(data: bytes | str | None) -> str:
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def parse_task(lines: list[str]) -> tuple[str | None, dict[str, Any] | None, str]:
    """(node name it reported, k3patch's JSON, problem) of one task's output."""
    node = next((ln.split(" ", 1)[1] for ln in lines if ln.startswith("K3PATCH-NODE ")), None)
    rc = next((ln.split(" ", 1)[1] for ln in lines if ln.startswith("K3PATCH-RC ")), None)
    if rc is None:
        return node, None, "no answer (the task did not finish)"
    body = "\n".join(ln for ln in lines if not ln.startswith("K3PATCH-"))
    try:
        data = json.loads(body)
    except ValueError:
        if not body.strip():
            hint = " (127: k3patch is not installed there)" if rc.strip() == "127" else ""
            return node, None, f"k3patch exited {rc} with no output{hint}"
        return node, None, f"k3patch exited {rc}, no JSON: {body.strip().splitlines()[0]}"
    if not isinstance(data, dict):
        return node, None, "k3patch printed no JSON object"
    if "error" in data:
        return node, data, f"k3patch exited {data.get('exit_code')}: {data['error']}"
    return node, data, ""


def verdicts(data: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """Each patch's verdict, and a journal a killed run left (that node's next apply rolls
    back, so it needs attention even where every file reads applied)."""
    journal = [("journal", f"interrupted {data['interrupted']}")] if data.get("interrupted") else []
    return tuple((p["id"], p["verdict"]) for p in data.get("patches", [])) + tuple(journal)


def describe(data: dict[str, Any]) -> str:
    return ", ".join(f"{pid} {verdict}" for pid, verdict in verdicts(data))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    status_args: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, status_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(
        prog="k3patch_preflight.py",
        description="Compare k3patch's status across the nodes of a Slurm job.",
    )
    parser.add_argument("--jobid", metavar="ID", help="default: this allocation's SLURM_JOB_ID")
    parser.add_argument("--expect", metavar="DIGEST", help="the digest every node must report")
    parser.add_argument(
        "--timeout", metavar="SECONDS", type=float, default=120.0, help="default: 120"
    )
    parser.add_argument("--srun-arg", metavar="ARG", action="append", default=[])
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return USAGE if exc.code else OK
    jobid = args.jobid or os.environ.get("SLURM_JOB_ID")
    if not jobid:
        return _usage(
            "not inside a Slurm allocation (no SLURM_JOB_ID); run it in the job's "
            "batch script or salloc, or pass --jobid"
        )
    if not shutil.which("srun"):
        return _usage("srun is not on PATH")
    try:
        nodes = job_nodes(jobid, from_environment=args.jobid is None)
    except SystemExit as exc:
        return int(exc.code or USAGE)
    if not nodes:
        return _usage(f"job {jobid} lists no nodes")
    say(f"k3patch preflight: job {jobid}, {len(nodes)} node(s): {' '.join(nodes)}")

    tasks, srun_errors = run_tasks(jobid, nodes, status_args, args.srun_arg, args.timeout)
    answers: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    for task in sorted(tasks, key=int):
        reported, data, problem = parse_task(tasks[task])
        # With one task per node, srun places task i on the i-th node of the job's list.
        if reported in nodes:
            node = reported
        elif int(task) < len(nodes):
            node = nodes[int(task)]
        else:
            node = reported or f"task {task}"
        if problem and data is None and problem.startswith("no answer"):
            continue  # counted below as unreachable
        if problem:
            failed[node] = problem
        elif data is not None:
            answers[node] = data
    unreachable = [n for n in nodes if n not in answers and n not in failed]

    for node in nodes:
        if node in answers:
            data = answers[node]
            say(f"  {node}: digest {data.get('digest')}: {describe(data)}")
    if unreachable:
        reason = srun_reason(srun_errors, unreachable)
        say(
            f"k3patch preflight: FAILED: no answer from {', '.join(unreachable)}"
            + (f" ({reason})" if reason else "")
            + "; do not start vLLM until every node answers",
            sys.stderr,
        )
        return UNREACHABLE
    if failed:
        for node, problem in failed.items():
            say(f"k3patch preflight: FAILED on {node}: {problem}", sys.stderr)
        return FAILED

    groups = Counter((d.get("digest"), verdicts(d)) for d in answers.values())
    if len(groups) > 1:
        (common, count), *_ = groups.most_common()
        # Which side is odd: the one off --expect when given, else the minority. Two halves
        # of equal size (two nodes) without --expect: both are named.
        expected = [key for key in groups if key[0] == args.expect]
        if expected:
            common, count = expected[0], groups[expected[0]]
        tie = not expected and sum(1 for c in groups.values() if c == count) > 1
        for node, data in answers.items():
            key = (data.get("digest"), verdicts(data))
            if key == common and not tie:
                continue
            theirs = dict(verdicts(data))
            differs = [
                f"{pid} {theirs.get(pid)} (others {v})"
                for pid, v in common[1]
                if theirs.get(pid) != v
            ]
            say(
                f"k3patch preflight: FAILED: {node} differs"
                + ("" if tie else f" from the other {count} node(s)")
                + f": digest {data.get('digest')}"
                + ("" if tie else f" vs {common[0]}")
                + (f"; {', '.join(differs)}" if differs and not tie else ""),
                sys.stderr,
            )
        say(
            "k3patch preflight: every node must carry the same tree (prefill and decode both "
            "need group routing); apply on the odd node(s), then run this again",
            sys.stderr,
        )
        return DIFFER

    digest = next(iter(answers.values())).get("digest")
    not_good = [f"{pid} {v}" for pid, v in next(iter(groups))[1] if v not in GOOD]
    if not_good:
        say(
            f"k3patch preflight: all {len(nodes)} node(s) agree (digest {digest}) but need "
            f"attention: {', '.join(not_good)}; run `k3patch apply` on every node",
            sys.stderr,
        )
        return ATTENTION
    if args.expect and digest != args.expect:
        say(
            f"k3patch preflight: all {len(nodes)} node(s) agree on digest {digest}, "
            f"not the expected {args.expect}",
            sys.stderr,
        )
        return ATTENTION
    say(f"k3patch preflight: ok: all {len(nodes)} node(s) report digest {digest}")
    return OK


if __name__ == "__main__":
    sys.exit(main())
