"""The Typer CLI: a thin layer that parses options, calls the library and renders the result."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from k3patch.version import VERSION


class _FlagsWithoutTypes:
    """Help that shows no type for a flag: Typer 0.29 prints `<bool>` beside every flag (its own
    --help and completion options too), and a flag takes no value."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        params = list(getattr(self, "params", []))
        help_option = self.get_help_option(ctx)  # type: ignore[attr-defined]
        if help_option is not None:
            params.append(help_option)
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        super().format_help(ctx, formatter)  # type: ignore[misc]


# The exit code of the command that ran, recorded by the command itself (_Command.invoke) and
# read by k3patch's main (_Group.main): never what a library's callback or return path made of it.
# Typer 0.12.5 under click 8.3 ran an eager --version callback in place of every command and
# exited 0; a code that only k3patch writes cannot be replaced that way.
_recorded: list[int] = []


def _click_class(name: str) -> type[BaseException]:
    """The click exception class `name` that this typer raises: typer 0.15 uses the installed
    click, later typers a copy of their own, and both export `typer.BadParameter`."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == name)


# The options that each choose what a command prints: two at once is a usage error, never one
# of them silently dropped. --json carries every site and status's diff (its "diff" key), and
# apply's --diff is printed before any of its reports: none of these is a second form beside
# --json. The no-op path declines the same pairs (fastpath.parse).
_FORMS = {
    "status": ("--json", "--quiet", "--digest", "--sites", "--diff"),
    "apply": ("--json", "--quiet", "--sites"),
}


class _Command(_FlagsWithoutTypes, typer.core.TyperCommand):
    def invoke(self, ctx: Any) -> Any:
        """The body returns its exit code; any exception in it becomes a one-line error (and
        under --json the error envelope) and its documented code. The code is recorded for
        k3patch's main."""
        from k3patch.exitcodes import explain

        chosen = [
            opt
            for param in self.params
            for opt in param.opts
            if opt in _FORMS.get(ctx.info_name, ()) and ctx.params.get(param.name)
        ]
        if "--json" in chosen:
            chosen = [opt for opt in chosen if opt not in ("--sites", "--diff")]
        if len(chosen) > 1:
            raise _click_class("UsageError")(
                f"{chosen[0]} and {chosen[1]} choose two different outputs; give one", ctx
            )
        try:
            code = super().invoke(ctx)
        except KeyboardInterrupt:
            from k3patch import render

            render.error_line("interrupted", prefix="k3patch:")
            code = 130
        except Exception as exc:
            # Output never raises here (exitcodes.guarded): an OSError is the work's own.
            code = _fail(ctx.info_name, *explain(exc), ctx.params.get("as_json", False))
        _recorded.append(int(code))
        return code


class _Group(_FlagsWithoutTypes, typer.core.TyperGroup):
    def main(  # type: ignore[override]
        self,
        args: list[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        """k3patch's main: the exit code is the one the command recorded. Usage errors (an
        unknown option or patch id, a value that is not one) are one line on stderr with code
        2, and with --json also the error envelope on stdout; SIGINT is one line and 130. Click
        would print a usage block, or for SIGINT nothing at all."""
        argv = list(sys.argv[1:] if args is None else args)
        code = self.run(argv, prog_name or "k3patch", complete_var, **extra)
        if standalone_mode:
            sys.exit(code)
        return code

    def run(self, argv: list[str], prog_name: str, complete_var: Any, **extra: Any) -> int:
        """Parse and run `argv`; its exit code."""
        from k3patch.exitcodes import ExitCode

        if argv == ["--version"]:
            print(f"k3patch {VERSION}")
            return 0
        if argv[:1] == ["--version"]:  # never read as the command after it having run
            return _fail("k3patch", ExitCode.USAGE, "--version takes nothing after it", False)
        if not argv:  # a usage error: one line, as every other one
            return _fail("k3patch", ExitCode.USAGE, f"give a command: {self._names()}", False)
        if misread := [
            f"{name} {opt.opts[0]}"
            for name, command in self.commands.items()
            for opt in command.params
            if opt.metavar and getattr(opt, "is_flag", False)
        ]:
            # An option that takes a value (it has a metavar) made into a flag: typer 0.12 under
            # click 8.3 (pyproject.toml says why typer>=0.16.0); only an install that skipped
            # the dependencies gets here.
            from k3patch import render

            render.error_line(
                f"typer {_version('typer')} with click {_version('click')} reads {misread[0]} "
                "as a flag; install typer>=0.16.0 (pip install 'typer>=0.16.0')"
            )
            return 3
        _recorded.clear()
        try:
            returned = super().main(argv, prog_name, complete_var, standalone_mode=False, **extra)
        except Exception as exc:
            if isinstance(exc, _click_class("ClickException")):
                return _usage_error(argv, exc)
            if not any(c.__name__ == "Abort" for c in type(exc).__mro__):
                raise
            returned = 130  # SIGINT while parsing (typer 0.15)
        return _code(self, argv, returned)

    def _names(self) -> str:
        return f"{', '.join(self.commands)} (see `k3patch --help`)"

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        """An unknown command names the known ones (click points at `k3patch NAME --help`)."""
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            raise _click_class("UsageError")(
                f"no command {args[0]!r}; the commands are {self._names()}", ctx
            )
        return super().resolve_command(ctx, args)


def _code(group: _Group, argv: list[str], returned: Any) -> int:
    """The recorded code, or what the run ended with when no command body ran."""
    if _recorded:
        return _recorded[-1]
    if returned == 130:  # SIGINT before the command's body started
        from k3patch import render

        render.error_line("interrupted", prefix="k3patch:")
        return 130
    options = argv[: argv.index("--") if "--" in argv else len(argv)]
    named = next((a for a in options if a in group.commands), None)
    if named is not None and not {"--help", "-h"} & set(options):
        # A command was named, did not ask for help, and its body never ran: something in the
        # libraries below took the call (a callback, a parser that read it otherwise).
        from k3patch import render

        render.error_line(
            f"internal error: the {named} command did not run (typer {_version('typer')}, "
            f"click {_version('click')}); nothing was done"
        )
        return 2
    return returned if isinstance(returned, int) else 0  # --help, shell completion


def _version(dist: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _usage_error(argv: list[str], exc: Any) -> int:
    from k3patch.exitcodes import ExitCode

    command = next((a for a in argv if not a.startswith("-")), "k3patch")
    ctx = getattr(exc, "ctx", None)
    if ctx is not None:
        command = (ctx.info_name or command) if ctx.parent is not None else "k3patch"
    message = exc.format_message()
    if "(see `k3patch" not in message:
        message += f" (see `k3patch {command} --help`)".replace("k3patch k3patch", "k3patch")
    as_json = "--json" in argv[: argv.index("--") if "--" in argv else len(argv)]
    return _fail(command, ExitCode.USAGE, message, as_json)


def _fail(command: str, code: int, message: str, as_json: bool) -> int:
    """An error's one line on stderr, and under --json its envelope on stdout; its code."""
    from k3patch import render

    if as_json:
        render.emit_json(command, code, {"error": message})
    render.error_line(message)
    return code


app = typer.Typer(
    name="k3patch",
    cls=_Group,
    help=(
        "Apply, audit and revert the Kimi-K3 fixes in a vLLM tree.\n\n"
        "Exit codes: 0 ok; 1 attention (pending, drift, revert conflict); 2 usage or internal "
        "error; 3 environment (no vLLM, not writable, lock timeout).\n\n"
        "`k3patch --version` prints the version."
    ),
    # Click's own help layout on every typer: typer's rich help calls click in a way click 8.2
    # changed (typer 0.15 failed on `--help` under click 8.2+, pyproject.toml says more).
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

VllmOpt = Annotated[
    str | None,
    typer.Option(
        "--vllm",
        metavar="PATH",
        help="The vllm package dir, a source checkout holding vllm/, or a site-packages dir. "
        "Default: the vLLM of this interpreter (found without importing it).",
        show_default=False,
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Machine-readable output (schema_version 1).")
]
OnlyOpt = Annotated[
    list[str] | None,
    typer.Option("--only", metavar="ID", help="Only this patch (repeatable; see `k3patch list`)."),
]
SkipOpt = Annotated[
    list[str] | None, typer.Option("--skip", metavar="ID", help="Skip this patch (repeatable).")
]
SitesOpt = Annotated[
    bool,
    typer.Option(
        "--sites",
        help="Show every site (file, line, shape and reason), not only those that need a look.",
    ),
]


def _seconds(text: str | float) -> float:
    """--lock-timeout is checked where it is parsed, on every path: a tree with nothing to do
    never takes the lock, and must not accept what a tree with work refuses. One parser for the
    CLI and the no-op path (lock.parse_timeout), not each typer's own."""
    from k3patch.lock import parse_timeout

    try:
        return parse_timeout(text)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


LockOpt = Annotated[
    float,
    typer.Option(
        "--lock-timeout",
        metavar="SECONDS",
        help="How long to wait for another k3patch run on the same tree; then exit 3.",
        parser=_seconds,
    ),
]


@app.command("list", cls=_Command)
def list_(as_json: JsonOpt = False) -> int:
    """List the patches this k3patch carries."""
    from k3patch import plaintext, render
    from k3patch.registry import all_patches

    patches = [
        {"id": p.id, "title": p.title, "files": list(p.files), "caveat": p.caveat}
        for p in all_patches()
    ]
    if as_json:
        render.emit_json("list", 0, {"patches": patches})
    else:
        render.emit(plaintext.list_lines(patches))
    return 0


@app.command(
    "status",
    help=(
        "Report the verdict of every patch and site: pending, applied, satisfied, not "
        "applicable or drifted. Exits 1 when anything is pending or drifted.\n\n"
        "An explicit `--attention-backend ROCM_AITER_MLA` selects AITER MLA without asking "
        "`is_mla_enabled`, so aiter-mla-gfx942 cannot stop that choice."
    ),
    cls=_Command,
)
def status(
    vllm: VllmOpt = None,
    as_json: JsonOpt = False,
    only: OnlyOpt = None,
    skip: SkipOpt = None,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="One line per patch: its id and verdict.")
    ] = False,
    digest: Annotated[
        bool,
        typer.Option("--digest", help="Print only the digest, the line two nodes compare."),
    ] = False,
    sites: SitesOpt = False,
    diff: Annotated[
        bool,
        typer.Option(
            "--diff",
            help="Print the unified diff from the originals k3patch recorded to the files now.",
        ),
    ] = False,
    lock_timeout: LockOpt = 120.0,
) -> int:
    from k3patch import exitcodes, plaintext, render, scan
    from k3patch.changes import recorded_diff
    from k3patch.registry import select
    from k3patch.tree import locate

    tree = locate(vllm)
    # A journal of a live run is not an interrupted one: wait for that run, then look.
    report = scan.scan(tree, select(only, skip), wait_for_live=lock_timeout)
    code = exitcodes.for_status(report)
    if report.state_problem:
        render.error_line(report.state_problem)
    payload = report.to_json()  # the human report is made from it too
    if as_json:
        if diff and not report.state_problem:  # no diff from a record no revert could use
            payload["diff"] = recorded_diff(tree) or ""
        render.emit_json("status", code, payload)
    elif diff:
        if not report.state_problem:
            render.print_recorded_diff(recorded_diff(tree))
    elif digest:
        print(report.digest)
    elif quiet:
        render.emit(plaintext.quiet_lines(payload))
    else:
        render.emit(plaintext.status_lines(payload, every_site=sites))
    return code


@app.command(
    "apply",
    help=(
        "Apply every pending patch as one transaction. A drifted patch is refused (nothing of "
        "it is written, exit 1) and the other patches are still applied; --all-or-nothing "
        "writes nothing at all then."
    ),
    cls=_Command,
)
def apply(
    vllm: VllmOpt = None,
    as_json: JsonOpt = False,
    only: OnlyOpt = None,
    skip: SkipOpt = None,
    check: Annotated[
        bool, typer.Option("--check", help="Write nothing; exit 1 if anything would change.")
    ] = False,
    diff: Annotated[
        bool, typer.Option("--diff", help="Print the unified diff of this run's edits.")
    ] = False,
    quiet: Annotated[
        bool,
        typer.Option("--quiet", "-q", help="One line per patch, for entrypoint logs."),
    ] = False,
    all_or_nothing: Annotated[
        bool,
        typer.Option(
            "--all-or-nothing",
            help="Write nothing at all when any selected patch has drifted (by default the "
            "drifted patch is refused and the others are applied).",
        ),
    ] = False,
    lock_timeout: LockOpt = 120.0,
    sites: SitesOpt = False,
) -> int:
    from k3patch import engine, exitcodes, render
    from k3patch.registry import select
    from k3patch.tree import locate

    outcome = engine.apply(
        locate(vllm),
        select(only, skip),
        check=check,
        lock_timeout=lock_timeout,
        all_or_nothing=all_or_nothing,
    )
    code = exitcodes.for_apply(outcome)
    if as_json:
        payload = render.apply_payload(outcome)
        if diff:
            payload["diff"] = outcome.plan.diff() if outcome.plan is not None else ""
        render.emit_json("apply", code, payload)
    else:
        render.print_apply(outcome, quiet=quiet, diff=diff, every_site=sites)
    render.warning_lines(outcome.pycache)
    render.bug_line(outcome)
    return code


@app.command(
    "revert",
    help=(
        "Restore the original files k3patch recorded, byte for byte. When any of them changed "
        "since k3patch wrote it, nothing is written and it exits 1."
    ),
    cls=_Command,
)
def revert(vllm: VllmOpt = None, as_json: JsonOpt = False, lock_timeout: LockOpt = 120.0) -> int:
    from k3patch import engine, exitcodes, render
    from k3patch.tree import locate

    outcome = engine.revert(locate(vllm), lock_timeout=lock_timeout)
    code = exitcodes.for_revert(outcome)
    payload = {
        "restored": [f"vllm/{rel}" for rel in outcome.restored],
        "conflicts": outcome.conflicts,
        "nothing_recorded": outcome.nothing_recorded,
        "recovered": outcome.recovered,
        "bytecode": outcome.pycache,
    }
    if as_json:
        render.emit_json("revert", code, payload)
    else:
        render.print_revert(payload)
    render.warning_lines(outcome.pycache)
    return code


@app.command(
    "verify",
    help=(
        "Import the patched modules in a subprocess and run each patch's behaviour probe.\n\n"
        'It tells "broken by the patch" from "blocked by the environment" (no GPU, a missing '
        "optional dependency). Exits 1 when a patch is pending, drifted or broken, or its "
        "probe fails; 3 when nothing could be imported or no probe ran."
    ),
    cls=_Command,
)
def verify(
    vllm: VllmOpt = None,
    as_json: JsonOpt = False,
    only: OnlyOpt = None,
    skip: SkipOpt = None,
    python: Annotated[
        str | None,
        typer.Option(
            "--python",
            metavar="PATH",
            help="The interpreter to import with. Default: the one that owns the tree.",
        ),
    ] = None,
    module: Annotated[
        list[str] | None,
        typer.Option("--module", metavar="MODULE", help="Also import this module (repeatable)."),
    ] = None,
) -> int:
    from k3patch import exitcodes, render
    from k3patch.registry import select
    from k3patch.tree import locate
    from k3patch.verify import verify as run_verify

    report = run_verify(
        locate(vllm),
        select(only, skip),
        python=python,
        extra_modules=tuple(module or ()),
        progress=render.progress_line,
    )
    code = exitcodes.for_verify(report)
    if as_json:
        render.emit_json("verify", code, {**report.report.to_json(), "verify": report.to_json()})
    else:
        render.print_verify(report)
    return code
