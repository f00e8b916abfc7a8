"""The vLLM plugin (entry point group `vllm.general_plugins`): a preflight in every vLLM process.

vLLM calls `preflight()` in the API server, the engine core and every worker. It checks, with the
no-op path's hash comparison (no libcst, no typer, no rich), that the vLLM tree this process
imports is in the state k3patch recorded, and that every patch there is applied, satisfied or not
applicable; and that the target modules already imported came from that tree. A worker started
from an image whose fix was lost (a rebuilt layer, a reinstalled wheel) is caught before serving.

K3PATCH_PREFLIGHT=off | warn (default) | fail. `fail` raises, which stops vLLM.
"""

from __future__ import annotations

import logging
import os
import sys

from k3patch import fastpath

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
    state_dir, pkg = tree.state, tree.package
    if not os.path.exists(os.path.join(state_dir, "state.json")):
        return f"no k3patch state record in {pkg}; run `k3patch apply` on this tree"
    record = fastpath.fresh_record(state_dir, pkg)
    if record is None:
        return (
            f"the vLLM files in {pkg} differ from what k3patch recorded (or k3patch changed); "
            "run `k3patch status` to see which"
        )
    bad = [
        fastpath.quiet_line(p["id"], record["results"])
        for p in record["patches"]
        if fastpath.summary_verdict(
            r["verdict"] for r in record["results"] if r["patch"] == p["id"]
        )
        in ("pending", "drifted")
    ]
    if bad:
        return "; ".join(bad)
    for rel in record["scan"]:
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
    problem = preflight_problem(package_dir)
    if problem is None:
        logger.debug("k3patch preflight: %s is in the applied state", package_dir)
        return
    if mode == "fail":
        raise PreflightError(f"k3patch preflight: {problem} ({ENV}=fail)")
    logger.warning("k3patch preflight: %s", problem)
