"""The one place where outcomes become exit codes. The README's table is this file."""

from __future__ import annotations

from k3patch.errors import (
    BadLockTimeout,
    ConcurrentChange,
    EnvironmentProblem,
    PatchBug,
    TreeError,
    UnknownPatchError,
    VerifyError,
)

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing (start-up cost)

if TYPE_CHECKING:
    from collections.abc import Iterable

    from k3patch.engine import ApplyOutcome, Report, RevertOutcome
    from k3patch.verify import VerifyReport


class ExitCode:
    """The documented codes, plain ints: the no-op path decides with them and must not pay
    for `enum` (with `functools` and `collections`, 2-6 ms of every rank's start-up)."""

    OK = 0  # every selected patch is applied, satisfied or not applicable
    ATTENTION = 1  # something needs a person: pending (status, --check), drift, revert conflict
    USAGE = 2  # bad arguments or a path that is not a vLLM tree; also k3patch's own bugs
    ENVIRONMENT = 3  # no vLLM found, not writable, disk full, lock timeout, bad --python


# The code of the outcome a command reached, once it reached one: output that fails after it
# (a closed pipe, a full disk behind stdout) keeps this code, since the work is done.
decided: list[int] = []


def _decide(code: int) -> int:
    decided.append(int(code))
    return code


def output_failed(exc: OSError) -> int:
    """Writing the result failed after the command did its work: keep the work's code. A closed
    pipe (`| head -1`) is quiet; anything else says so on stderr, never "nothing written"."""
    import errno
    import os
    import sys

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the exit-time flush cannot fail again
        os.close(devnull)
    except (OSError, ValueError):
        pass
    if exc.errno != errno.EPIPE:
        try:
            sys.stderr.write(
                f"k3patch: could not write the output ({exc.strerror or exc}); the command "
                "itself completed, see its exit code\n"
            )
            sys.stderr.flush()
        except OSError:
            pass
    return decided[-1]


def code_for_verdicts(verdicts: Iterable[str], *, interrupted: bool) -> int:
    """Site verdicts (their string values) -> the code of a reporting command."""
    if interrupted or any(v in ("pending", "drifted") for v in verdicts):
        return ExitCode.ATTENTION
    return ExitCode.OK


def for_status(report: Report) -> int:
    verdicts = [r.verdict.value for r in report.results]
    return _decide(code_for_verdicts(verdicts, interrupted=report.interrupted is not None))


def for_apply(outcome: ApplyOutcome) -> int:
    # Pending after a real apply cannot happen (the plan re-checks); under --check it means
    # "would change". Drift is refused, and an interrupted journal needs a real run. A patch
    # whose rewrite failed its own checks is k3patch's bug: that outweighs everything else.
    if outcome.bugs:
        return _decide(ExitCode.USAGE)
    return _decide(ExitCode.ATTENTION if outcome.refused else for_status(outcome.report))


def for_revert(outcome: RevertOutcome) -> int:
    return _decide(ExitCode.ATTENTION if outcome.conflicts else ExitCode.OK)


def for_verify(report: VerifyReport) -> int:
    return _decide(ExitCode.OK if report.ok else ExitCode.ATTENTION)


def for_exception(exc: BaseException) -> int:
    """Errors raised below the CLI. Anything not listed is an internal error: it must never
    read as drift (ATTENTION)."""
    if isinstance(exc, BadLockTimeout):
        return ExitCode.USAGE
    if isinstance(exc, TreeError):
        return ExitCode.USAGE if exc.usage else ExitCode.ENVIRONMENT
    if isinstance(exc, UnknownPatchError):
        return ExitCode.USAGE
    # An OSError that reached here (the tree's own files, not k3patch's logic) is the
    # environment's: a permission, a full disk, a path that is not what it should be.
    if isinstance(exc, EnvironmentProblem | ConcurrentChange | VerifyError | OSError):
        return ExitCode.ENVIRONMENT
    if isinstance(exc, PatchBug):
        return ExitCode.USAGE
    return ExitCode.USAGE


def describe(exc: BaseException) -> str:
    """The one-line message for an error raised below the CLI. Errors k3patch expects say what
    to do; anything else is named an internal error, never drift."""
    if isinstance(exc, PatchBug):
        return f"internal error (a k3patch bug, nothing was written): {exc}"
    if isinstance(exc, OSError) and not isinstance(exc, BadLockTimeout):
        return f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": ")
    if for_exception(exc) != ExitCode.USAGE or isinstance(
        exc, TreeError | UnknownPatchError | BadLockTimeout
    ):
        return str(exc)
    return f"internal error: {type(exc).__name__}: {exc}"
