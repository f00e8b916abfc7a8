"""Human output and the JSON envelope, for the CLI. The lines come from `plaintext`; in a log
they are written as they are, on a terminal wrapped at its width and coloured by Rich (no
colour under NO_COLOR)."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import IO, TYPE_CHECKING, Any

from k3patch import formats, plaintext
from k3patch.engine import ApplyOutcome
from k3patch.plaintext import line
from k3patch.verify import BLOCKED, BROKEN, IMPORT_OK, ModuleCheck, VerifyReport

if TYPE_CHECKING:
    from k3patch.plaintext import Line

_STYLE = {
    **dict.fromkeys(("applied", "satisfied", "ok", IMPORT_OK), "green"),
    **dict.fromkeys(("pending", BLOCKED), "yellow"),
    **dict.fromkeys(("not applicable", "not run"), "dim"),
    **dict.fromkeys(("drifted", "error", "failed", BROKEN), "bold red"),
}


def emit(lines: Iterable[Line], *, stderr: bool = False, width: int | None = None) -> None:
    """The lines at `width` columns: in a log `plaintext.LOG_WIDTH`, on a terminal its width."""
    stream: IO[str] = sys.stderr if stderr else sys.stdout
    if not stream.isatty():
        stream.write(plaintext.as_text(lines, width or plaintext.LOG_WIDTH))
        stream.flush()
        return
    from rich.console import Console
    from rich.text import Text

    console = Console(file=stream, highlight=False)
    if console.width < 1:  # COLUMNS=0: Rich would print nothing at all, errors included
        console = Console(file=stream, highlight=False, width=plaintext.LOG_WIDTH)
    for text, hang, style, start, end in lines:
        for i, part in enumerate(plaintext.wrap(text, width or console.width, hang)):
            out = Text(part)
            if i == 0 and style and end > start and part[start:end] == text[start:end]:
                out.stylize(_STYLE.get(style, ""), start, end)
            # Already wrapped on word boundaries: Rich must not wrap or fold it again.
            console.print(out, soft_wrap=True)


def emit_json(command: str, exit_code: int, payload: dict[str, Any]) -> None:
    sys.stdout.write(formats.envelope(command, exit_code, payload))


def error_line(message: str, *, prefix: str = "k3patch: error:") -> None:
    """An error stays one line, however long and whatever it names: scripts and tests take it
    as one record. A control character (a newline in a path) is shown escaped."""
    emit([plaintext.error(prefix, f" {message}")], stderr=True, width=sys.maxsize)


def warning_lines(notes: Iterable[str]) -> None:
    """A warning among a commit's notes (a group that could not be kept) is one line on stderr
    as well, where scripts and logs look for what needs a look."""
    for note in notes:
        if note.startswith("warning: "):
            error_line(note.removeprefix("warning: "), prefix="k3patch: warning:")


def apply_payload(outcome: ApplyOutcome) -> dict[str, Any]:
    """`apply`'s JSON, inside the envelope; its human report is made from it too."""
    payload = outcome.report.to_json()
    payload.update(
        formats.apply_fields(
            check=outcome.check,
            refused_patches=outcome.refused_patches,
            all_or_nothing=outcome.all_or_nothing,
            written=outcome.written,
            recovered=outcome.recovered,
            bytecode=outcome.pycache,
            bugs=outcome.bugs,
        )
    )
    return payload


def print_apply(outcome: ApplyOutcome, *, quiet: bool, diff: bool, every_site: bool) -> None:
    payload = apply_payload(outcome)
    if diff and outcome.plan is not None:
        sys.stdout.write(outcome.plan.diff())
    if quiet:  # for entrypoint logs: at the log width on a terminal too
        sys.stdout.write(plaintext.as_text(plaintext.apply_quiet_lines(payload)))
        sys.stdout.flush()
    else:
        before = [r.to_json() for r in outcome.plan.before.results] if outcome.plan else []
        emit(plaintext.apply_lines(payload, before=before, every_site=every_site))


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


def print_recorded_diff(diff: str | None) -> None:
    """`status --diff`: the diff as it is (a diff is never wrapped), or one line saying why
    there is none."""
    if diff:
        sys.stdout.write(diff)
        sys.stdout.flush()
    elif diff is None:
        emit([line("no state record: k3patch has changed nothing in this tree")])
    else:
        emit([line("every file k3patch recorded holds its original again")])


def print_revert(payload: dict[str, Any]) -> None:
    lines = [line(f"recovered: {step}") for step in payload["recovered"]]
    if payload["conflicts"]:
        lines += [plaintext.error("refused:", f" {why}") for why in payload["conflicts"]]
        lines.append(
            line(
                "nothing was written: each file above changed since k3patch wrote it (an upgrade, "
                "a reinstall or an edit); `k3patch status --diff` shows how, and reinstalling "
                "vLLM gives back its own files"
            )
        )
    elif payload["nothing_recorded"]:
        lines.append(line("nothing to revert: no k3patch state record in this tree"))
    else:
        lines += plaintext.files_lines("restored:", payload["restored"], payload["bytecode"])
    emit(lines)


def _module_line(prefix: str, module: ModuleCheck) -> Line:
    reason = f": {module.reason} ({module.decided_by})" if module.reason else ""
    text = f"{prefix}{module.status} {module.module}{reason}"
    end = len(prefix) + len(module.status)
    return line(text, len(prefix) + 4, module.status, len(prefix), end)


def print_verify(report: VerifyReport) -> None:
    lines = [
        plaintext.header(report.report.tree.info),
        line(f"imports with {plaintext.whole(report.python)} (Python {report.python_version})"),
    ]
    id_width = max([len(c.patch_id) for c in report.patches] or [0])
    ran = [c.patch_id for c in report.patches if c.probe_ok is not None]
    not_run = [c.patch_id for c in report.patches if c.probe_ok is None]
    for check in report.patches:
        lines.append(plaintext.patch_line(check.patch_id, check.verdict.value, "", id_width))
        lines += [_module_line("  ", module) for module in check.modules]
        summary = f": {check.probe_summary}" if check.probe_summary else ""
        state = "not run" if check.probe_ok is None else "ok" if check.probe_ok else "failed"
        if check.probe_ok is not None or summary:
            start = 2 if check.probe_ok is None else 8  # "probe not run" is dimmed whole
            lines.append(line(f"  probe {state}{summary}", 4, state, start, 8 + len(state)))
    lines += [_module_line("(--module) ", module) for module in report.extra]
    text = "probes ran: " + (", ".join(ran) or "none")
    lines.append(line(text + (f"; not run: {', '.join(not_run)}" if not_run else ""), 2))
    if report.report.interrupted:
        then = "run `k3patch apply` (or revert) first"
        lines.append(plaintext.interrupted(report.report.interrupted, then))
    pending = [c.patch_id for c in report.patches if c.verdict.value == "pending"]
    if report.ok:
        lines.append(line("verified", 2, "ok", 0, len("verified")))
    else:
        text = f"; {', '.join(pending)} pending: run `k3patch apply` first" if pending else ""
        lines.append(plaintext.error("verify found problems", text))
    emit(lines)


def progress_line(text: str) -> None:
    """Progress goes to stderr: stdout stays the report (or the JSON) alone."""
    emit([line(text, 4)], stderr=True)
