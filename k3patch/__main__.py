"""`python -m k3patch` and the `k3patch` console script: the no-op path (a fresh state record)
is tried before typer, rich or libcst is imported; what it does not serve goes to the full CLI."""

from __future__ import annotations

import os
import sys


def main() -> None:
    # Every path's exit code survives whatever happens to stdout and stderr (exitcodes.guarded).
    from k3patch.exitcodes import guarded

    guarded(_main)


def _main() -> None:
    if sys.argv[1:] == ["--version"]:
        # Entrypoints log it on every start: not worth importing typer (150-200 ms) for.
        from k3patch.version import VERSION

        print(f"k3patch {VERSION}")
        sys.exit(0)
    # K3PATCH_NO_FASTPATH=1 always runs the full path (to compare the two, or to rule it out).
    if not os.environ.get("K3PATCH_NO_FASTPATH"):
        from k3patch.fastpath import try_fast

        try:
            code = try_fast(sys.argv[1:])
        except Exception:
            # The shortcut must never be the thing that fails: the full path decides and reports
            # (its own errors, a lock timeout say, come back as codes).
            if os.environ.get("K3PATCH_DEBUG"):
                import traceback

                traceback.print_exc()
            code = None
        if code is not None:
            sys.exit(code)
    from k3patch.cli import app

    app(prog_name="k3patch")


if __name__ == "__main__":
    main()
