"""kda-gather-diagnostic's probe, in the verify child (torch, no GPU): the static check reads the
imported gather_initial_states and the callers' files (kimi_k3 needs its GPU stack to import)."""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import k3patch.probekit as probekit
from k3patch.astkit import find_def, find_function
from k3patch.patch import ProbeOutcome
from k3patch.probekit import Checks, Swap, TorchTrace

from .sites import OPS_FILE, OPS_MODULE, SITES
from .syncs import ENV, SYNC_TORCH_FUNCTIONS, ungated_sync_points

# The variable operators set, named here in full rather than taken from the patch's own ENV:
# a patch whose constant changes must fail the runs below.
LOG_VARIABLE = "K3_KDA_GATHER_LOG"


def probe_no_sync_unless_asked() -> ProbeOutcome:
    checks = Checks(f"no sync reachable with {ENV} unset")
    package = probekit.package_dir("vllm")
    ops_func: Callable[..., Any] | None = None
    ops_ast: ast.FunctionDef | None = None
    try:
        ops_func = inspect.unwrap(importlib.import_module(OPS_MODULE).gather_initial_states)
        parsed = ast.parse(textwrap.dedent(inspect.getsource(ops_func)))
        ops_ast = find_function(parsed, "gather_initial_states")
    except Exception as exc:  # verify judges the import itself; fall back to the file
        checks.note(f"gather_initial_states did not import ({type(exc).__name__}: {exc})")
    for site in SITES:
        func, how = None, ""
        if site.file == OPS_FILE and ops_ast is not None:
            func, how = ops_ast, "source of the imported function"
        elif package is not None and (package / site.file).is_file():
            tree = ast.parse((package / site.file).read_text(encoding="utf-8"))
            func, how = find_def(tree, site.name), "read from its file"
        if func is None:
            checks.note(f"{site.name}: absent, nothing to check")
            continue
        gated, ungated = ungated_sync_points(func)
        counts = f"{len(gated)} sync-capable call(s) under the {ENV} gate, {len(ungated)} outside"
        reachable = f"; reachable with {ENV} unset: " + ", ".join(ungated) if ungated else ""
        checks.check(f"{site.name} (static, {how})", not ungated, counts + reachable)
    how = "only: gather_initial_states did not import"
    if ops_func is not None and ops_ast is not None:
        _run_gather(ops_func, ops_ast, checks)
        how = "and a traced CPU run of gather_initial_states"
    checks.what += f" (decided by the AST of every site {how})"
    return checks.outcome(holds=checks.what)


# Torch calls that read device memory on the host (the AST's, and what bool(), int(), f"{t}" call)
# and the aten ops below them.
_CASTS = {"__bool__", "__int__", "__float__", "__index__", "__repr__", "__format__"}
_SYNC_OPS = SYNC_TORCH_FUNCTIONS | _CASTS
_SYNC_ATEN = ("_local_scalar_dense", "nonzero", "masked_select")


def _run_gather(func: Callable[..., Any], func_ast: ast.FunctionDef, checks: Checks) -> None:
    """The real function on device-looking CPU tensors, its Triton launch a host gather, traced."""
    import torch

    trace = TorchTrace()
    reached: list[bool] = []  # whether an out-of-range index reached the stubbed kernel

    def launch(*args: Any, **kwargs: Any) -> None:
        with trace.paused():  # the stubbed kernel's own host work is not the function's
            src, slots, valid, out = (t.as_subclass(torch.Tensor) for t in args[:4])
            rows, n = slots.to(torch.int64), src.shape[0]
            reached.append(bool(((rows < 0) | (rows >= n))[valid].any()))
            picked = src.reshape(n, -1)[rows.clamp(0, n - 1)].reshape(out.shape)
            mask = valid.reshape(-1, *([1] * (out.ndim - 1)))
            out.copy_(torch.where(mask, picked, torch.zeros_like(picked)))

    def synced(name: str, args: tuple[Any, ...]) -> str | None:
        if name in _SYNC_OPS:
            return name
        items = args[1] if len(args) > 1 and isinstance(args[1], tuple) else args[1:2]
        masked = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)
        return "boolean-mask indexing" if masked and name in ("__getitem__", "index") else None

    module = sys.modules[func.__module__]
    pool = 6
    state = torch.arange(pool * 2 * 3, dtype=torch.float32).reshape(pool, 2, 3)
    has = torch.tensor([True, True, False, True])
    # Indices inside, below and above the pool, each with the variable unset, "1" and "0".
    layouts = [("indices in range", [0, 5, 3, 2])]
    if "_safe_idx" in {n.id for n in ast.walk(func_ast) if isinstance(n, ast.Name)}:
        # Only the fork's guard clamps; upstream's kernel must never see a bad index.
        layouts += [
            ("index 9 of a pool of 6", [0, 9, 3, 2]),
            ("index -1", [0, -1, 3, 2]),
            ("indices -7 and 6 of a pool of 6", [-7, 5, 3, 6]),
            ("index -3 where no initial state is read", [0, 5, -3, 2]),
        ]
    cases = [(label, slots, env) for label, slots in layouts for env in (None, "1", "0")]
    with Swap() as swap:
        for name, value in probekit.triton_on_host(func_ast, vars(module), launch).items():
            swap.attr(module, name, value)
        # verify runs with VLLM_LOGGING_LEVEL=ERROR; the diagnostic logs at WARNING.
        logged = swap.log(module.__name__, logging.WARNING)
        for label, slots, env in cases:
            swap.env(LOG_VARIABLE, env)
            del reached[:], logged[:]
            indices = torch.tensor(slots, dtype=torch.int32)
            with trace:  # gather_initial_states asserts device tensors
                out = func(*probekit.cuda_looking(state, indices, has))
            rows = torch.tensor(slots).clamp(0, pool - 1)
            expected = torch.where(has[:, None, None], state[rows], torch.zeros(2, 3))
            right = torch.equal(out.as_subclass(torch.Tensor), expected)
            found = [s for name, args in trace.calls if (s := synced(name, args))]
            found += [op for op in trace.aten if any(s in op for s in _SYNC_ATEN)]
            ops = ", ".join(found) or "none"
            problems = [] if right else ["the gathered rows are wrong"]
            if any(reached):
                problems.append("an out-of-range index reached the kernel")
            if env is None and found:
                problems.append(f"sync-capable ops ran: {ops}")
            bad = [i for i in slots if not 0 <= i < pool]
            messages = " ".join(r.getMessage() for r in logged)
            if env == "1" and bad and not all(str(i) in messages for i in bad):
                problems.append(f"the diagnostic did not log the out-of-range indices {bad}")
            if env != "1" and logged:
                problems.append(f"{len(logged)} warning(s) logged without {LOG_VARIABLE}=1")
            case = (
                f"gather_initial_states (traced CPU run, {LOG_VARIABLE}={env or 'unset'}, {label})"
            )
            seen = f"sync-capable ops: {ops}; {len(logged)} warning(s); rows "
            seen += "right" if right else "WRONG"
            checks.check(case, not problems, "; ".join([seen, *problems]))
