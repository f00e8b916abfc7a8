"""The vLLM plugin (`vllm.general_plugins`): in every vLLM process, is the tree it imports in the
state k3patch recorded (the no-op path's question: no libcst, typer, rich or patch module), and
did the target modules come from it? Catches a worker whose fix was lost before it serves.

K3PATCH_PREFLIGHT=off | warn (default) | fail. `off` and `warn` never raise and never block,
whatever is on disk: vLLM's plugin loader does not catch, so an error here would stop every
vLLM process: every check is bounded (regular files only, opened non-blocking) and an unexpected
failure becomes one warning. `fail` raises one PreflightError, which stops vLLM."""

from __future__ import annotations

import logging
import os
import sys

from k3patch import formats, state, verdicts

ENV = "K3PATCH_PREFLIGHT"
_MODES = ("off", "warn", "fail")


class PreflightError(RuntimeError):
    pass


def preflight_problem(package_dir: str) -> str | None:
    """Why the tree at `package_dir` is not in a known good state, or None when it is."""
    from k3patch.tree import TreeError, locate

    try:
        tree = locate(package_dir)
    except TreeError as exc:
        return str(exc)
    pkg = tree.package
    record, kind, why = state.check_record(pkg)
    if record is None:  # state.check_record's kind says why the record does not vouch
        see = "run `k3patch status` to see which"
        lines = {
            # apply records nothing when a site drifted, so "run apply" would send the operator in
            # a circle: status says which it is.
            "absent": f"no k3patch state record in {pkg}: the fixes were never applied here, or a "
            f"site drifted; {see}",
            "stale": f"the vLLM files in {pkg} differ from what k3patch recorded (or k3patch "
            f"changed); {see}",
            # Never "the files differ" for a bad record: the files may be fine, the record is not.
            "damaged": f"record damaged: {why}",
            "other schema": f"record of another schema: {why}",
            "unreadable": f"the k3patch state in {pkg} cannot be read by this process: {why}",
        }
        return lines.get(kind, f"{why} in {pkg}; {see}")
    results = [r.to_json() for r in record.results]
    bad = [
        formats.quiet_line(p["id"], results)
        for p in record.patches
        if verdicts.summary(r["verdict"] for r in results if r["patch"] == p["id"])
        in ("pending", "drifted")
    ]
    if bad:
        return "; ".join(bad)
    for rel in sorted(state.registered_targets()):
        name = "vllm." + rel[: -len(".py")].replace("/", ".")
        module = sys.modules.get(name)
        loaded = getattr(module, "__file__", None)
        if loaded and os.path.realpath(loaded) != os.path.realpath(os.path.join(pkg, rel)):
            return f"{name} was imported from {loaded}, not from the checked tree {pkg}"
    return None


def preflight() -> None:
    mode = os.environ.get(ENV, "warn").strip().lower() or "warn"
    logger = logging.getLogger("vllm.k3patch")
    if mode not in _MODES:
        logger.warning("k3patch preflight: %s=%r is not one of %s; using warn", ENV, mode, _MODES)
        mode = "warn"
    if mode == "off":
        return
    vllm = sys.modules.get("vllm")
    package_dir = os.path.dirname(getattr(vllm, "__file__", None) or "")
    if not package_dir:
        return
    try:
        problem = preflight_problem(package_dir)
    except Exception as exc:  # never let an odd tree stop vLLM in warn mode
        problem = f"could not check {package_dir}: {type(exc).__name__}: {exc}"
    if problem is None:
        logger.debug("k3patch preflight: %s is in the applied state", package_dir)
        return
    if mode == "fail":
        raise PreflightError(f"k3patch preflight: {problem} ({ENV}=fail)")
    logger.warning("k3patch preflight: %s", problem)
