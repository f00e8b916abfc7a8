"""The one place where outcomes become exit codes. The README's table is this file."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from typing import TYPE_CHECKING

from k3patch import plaintext
from k3patch.errors import (
    BadLockTimeout,
    ConcurrentChange,
    EnvironmentProblem,
    PatchBug,
    TreeError,
    UnknownPatchError,
    VerifyError,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from typing import Any, NoReturn

    from k3patch.engine import ApplyOutcome, RevertOutcome
    from k3patch.scan import Report
    from k3patch.verify import VerifyReport


class ExitCode:
    OK = 0  # every selected patch is applied, satisfied or not applicable
    ATTENTION = 1  # something needs a person: pending (status, --check), drift, revert conflict
    USAGE = 2  # bad arguments or a path that is not a vLLM tree; also k3patch's own bugs
    ENVIRONMENT = 3  # no vLLM found, not writable, disk full, lock timeout, bad --python


class Stream:
    """stdout or stderr as the commands see it: a write or flush that fails (a closed pipe, a
    full disk, a closed descriptor) never raises. The first failure is kept, later output is
    dropped, and the descriptor is pointed at /dev/null so the interpreter's own flush at exit
    cannot fail again; `guarded` then says so in one line and exits with the command's code."""

    def __init__(self, stream: Any, fd: int) -> None:
        self._stream = stream  # None: the descriptor was closed when k3patch started
        self._fd = fd
        self.failed: OSError | None = None
        self.wrote = False
        self.encoding = getattr(stream, "encoding", None) or "utf-8"
        self.errors = getattr(stream, "errors", None) or "strict"

    def write(self, text: str) -> int:
        if self.failed is None:
            self.wrote = self.wrote or bool(text)
            try:
                if self._stream is None:
                    raise OSError(9, f"{'stdout' if self._fd == 1 else 'stderr'} is closed")
                try:
                    self._stream.write(text)
                except UnicodeEncodeError:
                    # An ASCII stream (PYTHONIOENCODING=ascii): the report with `?` for what it
                    # cannot encode, never no report at all.
                    self._stream.write(text.encode(self.encoding, "replace").decode(self.encoding))
            except (OSError, ValueError) as exc:
                self._fail(exc)
        return len(text)

    def flush(self) -> None:
        if self.failed is None and self._stream is not None:
            try:
                self._stream.flush()
            except (OSError, ValueError) as exc:
                self._fail(exc)

    def isatty(self) -> bool:
        try:
            return self.failed is None and self._stream is not None and self._stream.isatty()
        except (OSError, ValueError):
            return False

    def fileno(self) -> int:
        return self._fd

    def writable(self) -> bool:
        return True

    def _fail(self, exc: OSError | ValueError) -> None:
        self.failed = exc if isinstance(exc, OSError) else OSError(9, str(exc))
        with contextlib.suppress(OSError):
            _to_devnull(self._fd)


def _to_devnull(fd: int) -> None:
    got = os.open(os.devnull, os.O_RDWR)
    if got != fd:
        os.dup2(got, fd)
        os.close(got)


def _open_standard_fds() -> None:
    """A descriptor 0, 1 or 2 closed at start (`>&-`) is opened on /dev/null: otherwise the next
    file k3patch opens (a target, the record) would be given that number, and anything written
    to "stdout" would land in it."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            _to_devnull(fd)


def guarded(run: Callable[[], object]) -> NoReturn:
    """Run the whole program so that its exit code never depends on what happens to its output:
    what is not written leaves the code as it was and at most one line on stderr (none for a
    closed pipe: `| head -1` is normal); SIGINT is one line and 130; an error outside any
    command (start-up, the no-op path) is one line and its documented code."""
    _open_standard_fds()
    out, err = Stream(sys.stdout, 1), Stream(sys.stderr, 2)
    sys.stdout, sys.stderr = out, err  # type: ignore[assignment]
    try:
        run()
        code = ExitCode.OK
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or ExitCode.OK
        else:  # a message (sys.exit("...")): one line, a usage error
            err.write(plaintext.error_text(str(exc.code)))
            code = ExitCode.USAGE
    except KeyboardInterrupt:
        err.write("k3patch: interrupted\n")
        code = 130
    except Exception as exc:
        code, message = explain(exc)
        err.write(plaintext.error_text(message))
    out.flush()
    if out.failed is not None and out.failed.errno != errno.EPIPE and not err.wrote:
        err.write(
            f"k3patch: could not write the output ({out.failed.strerror or out.failed}); the "
            "command itself completed, see its exit code\n"
        )
    err.flush()
    sys.exit(code)


def code_for_verdicts(verdicts: Iterable[str], *, interrupted: bool) -> int:
    """Site verdicts (their string values) -> the code of a reporting command."""
    if interrupted or any(v in ("pending", "drifted") for v in verdicts):
        return ExitCode.ATTENTION
    return ExitCode.OK


def for_status(report: Report) -> int:
    if report.state_problem:  # k3patch's own state unreadable: apply could not run here
        return ExitCode.ENVIRONMENT
    verdicts = [r.verdict.value for r in report.results]
    return code_for_verdicts(verdicts, interrupted=report.interrupted is not None)


def for_apply(outcome: ApplyOutcome) -> int:
    # Pending after a real apply cannot happen (the plan re-checks); under --check it means
    # "would change". Drift is refused, and an interrupted journal needs a real run. A patch
    # whose rewrite failed its own checks is k3patch's bug: that outweighs everything else.
    if outcome.bugs:
        return ExitCode.USAGE
    return ExitCode.ATTENTION if outcome.refused else for_status(outcome.report)


def for_revert(outcome: RevertOutcome) -> int:
    return ExitCode.ATTENTION if outcome.conflicts else ExitCode.OK


def for_verify(report: VerifyReport) -> int:
    return ExitCode.OK if report.ok else ExitCode.ATTENTION


def explain(exc: Exception) -> tuple[int, str]:
    """An error's documented code and one-line message: what to do, for the errors k3patch
    expects; anything else is an internal error (a k3patch bug), never drift (ATTENTION). Under
    K3PATCH_DEBUG an internal error prints its traceback first, for whoever debugs k3patch."""
    if isinstance(exc, TreeError):
        return (ExitCode.USAGE if exc.usage else ExitCode.ENVIRONMENT), str(exc)
    # An OSError that reached here (the tree's own files, not k3patch's logic) is the
    # environment's: a permission, a full disk, a path that is not what it should be.
    if isinstance(exc, OSError):
        return ExitCode.ENVIRONMENT, f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": ")
    if isinstance(exc, EnvironmentProblem | ConcurrentChange | VerifyError):
        return ExitCode.ENVIRONMENT, str(exc)
    if isinstance(exc, UnknownPatchError | BadLockTimeout):
        return ExitCode.USAGE, str(exc)
    if isinstance(exc, PatchBug):
        message = f"internal error (a k3patch bug, nothing was written): {exc}"
    else:
        message = f"internal error: {type(exc).__name__}: {exc}"
    if os.environ.get("K3PATCH_DEBUG"):
        import traceback

        traceback.print_exc()
    return ExitCode.USAGE, message
