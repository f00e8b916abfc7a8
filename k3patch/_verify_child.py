"""Runs inside the tree's own interpreter for `k3patch verify` (standard library only: k3patch's
dependencies may be missing there): imports the modules it is given, runs each patch's probe, and
prints one JSON line after MARKER. argv[1] is the JSON object `verify` builds; with an "overlay"
({source path: path of the text to import instead}), those sources are imported from other text
(the originals, to tell "broken by the patch" from "blocked by the environment").
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import traceback
import types
from typing import Any

MARKER = "K3PATCH-VERIFY-RESULT "


class _OverlayLoader(importlib.abc.SourceLoader):
    """`path` imported from the text at `text_path`, never from a pyc (no path_stats)."""

    def __init__(self, path: str, text_path: str) -> None:
        self.path = path
        self.text_path = text_path

    def get_filename(self, fullname: str) -> str:
        return self.path

    def get_data(self, path: str) -> bytes:
        with open(self.text_path if path == self.path else path, "rb") as handle:
            return handle.read()


class _OverlayFinder(importlib.abc.MetaPathFinder):
    def __init__(self, overlay: dict[str, str]) -> None:
        self.overlay = {os.path.realpath(k): v for k, v in overlay.items()}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.origin is not None:
            text_path = self.overlay.get(os.path.realpath(spec.origin))
            if text_path is not None:
                spec.loader = _OverlayLoader(spec.origin, text_path)
        return spec


def _failure(exc: BaseException) -> dict[str, Any]:
    """What verify judges a failure by; `raised_in`: the real path of the file it was raised in
    (for a syntax error, the file that does not parse), "" when there is none."""
    files = [frame.filename for frame in traceback.extract_tb(exc.__traceback__)]
    if isinstance(exc, SyntaxError) and exc.filename:
        files.append(exc.filename)
    return {
        "type": type(exc).__name__,
        "message": str(exc).splitlines()[0][:500] if str(exc) else "",
        "raised_in": os.path.realpath(files[-1]) if files else "",
    }


def main() -> int:
    args = json.loads(sys.argv[1])
    if args.get("overlay"):
        sys.meta_path.insert(0, _OverlayFinder(args["overlay"]))
    out: dict[str, Any] = {"python": sys.version.split()[0], "imports": {}, "probes": {}}
    for name in args["modules"]:
        try:
            module = importlib.import_module(name)
            out["imports"][name] = {"ok": True, "file": getattr(module, "__file__", None)}
        except BaseException as exc:  # a module may raise anything, SystemExit included
            out["imports"][name] = {"ok": False, **_failure(exc)}
    if args.get("probes"):
        # k3patch and its patches as namespaces over their directories, without running
        # k3patch/__init__.py: a patch (a module or a folder) and the standard-library modules
        # of k3patch it uses import as they do in k3patch's own interpreter.
        for name, key in (("k3patch", "package_dir"), ("k3patch.patches", "patches_dir")):
            namespace = types.ModuleType(name)
            namespace.__path__ = [args[key]] if args.get(key) else []
            sys.modules.setdefault(name, namespace)
        needs = args.get("probe_modules", {})
        for patch_id in args["probes"]:
            if not all(out["imports"][m]["ok"] for m in needs.get(patch_id, [])):
                continue  # the parent reports "not run: its module did not import"
            try:
                module = importlib.import_module(args["patch_modules"][patch_id])
                outcome = module.PATCH.probe()
                if outcome is None:
                    continue
                out["probes"][patch_id] = {
                    "ok": bool(outcome.ok),
                    "summary": outcome.summary,
                    "checks": list(outcome.checks),
                }
            except BaseException as exc:
                out["probes"][patch_id] = {
                    "ok": False,
                    "error": _failure(exc),
                    "summary": f"probe raised {type(exc).__name__}: {exc}",
                }
    sys.stdout.flush()
    print("\n" + MARKER + json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
