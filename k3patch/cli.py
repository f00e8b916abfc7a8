"""The Typer CLI: a thin layer that parses options, calls the library and renders the result."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Annotated, Any

import typer

from k3patch import __version__

app = typer.Typer(
    name="k3patch",
    help=(
        "Apply, audit and revert the Kimi-K3 fixes in a vLLM tree. Exit codes: 0 ok, "
        "1 attention (pending, drift, revert conflict), 2 usage or internal error, "
        "3 environment (no vLLM, not writable, lock timeout)."
    ),
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)

VllmOpt = Annotated[
    str | None,
    typer.Option(
        "--vllm",
        help="The vllm package dir, a source checkout holding vllm/, or a site-packages dir. "
        "Default: the vLLM of this interpreter (found without importing it).",
        show_default=False,
    ),
]
JsonOpt = Annotated[
    bool, typer.Option("--json", help="Machine-readable output (schema_version 1).")
]
OnlyOpt = Annotated[
    list[str] | None, typer.Option("--only", help="Only this patch id (repeatable).")
]
SkipOpt = Annotated[
    list[str] | None, typer.Option("--skip", help="Skip this patch id (repeatable).")
]
SitesOpt = Annotated[
    bool,
    typer.Option(
        "--sites",
        help="Show every site (file, line, shape and reason), not only those that need a look.",
    ),
]
LockOpt = Annotated[
    float, typer.Option("--lock-timeout", help="Seconds to wait for another run's lock.")
]


def _guarded(command: str, as_json: bool, body: Callable[[], int]) -> None:
    """Run a command body; every exception becomes a one-line error and its documented code."""
    from k3patch import render
    from k3patch.exitcodes import describe, for_exception

    try:
        code = body()
    except (typer.Exit, typer.Abort, KeyboardInterrupt):
        raise
    except Exception as exc:
        if os.environ.get("K3PATCH_DEBUG"):
            raise
        code = int(for_exception(exc))
        message = describe(exc)
        if as_json:
            render.emit_json(command, code, {"error": message})
        else:
            render.error_line(message)
    raise typer.Exit(code)


def _tree(vllm: str | None) -> Any:
    from k3patch.tree import locate

    return locate(vllm)


@app.command("list")
def list_(as_json: JsonOpt = False) -> None:
    """List the patches this k3patch carries."""

    def body() -> int:
        from k3patch import render
        from k3patch.registry import all_patches

        patches = all_patches()
        if as_json:
            render.emit_json(
                "list",
                0,
                {
                    "patches": [
                        {"id": p.id, "title": p.title, "files": list(p.files), "caveat": p.caveat}
                        for p in patches
                    ]
                },
            )
        else:
            render.print_list(patches)
        return 0

    _guarded("list", as_json, body)


@app.command()
def status(
    vllm: VllmOpt = None,
    as_json: JsonOpt = False,
    only: OnlyOpt = None,
    skip: SkipOpt = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="One line per patch.")] = False,
    digest: Annotated[bool, typer.Option("--digest", help="Print only the state digest.")] = False,
    sites: SitesOpt = False,
) -> None:
    """Report every site's verdict: pending, applied, satisfied, not applicable or drifted.

    Exits 1 when anything is pending or drifted. Note: an explicit
    `--attention-backend ROCM_AITER_MLA` bypasses `is_mla_enabled`; aiter-mla-gfx942 cannot
    stop that choice.
    """

    def body() -> int:
        from k3patch import engine, exitcodes, render
        from k3patch.registry import select

        report = engine.scan(_tree(vllm), select(only, skip))
        code = int(exitcodes.for_status(report))
        if as_json:
            render.emit_json("status", code, report.to_json())
        elif digest:
            print(report.digest)
        else:
            render.print_status(report, quiet=quiet, every_site=sites)
        return code

    _guarded("status", as_json, body)


@app.command()
def apply(
    vllm: VllmOpt = None,
    as_json: JsonOpt = False,
    only: OnlyOpt = None,
    skip: SkipOpt = None,
    check: Annotated[
        bool, typer.Option("--check", help="Write nothing; exit 1 if anything would change.")
    ] = False,
    diff: Annotated[
        bool, typer.Option("--diff", help="Print the unified diff of the edits.")
    ] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="One line per patch (for entrypoints).")
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
) -> None:
    """Apply every pending patch as one transaction. A drifted patch is refused (nothing of it
    is written, exit 1) and the other patches are still applied."""

    def body() -> int:
        from k3patch import engine, exitcodes, fastpath, render
        from k3patch.registry import select

        outcome = engine.apply(
            _tree(vllm),
            select(only, skip),
            check=check,
            lock_timeout=lock_timeout,
            all_or_nothing=all_or_nothing,
        )
        code = int(exitcodes.for_apply(outcome))
        if as_json:
            payload = fastpath.apply_payload(outcome)
            if diff and outcome.plan is not None:
                payload["diff"] = outcome.plan.diff()
            render.emit_json("apply", code, payload)
        else:
            render.print_apply(outcome, quiet=quiet, diff=diff, every_site=sites)
        return code

    _guarded("apply", as_json, body)


@app.command()
def revert(vllm: VllmOpt = None, as_json: JsonOpt = False, lock_timeout: LockOpt = 120.0) -> None:
    """Restore the original files k3patch recorded, byte for byte. Refuses, writing nothing,
    when any of them changed since k3patch wrote it."""

    def body() -> int:
        from k3patch import engine, exitcodes, render

        outcome = engine.revert(_tree(vllm), lock_timeout=lock_timeout)
        code = int(exitcodes.for_revert(outcome))
        if as_json:
            render.emit_json(
                "revert",
                code,
                {
                    "restored": [f"vllm/{rel}" for rel in outcome.restored],
                    "conflicts": outcome.conflicts,
                    "nothing_recorded": outcome.nothing_recorded,
                    "recovered": outcome.recovered,
                    "bytecode": outcome.pycache,
                },
            )
        else:
            render.print_revert(outcome)
        return code

    _guarded("revert", as_json, body)


@app.command()
def verify(
    vllm: VllmOpt = None,
    as_json: JsonOpt = False,
    only: OnlyOpt = None,
    skip: SkipOpt = None,
    python: Annotated[
        str | None,
        typer.Option("--python", help="Interpreter to import with (default: the tree's own)."),
    ] = None,
    module: Annotated[
        list[str] | None, typer.Option("--module", help="Also import this module (repeatable).")
    ] = None,
) -> None:
    """Import the patched modules in a subprocess and run each patch's behaviour probe.

    Tells "broken by the patch" from "blocked by the environment" (no GPU, missing optional
    dependency). Exits 1 when a patch is pending, drifted, broken, or its probe fails.
    """

    def body() -> int:
        from k3patch import exitcodes, render
        from k3patch.registry import select
        from k3patch.verify import verify as run_verify

        report = run_verify(
            _tree(vllm), select(only, skip), python=python, extra_modules=tuple(module or ())
        )
        code = int(exitcodes.for_verify(report))
        if as_json:
            payload = report.report.to_json()
            payload.update(verify=report.to_json())
            render.emit_json("verify", code, payload)
        else:
            render.print_verify(report)
        return code

    _guarded("verify", as_json, body)


def version_callback(value: bool) -> None:
    if value:
        print(f"k3patch {__version__}")
        raise typer.Exit(0)


@app.callback()
def main_options(
    version: Annotated[
        bool,
        typer.Option("--version", callback=version_callback, is_eager=True, help="Show version."),
    ] = False,
) -> None:
    """k3patch: the dependable way to fix a vLLM tree in place."""
