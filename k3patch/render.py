"""Human output and the JSON envelope. Only the CLI calls this module.

The report is built as plain lines by `plaintext` (the no-op path prints the same lines). In a
log (stdout not a terminal) they are wrapped at `plaintext.LOG_WIDTH` and written as they are:
no colour, no Rich. On a terminal they are wrapped at the terminal's width, words never split,
and Rich colours the verdicts (no colour under NO_COLOR).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import IO, TYPE_CHECKING, Any

from k3patch import fastpath, formats, plaintext
from k3patch.engine import ApplyOutcome, RevertOutcome
from k3patch.patch import Patch
from k3patch.scan import Report, patch_meta
from k3patch.verify import BLOCKED, BROKEN, IMPORT_OK, ModuleCheck, VerifyReport

if TYPE_CHECKING:
    from k3patch.plaintext import Line

_STYLE = {
    "pending": "yellow",
    "applied": "green",
    "satisfied": "green",
    "not applicable": "dim",
    "drifted": "bold red",
    "error": "bold red",
    "ok": "green",
    "failed": "bold red",
    "not run": "dim",
    IMPORT_OK: "green",
    BROKEN: "bold red",
    BLOCKED: "yellow",
}


def emit(lines: Iterable[Line], *, stderr: bool = False) -> None:
    stream: IO[str] = sys.stderr if stderr else sys.stdout
    if not stream.isatty():
        stream.write(plaintext.as_text(lines))
        stream.flush()
        return
    from rich.console import Console
    from rich.text import Text

    console = Console(file=stream, highlight=False)
    width = console.width
    for text, hang, style, start, end in lines:
        for i, part in enumerate(plaintext.wrap(text, width, hang)):
            out = Text(part)
            if i == 0 and style and end > start and part[start:end] == text[start:end]:
                out.stylize(_STYLE.get(style, ""), start, end)
            # Already wrapped on word boundaries: Rich must not wrap or fold it again.
            console.print(out, soft_wrap=True)


def emit_json(command: str, exit_code: int, payload: dict[str, Any]) -> None:
    sys.stdout.write(formats.envelope(command, exit_code, payload))


def error_line(message: str, *, prefix: str = "k3patch: error:") -> None:
    """An error stays one line, however long and whatever it names: scripts and tests take it
    as one record. A control character (a newline in a path) is shown escaped, and on a
    terminal Rich neither wraps nor crops it at the terminal's width."""
    text = f"{prefix} {plaintext.escape_controls(message)}"
    if not sys.stderr.isatty():
        sys.stderr.write(f"{text}\n")
        sys.stderr.flush()
        return
    from rich.console import Console
    from rich.text import Text

    styled = Text(text)
    styled.stylize(_STYLE["error"], 0, len(prefix))
    Console(file=sys.stderr, highlight=False).print(styled, soft_wrap=True)


def _results(report: Report) -> list[dict[str, Any]]:
    return [r.to_json() for r in report.results]


def print_status(report: Report, *, quiet: bool = False, every_site: bool = False) -> None:
    results = _results(report)
    if quiet:
        emit(plaintext.line(formats.quiet_line(p.id, results)) for p in report.patches)
        return
    emit(
        plaintext.status_lines(
            report.vllm_info,
            patch_meta(report.patches),
            results,
            report.digest,
            report.from_record,
            report.interrupted,
            every_site=every_site,
        )
    )


def print_apply(
    outcome: ApplyOutcome, *, quiet: bool, diff: bool, every_site: bool = False
) -> None:
    report = outcome.report
    if diff and outcome.plan is not None:
        sys.stdout.write(outcome.plan.diff())
    if quiet:
        sys.stdout.write(
            fastpath.apply_quiet_text(
                [p.id for p in report.patches],
                _results(report),
                outcome.recovered,
                outcome.refused_patches,
                outcome.all_or_nothing,
            )
        )
        for patch_id, why in outcome.bugs.items():
            sys.stdout.write(
                plaintext.as_text([plaintext.line(f"k3patch: {plaintext.bug_text(patch_id, why)}")])
            )
        sys.stdout.flush()
        bug_line(outcome)
        return
    before = outcome.plan.before.results if outcome.plan is not None else []
    emit(
        plaintext.apply_lines(
            report.vllm_info,
            patch_meta(report.patches),
            _results(report),
            before=[r.to_json() for r in before],
            written=outcome.written,
            bytecode=outcome.pycache,
            recovered=outcome.recovered,
            refused=outcome.refused_patches,
            refused_text=_refused_text(outcome),
            all_or_nothing=outcome.all_or_nothing,
            check=outcome.check,
            every_site=every_site,
            bugs=outcome.bugs,
        )
    )
    bug_line(outcome)


def bug_line(outcome: ApplyOutcome) -> None:
    """A k3patch bug is an error (exit 2): one line on stderr too, for whoever reads only that."""
    if outcome.bugs:
        names = ", ".join(outcome.bugs)
        rest = (
            "nothing of it was written, the others were" if outcome.written else "nothing written"
        )
        error_line(
            f"internal error (a k3patch bug): the rewrite of {names} failed its own checks; {rest}"
        )


def _refused_text(outcome: ApplyOutcome) -> str:
    if not outcome.refused_patches:
        return ""
    line = fastpath.refused_line(outcome.refused_patches, outcome.all_or_nothing)
    return line.removeprefix("k3patch: refused: ")


def print_recorded_diff(diff: str | None) -> None:
    """`status --diff`: the diff as it is (a diff is never wrapped), or one line saying why
    there is none."""
    if diff:
        sys.stdout.write(diff)
        sys.stdout.flush()
    elif diff is None:
        emit([plaintext.line("no state record: k3patch has changed nothing in this tree")])
    else:
        emit([plaintext.line("every file k3patch recorded holds its original again")])


def print_revert(outcome: RevertOutcome) -> None:
    lines = [plaintext.line(f"recovered: {step}") for step in outcome.recovered]
    if outcome.conflicts:
        lines += [
            plaintext.line(f"refused: {why}", 2, "error", 0, len("refused:"))
            for why in outcome.conflicts
        ]
        lines.append(
            plaintext.line(
                "nothing was written: each file above changed since k3patch wrote it (an upgrade, "
                "a reinstall or an edit); `k3patch status --diff` shows how, and reinstalling "
                "vLLM gives back its own files"
            )
        )
    elif outcome.nothing_recorded:
        lines.append(plaintext.line("nothing to revert: no k3patch state record in this tree"))
    else:
        lines.append(plaintext.line("restored:"))
        lines += [plaintext.line(f"  vllm/{rel}") for rel in outcome.restored]
        lines += [plaintext.line(f"bytecode: {step}") for step in outcome.pycache]
    emit(lines)


def _module_line(prefix: str, module: ModuleCheck) -> Line:
    reason = f": {module.reason} ({module.decided_by})" if module.reason else ""
    text = f"{prefix}{module.status} {module.module}{reason}"
    return plaintext.line(
        text, len(prefix) + 4, module.status, len(prefix), len(prefix) + len(module.status)
    )


def verify_lines(report: VerifyReport) -> list[Line]:
    lines = [
        plaintext.header(report.report.vllm_info),
        plaintext.line(f"imports with {report.python} (Python {report.python_version})"),
    ]
    id_width = max([len(c.patch_id) for c in report.patches] or [0])
    ran: list[str] = []
    not_run: list[str] = []
    for check in report.patches:
        verdict = check.verdict.value
        lines.append(plaintext.patch_line(check.patch_id, verdict, "", id_width))
        lines += [_module_line("  ", module) for module in check.modules]
        if check.probe_ok is None:
            not_run.append(check.patch_id)
            if check.probe_summary:
                lines.append(
                    plaintext.line(f"  probe not run: {check.probe_summary}", 4, "not run", 2, 15)
                )
            continue
        ran.append(check.patch_id)
        state = "ok" if check.probe_ok else "failed"
        text = f"  probe {state}" + (f": {check.probe_summary}" if check.probe_summary else "")
        lines.append(plaintext.line(text, 4, state, 8, 8 + len(state)))
    lines += [_module_line("(--module) ", module) for module in report.extra]
    lines.append(plaintext.line(_probes_ran(ran, not_run), 2))
    pending = [c.patch_id for c in report.patches if c.verdict.value == "pending"]
    if report.ok:
        lines.append(plaintext.line("verified", 2, "ok", 0, len("verified")))
    else:
        text = "verify found problems"
        if pending:
            text += f"; {', '.join(pending)} pending: run `k3patch apply` first"
        lines.append(plaintext.line(text, 2, "error", 0, len("verify found problems")))
    return lines


def _probes_ran(ran: Sequence[str], not_run: Sequence[str]) -> str:
    text = "probes ran: " + (", ".join(ran) if ran else "none")
    if not_run:
        text += "; not run: " + ", ".join(not_run)
    return text


def progress_line(text: str) -> None:
    """Progress goes to stderr: stdout stays the report (or the JSON) alone."""
    emit([plaintext.line(text, 4)], stderr=True)


def print_verify(report: VerifyReport) -> None:
    emit(verify_lines(report))


def print_list(patches: tuple[Patch, ...]) -> None:
    emit(
        plaintext.list_lines(
            [
                {"id": p.id, "title": p.title, "files": list(p.files), "caveat": p.caveat}
                for p in patches
            ]
        )
    )
