"""Human output (Rich) and the JSON envelope. Only the CLI calls this module.

Readable in `docker logs`: plain box characters, no path ever cut short (long cells fold
instead), colour off under NO_COLOR or when not a terminal.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from k3patch import fastpath
from k3patch.engine import ApplyOutcome, Report, RevertOutcome, patch_meta
from k3patch.model import Patch, Verdict
from k3patch.verify import BLOCKED, BROKEN, IMPORT_OK, ModuleCheck, VerifyReport

_MODULE_STYLE = {IMPORT_OK: "green", BROKEN: "bold red", BLOCKED: "yellow"}

_STYLE = {
    Verdict.PENDING: "yellow",
    Verdict.APPLIED: "green",
    Verdict.SATISFIED: "green",
    Verdict.NOT_APPLICABLE: "dim",
    Verdict.DRIFTED: "bold red",
}


def console(stderr: bool = False) -> Console:
    tty = (sys.stderr if stderr else sys.stdout).isatty()
    width = None if tty else max(int(os.environ.get("COLUMNS", "0") or 0), 160)
    return Console(stderr=stderr, highlight=False, width=width, soft_wrap=not tty)


def emit_json(command: str, exit_code: int, payload: dict[str, Any]) -> None:
    sys.stdout.write(fastpath.envelope(command, exit_code, payload))


def error_line(message: str) -> None:
    console(stderr=True).print(f"[bold red]k3patch: error:[/] {escape(message)}")


def _header(out: Console, report: Report) -> None:
    out.print(escape(fastpath.vllm_header(report.vllm_info)))


def _rows(report: Report) -> list[tuple[str, str, str, str, str]]:
    return fastpath.status_rows(patch_meta(report.patches), [r.to_json() for r in report.results])


def print_table(
    out: Console,
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    styles: Sequence[str],
) -> None:
    """A coloured Rich table on a terminal; in logs (not a terminal) the plain table the fast
    path prints too: padded columns, nothing wrapped or cut, no colour. `styles` gives one Rich
    style per row for the second column ("" for none)."""
    if not out.is_terminal:
        out.file.write(fastpath.plain_table(headers, rows))
        out.file.flush()
        return
    table = Table(box=box.SIMPLE_HEAD, show_lines=False, pad_edge=False)
    for i, header in enumerate(headers):
        table.add_column(header, overflow="fold", no_wrap=i == 1)
    for row, style in zip(rows, styles, strict=True):
        cells = [escape(c) for c in row]
        if style and cells[1]:
            cells[1] = f"[{style}]{cells[1]}[/]"
        table.add_row(*cells)
    out.print(table)


def _print_sites(out: Console, report: Report) -> None:
    rows = _rows(report)
    print_table(out, fastpath.STATUS_HEADERS, rows, [_STYLE[Verdict(r[1])] for r in rows])


def _drift_details(out: Console, report: Report) -> None:
    for result in report.drifted:
        if not result.found:
            continue
        out.print(
            f"\n[bold red]drifted[/] {escape(result.patch_id)} {escape(result.site)} in "
            f"vllm/{escape(result.file)}:{result.line}; found:"
        )
        out.print(escape(result.found), markup=True)
        if result.expected:
            out.print("expected one of: " + escape(", ".join(result.expected)))


def print_status(report: Report, quiet: bool = False) -> None:
    out = console()
    if quiet:
        results = [r.to_json() for r in report.results]
        for patch in report.patches:
            out.print(escape(fastpath.quiet_line(patch.id, results)))
        return
    _header(out, report)
    _print_sites(out, report)
    _drift_details(out, report)
    if report.interrupted:
        out.print(
            f"[bold red]an interrupted k3patch {escape(report.interrupted)} left a journal;[/] "
            "the next apply or revert rolls it back first"
        )
    out.print(fastpath.digest_line(report.digest, report.from_record))


def print_apply(outcome: ApplyOutcome, *, quiet: bool, diff: bool) -> None:
    out = console()
    report = outcome.report
    if diff and outcome.plan is not None:
        sys.stdout.write(outcome.plan.diff())
    if quiet:
        out.file.write(
            fastpath.apply_quiet_text(
                [p.id for p in report.patches],
                [r.to_json() for r in report.results],
                outcome.recovered,
                outcome.refused_patches,
                outcome.all_or_nothing,
            )
        )
        out.file.flush()
        return
    _header(out, report)
    _print_sites(out, report)
    _drift_details(out, report)
    for line in outcome.recovered:
        out.print(f"recovered: {escape(line)}")
    if outcome.refused:
        line = fastpath.refused_line(outcome.refused_patches, outcome.all_or_nothing)
        out.print("[bold red]refused:[/] " + escape(line.removeprefix("k3patch: refused: ")))
    if outcome.check:
        refused = [] if outcome.all_or_nothing else outcome.refused_patches
        pending = sorted({r.patch_id for r in report.pending_outside(refused)})
        if pending and not outcome.all_or_nothing:
            out.print("would apply: " + ", ".join(pending) + " (--check: nothing written)")
        elif not outcome.refused:
            out.print("nothing to do")
    elif outcome.written:
        out.print("wrote " + ", ".join(f"vllm/{rel}" for rel in outcome.written))
        for line in outcome.pycache:
            out.print(f"bytecode: {escape(line)}")
    elif not outcome.refused:
        out.print("nothing to do")


def print_revert(outcome: RevertOutcome) -> None:
    out = console()
    for line in outcome.recovered:
        out.print(f"recovered: {escape(line)}")
    if outcome.conflicts:
        for line in outcome.conflicts:
            out.print(f"[bold red]refused:[/] {escape(line)}")
        out.print("nothing was written; reinstall vLLM to return to the original files")
    elif outcome.nothing_recorded:
        out.print("nothing to revert: no k3patch state record in this tree")
    else:
        out.print("restored " + ", ".join(f"vllm/{rel}" for rel in outcome.restored))


def _module_text(module: ModuleCheck) -> str:
    return f"{module.reason} ({module.decided_by})" if module.reason else ""


def print_verify(report: VerifyReport) -> None:
    out = console()
    _header(out, report.report)
    out.print(f"imports with {escape(report.python)} (Python {escape(report.python_version)})")
    rows: list[tuple[str, ...]] = []
    styles: list[str] = []
    for check in report.patches:
        rows.append((check.patch_id, check.verdict.value, "", ""))
        styles.append(_STYLE[check.verdict])
        for module in check.modules:
            rows.append(("", module.status, module.module, _module_text(module)))
            styles.append(_MODULE_STYLE[module.status])
        if check.probe_ok is not None or check.probe_summary:
            state = {True: "ok", False: "failed", None: "not run"}[check.probe_ok]
            rows.append(("", f"probe {state}", "probe", check.probe_summary))
            styles.append({True: "green", False: "bold red", None: "dim"}[check.probe_ok])
    for module in report.extra:
        rows.append(("(--module)", module.status, module.module, _module_text(module)))
        styles.append(_MODULE_STYLE[module.status])
    print_table(out, ("patch", "verdict / status", "module", "result"), rows, styles)
    out.print("[green]verified[/]" if report.ok else "[bold red]verify found problems[/]")


def print_list(patches: tuple[Patch, ...]) -> None:
    rows = [
        (p.id, p.title + (f" (not covered: {p.caveat})" if p.caveat else ""), ", ".join(p.files))
        for p in patches
    ]
    print_table(console(), ("patch", "what it does", "files (under vllm/)"), rows, [""] * len(rows))
