"""Human output (Rich) and the JSON envelope. Only the CLI calls this module.

Readable in `docker logs`: plain box characters, no path ever cut short (long cells fold
instead), colour off under NO_COLOR or when not a terminal.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from k3patch import fastpath
from k3patch.engine import ApplyOutcome, Report, RevertOutcome, patch_meta
from k3patch.model import Patch, Verdict
from k3patch.verify import BROKEN, IMPORT_OK, VerifyReport

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


def _print_sites(out: Console, report: Report) -> None:
    """A coloured table on a terminal; in logs the plain table the fast path prints too."""
    rows = _rows(report)
    if not out.is_terminal:
        out.file.write(fastpath.plain_table(fastpath.STATUS_HEADERS, rows))
        out.file.flush()
        return
    table = Table(box=box.SIMPLE_HEAD, show_lines=False, pad_edge=False)
    for header in fastpath.STATUS_HEADERS:
        table.add_column(header, overflow="fold", no_wrap=header == "verdict")
    for patch_id, verdict, site, file, reason in rows:
        style = _STYLE[Verdict(verdict)]
        table.add_row(
            escape(patch_id), f"[{style}]{verdict}[/]", escape(site), escape(file), escape(reason)
        )
    out.print(table)


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


def _quiet_line(report: Report, patch: Patch) -> str:
    return fastpath.quiet_line(patch.id, [r.to_json() for r in report.results])


def print_status(report: Report, quiet: bool = False) -> None:
    out = console()
    if quiet:
        for patch in report.patches:
            out.print(escape(_quiet_line(report, patch)))
        return
    _header(out, report)
    _print_sites(out, report)
    _drift_details(out, report)
    if report.interrupted:
        out.print(
            f"[bold red]an interrupted k3patch {escape(report.interrupted)} left a journal;[/] "
            "the next apply or revert rolls it back first"
        )
    out.print(
        f"digest {report.digest}" + ("  (from the state record)" if report.from_record else "")
    )


def print_apply(outcome: ApplyOutcome, *, quiet: bool, diff: bool) -> None:
    out = console()
    report = outcome.report
    if diff and outcome.plan is not None:
        sys.stdout.write(outcome.plan.diff())
    if quiet:
        # One line per patch, for entrypoint logs.
        for patch in report.patches:
            out.print(f"k3patch: {escape(_quiet_line(report, patch))}")
        for line in outcome.recovered:
            out.print(f"k3patch: recovered: {line}")
        return
    _header(out, report)
    _print_sites(out, report)
    _drift_details(out, report)
    for line in outcome.recovered:
        out.print(f"recovered: {escape(line)}")
    if outcome.refused:
        out.print("[bold red]refused:[/] a site has drifted; nothing was written")
    elif outcome.check:
        pending = sorted({r.patch_id for r in report.pending})
        if pending:
            out.print("would apply: " + ", ".join(pending) + " (--check: nothing written)")
        else:
            out.print("nothing to do")
    elif outcome.written:
        out.print("wrote " + ", ".join(f"vllm/{rel}" for rel in outcome.written))
        for line in outcome.pycache:
            out.print(f"bytecode: {escape(line)}")
    else:
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


def print_verify(report: VerifyReport) -> None:
    out = console()
    _header(out, report.report)
    out.print(f"imports with {escape(report.python)} (Python {escape(report.python_version)})")
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("patch", overflow="fold")
    table.add_column("verdict", no_wrap=True)
    table.add_column("module / probe", overflow="fold")
    table.add_column("result", overflow="fold")
    for check in report.patches:
        table.add_row(
            escape(check.patch_id), f"[{_STYLE[check.verdict]}]{check.verdict.value}[/]", "", ""
        )
        for module in check.modules:
            style = (
                "green"
                if module.status == IMPORT_OK
                else ("bold red" if module.status == BROKEN else "yellow")
            )
            text = module.status
            if module.reason:
                text += f": {module.reason} ({module.decided_by})"
            table.add_row("", "", escape(module.module), f"[{style}]{escape(text)}[/]")
        if check.probe_ok is not None or check.probe_summary:
            style = (
                "green" if check.probe_ok else ("bold red" if check.probe_ok is False else "dim")
            )
            table.add_row("", "", "probe", f"[{style}]{escape(check.probe_summary)}[/]")
    for module in report.extra:
        text = module.status + (f": {module.reason} ({module.decided_by})" if module.reason else "")
        table.add_row("(--module)", "", escape(module.module), escape(text))
    out.print(table)
    out.print("[green]verified[/]" if report.ok else "[bold red]verify found problems[/]")


def print_list(patches: tuple[Patch, ...]) -> None:
    out = console()
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("patch", no_wrap=True)
    table.add_column("what it does", overflow="fold")
    table.add_column("files (under vllm/)", overflow="fold")
    for patch in patches:
        title = patch.title + (
            f" [dim](not covered: {escape(patch.caveat)})[/]" if patch.caveat else ""
        )
        table.add_row(patch.id, title, ", ".join(patch.files))
    out.print(table)
