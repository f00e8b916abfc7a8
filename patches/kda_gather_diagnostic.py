"""kda-gather-diagnostic: the KDA state-index diagnostic syncs the GPU only when asked to.

Symptom: a long prompt looks hung. At a 750K-token prompt the prefill issues about 25,000 full
GPU stream drains, one per KDA layer per prefill chunk; above about 500K tokens nothing seems
to move.
Cause: the Kimi-K3 fork's "k3-kda guard" in `gather_initial_states` clamps the KDA state indices
on the device (sync-free), then runs `if bool((indices >= n).any()) or bool((indices < 0).any()):`
only to log a warning. Each `bool()` copies a flag to the host, so the CPU waits for every kernel
queued before it and cannot launch the next layer's work in the meantime. Some fork builds inline
the same diagnostic in the callers (`chunk_kda_prefill`, `KimiK3DeltaAttention._forward`).
Fix: the diagnostic `if` is nested under `if os.environ.get("K3_KDA_GATHER_LOG", "0") == "1":`,
a host-only test that runs before any tensor is touched; `import os` is added to the module when
it lacks one. The clamp and `indices = _safe_idx` stay exactly as they were, so the kernel still
never sees an out-of-range index.
Check: `k3patch verify` reads the patched functions' AST and requires every call that can sync
(`bool()`/`int()` of a tensor, `.item()`, `.tolist()`, `.cpu()`, `nonzero`, boolean-mask
indexing, ...) to sit inside the gate; then it runs `gather_initial_states` on CPU tensors with
the Triton launch stubbed and a torch function/dispatch trace: no sync-capable op with the
variable unset, the out-of-range index logged with `K3_KDA_GATHER_LOG=1`, the clamped rows
gathered either way. Upstream vLLM has no clamp and no diagnostic (its kernel masks on device):
not applicable.
"""

from __future__ import annotations

import ast
import copy
import importlib
import importlib.util
import inspect
import io
import logging
import os
import sys
import textwrap
import tokenize
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3patch.model import (
    Patch,
    ProbeOutcome,
    Shape,
    SiteResult,
    SourceFile,
    Sources,
    Verdict,
    find_class,
    find_function,
    find_method,
    site_fingerprint,
    summarise,
)

ENV = "K3_KDA_GATHER_LOG"
OPS_FILE = "model_executor/layers/mamba/ops/gather_initial_states.py"
OPS_MODULE = "vllm.model_executor.layers.mamba.ops.gather_initial_states"
PREFILL_FILE = "models/kimi_k3/amd/ops/kda_prefill.py"
KDA_FILE = "models/kimi_k3/amd/kda.py"


@dataclass(frozen=True)
class Site:
    """A function that holds (or, in some fork build, may hold) the diagnostic."""

    name: str
    file: str
    cls: str | None
    func: str
    # In gather_initial_states the diagnostic sits inside the fork's guard, between the clamp
    # and `indices = _safe_idx`; the guard must be intact for any verdict but not applicable.
    guarded: bool
    absent: str
    clean: str


SITES = (
    Site(
        "gather_initial_states",
        OPS_FILE,
        None,
        "gather_initial_states",
        True,
        absent="gather_initial_states is absent (upstream has it from 0.27.1): nothing to gate",
        clean="no clamp or diagnostic: upstream gather_initial_states masks on device, no sync",
    ),
    Site(
        "chunk_kda_prefill",
        PREFILL_FILE,
        None,
        "chunk_kda_prefill",
        False,
        absent="kda_prefill.py or chunk_kda_prefill is absent here: no inlined diagnostic to gate",
        clean="no inlined diagnostic: it calls gather_initial_states as upstream does",
    ),
    Site(
        "KimiK3DeltaAttention._forward",
        KDA_FILE,
        "KimiK3DeltaAttention",
        "_forward",
        False,
        absent="the Kimi-K3 ROCm KDA layer is absent here: no inlined diagnostic to gate",
        clean="no inlined diagnostic in the KDA layer",
    ),
)

# --------------------------------------------------------------------------------------------
# The shapes, as SITES.md section 3 gives them. In DIAGNOSTIC three names are placeholders:
# INDICES (the index tensor) and BOUND (the pool size) carry other names where a caller inlines
# the diagnostic, and MESSAGE (the log text) differs between fork builds. Everything else,
# down to the `[:8]`, must match.

DIAGNOSTIC = """
if bool((INDICES >= BOUND).any()) or bool((INDICES < 0).any()):
    import logging as _lg

    _bad = INDICES[(INDICES >= BOUND) | (INDICES < 0)]
    _lg.getLogger(__name__).warning(MESSAGE, int(_bad.numel()), BOUND, _bad[:8].tolist())
"""

GATE = f'os.environ.get("{ENV}", "0") == "1"'
# The older anchor script's gate; `import os as _k3os` stands in the function or the module.
LEGACY_GATE = f"_k3os.environ.get('{ENV}', '0') == '1'"


def _gated(gate: str) -> str:
    return f"if {gate}:\n" + textwrap.indent(textwrap.dedent(DIAGNOSTIC).strip("\n"), "    ")


FORK_DIAGNOSTIC = Shape(
    "fork diagnostic",
    Verdict.PENDING,
    DIAGNOSTIC,
    origin="two bool() syncs on every call",
)
APPLIED_DIAGNOSTIC = Shape(
    "k3patch",
    Verdict.APPLIED,
    _gated(GATE),
    origin=f"the diagnostic runs only with {ENV}=1",
)
LEGACY_DIAGNOSTIC = Shape(
    "older anchor script (k3-kda-nosync)",
    Verdict.SATISFIED,
    _gated(LEGACY_GATE),
    origin=f"legacy fix: the diagnostic runs only with {ENV}=1",
)
DIAGNOSTIC_SHAPES = (FORK_DIAGNOSTIC, APPLIED_DIAGNOSTIC, LEGACY_DIAGNOSTIC)

# The fork's guard around the diagnostic in gather_initial_states: the two statements before it.
# k3patch never rewrites them; they only have to be there, unchanged, in every verdict.
GUARD_FOLDED = Shape(
    "fork, folded guard (clamp_)",
    Verdict.PENDING,
    """
    _n_state_blocks = int(state.shape[0])
    _safe_idx = torch.where(
        has_initial_state,
        indices.to(torch.int64).clamp_(0, _n_state_blocks - 1),
        torch.zeros_like(indices, dtype=torch.int64),
    )
    """,
)
GUARD_SCRIPT = Shape(
    "fork, guard script (clamp)",
    Verdict.PENDING,
    """
    _n_state_blocks = int(state.shape[0])
    _safe_idx = torch.where(
        has_initial_state,
        indices.to(torch.int64).clamp(0, _n_state_blocks - 1),
        torch.zeros_like(indices, dtype=torch.int64),
    )
    """,
)
GUARD_SHAPES = (GUARD_FOLDED, GUARD_SCRIPT)
GUARD_END = "indices = _safe_idx"
GUARD_NAMES = ("indices", "_n_state_blocks")  # INDICES and BOUND inside gather_initial_states

# Names and texts that only the fork's guard (or a fix of it) puts into these functions.
TRACE_NAMES = frozenset({"_n_state_blocks", "_safe_idx", "_bad", "_k3os"})
TRACE_TEXTS = (ENV, "k3-kda")

# --------------------------------------------------------------------------------------------
# What can make the host wait for the GPU stream. Used by classify (to spot diagnostics in
# forms k3patch does not know) and by the probe (to prove they are all behind the gate).

SYNC_METHODS = frozenset(
    {
        "item",
        "tolist",
        "cpu",
        "numpy",
        "nonzero",
        "masked_select",
        "unique",
        "unique_consecutive",
        "argwhere",
    }
)
SYNC_TORCH_FUNCTIONS = SYNC_METHODS | {"equal", "allclose", "is_nonzero"}
SCALAR_CASTS = frozenset({"bool", "int", "float"})
# A tensor reduction used as a truth value is an implicit bool().
TRUTH_REDUCTIONS = frozenset({"any", "all"})
HOST_ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "device", "is_cuda", "is_xpu", "layout"})
HOST_METHODS = frozenset(
    {"numel", "nelement", "size", "stride", "dim", "element_size", "is_contiguous", "data_ptr"}
)


def _is_host_value(node: ast.expr) -> bool:
    """Whether `node` is certainly a host value (tensor metadata or a literal), never a tensor."""
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Attribute):
        return node.attr in HOST_ATTRIBUTES
    if isinstance(node, ast.Subscript):
        return _is_host_value(node.value)
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name):
            return func.id == "len"
        return isinstance(func, ast.Attribute) and func.attr in HOST_METHODS
    if isinstance(node, ast.BinOp):
        return _is_host_value(node.left) and _is_host_value(node.right)
    if isinstance(node, ast.UnaryOp):
        return _is_host_value(node.operand)
    return False


def _is_mask(node: ast.expr) -> bool:
    """An index expression that is a boolean tensor: indexing with it sizes its output on host."""
    if isinstance(node, ast.Tuple):
        return any(_is_mask(e) for e in node.elts)
    if isinstance(node, ast.Compare):
        return not all(_is_host_value(e) for e in (node.left, *node.comparators))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr | ast.BitAnd | ast.BitXor):
        return True
    return isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert)


def _walk_code(root: ast.AST) -> Iterator[ast.AST]:
    """Every node under `root` that runs as code: annotations (where `A | B` and `x[...]` mean
    types, not tensors) are left out."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        for name, value in ast.iter_fields(node):
            if name in ("returns", "annotation") or isinstance(value, ast.arguments):
                continue
            children = value if isinstance(value, list) else [value]
            stack.extend(c for c in children if isinstance(c, ast.AST))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            stack.extend(node.args.defaults)
            stack.extend(d for d in node.args.kw_defaults if d is not None)


def _truth_tests(root: ast.AST) -> Iterator[ast.expr]:
    for node in _walk_code(root):
        if isinstance(node, ast.If | ast.While | ast.IfExp | ast.Assert):
            yield node.test
        elif isinstance(node, ast.BoolOp):
            yield from node.values
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield node.operand
        elif isinstance(node, ast.comprehension):
            yield from node.ifs


def sync_points(root: ast.AST) -> list[tuple[ast.AST, str]]:
    """Every expression under `root` that can make the host wait for the GPU, with its kind."""
    found: list[tuple[ast.AST, str]] = []
    for node in _walk_code(root):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in SCALAR_CASTS:
                if node.args and not _is_host_value(node.args[0]):
                    found.append((node, f"{func.id}() of a tensor"))
            elif isinstance(func, ast.Attribute):
                torch_call = isinstance(func.value, ast.Name) and func.value.id == "torch"
                if torch_call and func.attr in SYNC_TORCH_FUNCTIONS:
                    found.append((node, f"torch.{func.attr}()"))
                elif not torch_call and func.attr in SYNC_METHODS:
                    found.append((node, f".{func.attr}()"))
        elif isinstance(node, ast.Subscript) and _is_mask(node.slice):
            found.append((node, "boolean-mask indexing"))
    for test in _truth_tests(root):
        if (
            isinstance(test, ast.Call)
            and isinstance(test.func, ast.Attribute)
            and test.func.attr in TRUTH_REDUCTIONS
        ):
            found.append((test, f"truth value of .{test.func.attr}()"))
    return found


def is_gate(test: ast.expr) -> bool:
    """`<os>.environ.get("K3_KDA_GATHER_LOG"[, default]) == "1"` or the same through `getenv`,
    default not "1": a test that reads only the environment, so nothing on the device runs
    before it decides, and that is off when the variable is unset."""
    if not (
        isinstance(test, ast.Compare)
        and len(test.ops) == 1
        and isinstance(test.ops[0], ast.Eq)
        and isinstance(test.comparators[0], ast.Constant)
        and test.comparators[0].value == "1"
        and isinstance(test.left, ast.Call)
        and test.left.args
        and isinstance(test.left.args[0], ast.Constant)
        and test.left.args[0].value == ENV
    ):
        return False
    # A default of "1" would make the unset variable read as on.
    default = test.left.args[1] if len(test.left.args) > 1 else None
    if default is not None and not (isinstance(default, ast.Constant) and default.value != "1"):
        return False
    func = test.left.func
    if not isinstance(func, ast.Attribute):
        return False
    if func.attr == "getenv":
        return isinstance(func.value, ast.Name)
    return (
        func.attr == "get"
        and isinstance(func.value, ast.Attribute)
        and func.value.attr == "environ"
        and isinstance(func.value.value, ast.Name)
    )


def ungated_sync_points(func: ast.AST) -> tuple[list[str], list[str]]:
    """(gated, ungated) sync points of `func`, each as 'kind at line N'. A point is gated when it
    sits in the body of an `if` whose test is the K3_KDA_GATHER_LOG gate."""
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(func):
        for sub in ast.iter_child_nodes(node):
            parents[id(sub)] = node
    gated: list[str] = []
    ungated: list[str] = []
    for node, kind in sync_points(func):
        where = f"{kind} at line {getattr(node, 'lineno', '?')}"
        child: ast.AST = node
        parent = parents.get(id(child))
        inside = False
        while parent is not None:
            if isinstance(parent, ast.If) and is_gate(parent.test) and child in parent.body:
                inside = True
                break
            child, parent = parent, parents.get(id(parent))
        (gated if inside else ungated).append(where)
    return gated, ungated


# --------------------------------------------------------------------------------------------
# Locating and classifying.


class _Placeholders(ast.NodeTransformer):
    """Rename the index tensor to INDICES, the pool size to BOUND and the log text to MESSAGE."""

    def __init__(self, indices: str, bound: str) -> None:
        self.indices = indices
        self.bound = bound

    def visit(self, node: ast.AST) -> Any:
        if isinstance(node, ast.expr):
            dump = ast.dump(node, include_attributes=False)
            if dump == self.indices:
                return ast.Name(id="INDICES", ctx=ast.Load())
            if dump == self.bound:
                return ast.Name(id="BOUND", ctx=ast.Load())
        return super().visit(node)

    def visit_Call(self, node: ast.Call) -> Any:
        self.generic_visit(node)
        if (
            isinstance(node.func, ast.Attribute)
            and node.func.attr == "warning"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            node.args[0] = ast.Name(id="MESSAGE", ctx=ast.Load())
        return node


def _diagnostic_operands(test: ast.expr) -> tuple[ast.expr, ast.expr] | None:
    """(indices, bound) of a test `bool((X >= N).any()) or bool((X < 0).any())`."""
    if not (isinstance(test, ast.BoolOp) and isinstance(test.op, ast.Or) and test.values):
        return None
    first = test.values[0]
    if not (
        isinstance(first, ast.Call)
        and isinstance(first.func, ast.Name)
        and first.func.id == "bool"
        and len(first.args) == 1
        and isinstance(first.args[0], ast.Call)
        and isinstance(first.args[0].func, ast.Attribute)
        and isinstance(first.args[0].func.value, ast.Compare)
    ):
        return None
    compare = first.args[0].func.value
    if len(compare.comparators) != 1:
        return None
    return compare.left, compare.comparators[0]


def _with_placeholders(node: ast.If, names: tuple[str, str] | None) -> ast.AST:
    """The diagnostic (or its gate) with the fork's free names replaced by placeholders."""
    inner = node.body[0] if is_gate(node.test) and node.body else node
    operands = _diagnostic_operands(inner.test) if isinstance(inner, ast.If) else None
    if operands is None:
        return node
    indices, bound = (ast.dump(o, include_attributes=False) for o in operands)
    if names is not None:
        wanted = tuple(ast.dump(ast.Name(id=n, ctx=ast.Load())) for n in names)
        if (indices, bound) != wanted:
            return node
    renamed: ast.AST = _Placeholders(indices, bound).visit(copy.deepcopy(node))
    return renamed


def match_diagnostic(node: ast.If, names: tuple[str, str] | None = None) -> Shape | None:
    """The known shape of a diagnostic (bare, gated or legacy-gated), or None."""
    found = site_fingerprint(_with_placeholders(node, names))
    for shape in DIAGNOSTIC_SHAPES:
        if shape.fingerprint == found:
            return shape
    return None


def _walk_body(nodes: Iterable[ast.AST]) -> Iterator[ast.AST]:
    """Every node under `nodes`, not descending into nested functions, classes or lambdas."""
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                stack.append(child)


def _mentions_env(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Constant) and isinstance(n.value, str) and ENV in n.value
        for n in ast.walk(node)
    )


def diagnostic_units(func: ast.FunctionDef) -> list[ast.If]:
    """The `if` statements that are the diagnostic, or a gate around it, in source order."""
    units: list[ast.If] = []
    inside_gates: set[int] = set()
    for node in _walk_body(func.body):
        if isinstance(node, ast.If) and _mentions_env(node.test):
            units.append(node)
            inside_gates.update(id(n) for n in ast.walk(node) if n is not node)
    for node in _walk_body(func.body):
        if not isinstance(node, ast.If) or id(node) in inside_gates or node in units:
            continue
        if sync_points(ast.If(test=node.test, body=[], orelse=[])):
            units.append(node)
    return sorted(units, key=lambda n: (n.lineno, n.col_offset))


def fork_traces(func: ast.FunctionDef) -> list[str]:
    """What in `func` says a fork's guard or diagnostic was here, in whatever form."""
    traces: list[str] = []
    names = {n.id for n in _walk_body(func.body) if isinstance(n, ast.Name)}
    names |= {
        a.asname or a.name
        for n in _walk_body(func.body)
        if isinstance(n, ast.Import)
        for a in n.names
    }
    traces.extend(f"name {name}" for name in sorted(names & TRACE_NAMES))
    for node in _walk_body(func.body):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            traces.extend(f"text {t!r}" for t in TRACE_TEXTS if t in node.value)
    return sorted(set(traces))


def os_binding(module: ast.Module) -> str | None:
    """'os' when the module imports the os module as `os` at top level, 'other' when `os` names
    something else there, None when the name is free."""
    bound: str | None = None
    for node in module.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                name = alias.asname or alias.name.split(".")[0]
                if name == "os":
                    is_module = alias.name == "os" or (
                        alias.asname is None and alias.name.startswith("os.")
                    )
                    bound = "os" if is_module and bound != "other" else "other"
        elif isinstance(node, ast.ImportFrom):
            if any((a.asname or a.name) == "os" for a in node.names):
                bound = "other"
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if node.name == "os":
                bound = "other"
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "os" for t in targets):
                bound = "other"
    return bound


def _imports_k3os(module: ast.Module, func: ast.FunctionDef) -> bool:
    nodes = [*module.body, *_walk_body(func.body)]
    return any(
        isinstance(n, ast.Import) and any(a.name == "os" and a.asname == "_k3os" for a in n.names)
        for n in nodes
    )


def find_site_function(module: ast.Module, site: Site) -> ast.FunctionDef | None:
    if site.cls is None:
        return find_function(module, site.func)
    cls = find_class(module, site.cls)
    return find_method(cls, site.func) if cls else None


@dataclass
class Located:
    """One site in one file, as classify found it (the rewrite locates it again the same way)."""

    result: SiteResult
    pending: list[ast.If]


class KdaGatherDiagnostic(Patch):
    id = "kda-gather-diagnostic"
    title = f"KDA gather_initial_states diagnostic syncs the GPU only with {ENV}=1"
    files = (OPS_FILE, PREFILL_FILE, KDA_FILE)
    modules = (OPS_MODULE,)
    caveat = (
        f"with {ENV}=1 the diagnostic syncs by design; fork builds whose guard is in no known "
        "shape read as drifted, never patched"
    )

    def classify(self, sources: Sources) -> list[SiteResult]:
        return [self.locate(sources, site).result for site in SITES]

    def locate(self, sources: Sources, site: Site) -> Located:
        src = sources[site.file]
        if not src.exists:
            return Located(self._result(site, Verdict.NOT_APPLICABLE, site.absent), [])
        func = find_site_function(src.tree, site)
        if func is None:
            return Located(self._result(site, Verdict.NOT_APPLICABLE, site.absent), [])
        if site.guarded:
            return self._locate_guarded(src, site, func)
        units = diagnostic_units(func)
        if not units:
            traces = fork_traces(func)
            if traces:
                return Located(
                    self._drift(src, site, func, "fork traces without the diagnostic"), []
                )
            return Located(self._result(site, Verdict.NOT_APPLICABLE, site.clean), [])
        return self._judge_units(src, site, func, units, names=None, first=units[0])

    def _locate_guarded(self, src: SourceFile, site: Site, func: ast.FunctionDef) -> Located:
        body = func.body
        start = next(
            (
                i
                for i, stmt in enumerate(body)
                if isinstance(stmt, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "_n_state_blocks" for t in stmt.targets)
            ),
            None,
        )
        if start is None:
            traces = fork_traces(func)
            if traces or diagnostic_units(func):
                why = "; ".join(traces) or "a syncing test"
                return Located(
                    self._drift(src, site, func, f"fork traces ({why}) outside the known guard"),
                    [],
                )
            return Located(self._result(site, Verdict.NOT_APPLICABLE, site.clean), [])
        end_fp = site_fingerprint(ast.parse(GUARD_END).body[0])
        end = next(
            (i for i in range(start, len(body)) if site_fingerprint(body[i]) == end_fp), None
        )
        run = body[start : (end + 1 if end is not None else len(body))]
        # The older anchor script may put its `import os as _k3os` anywhere in the run.
        core = [
            s
            for s in run
            if not (isinstance(s, ast.Import) and [a.asname for a in s.names] == ["_k3os"])
        ]
        guard = None
        if len(core) == 4 and end is not None:
            guard_fp = site_fingerprint(core[:2])
            guard = next((g for g in GUARD_SHAPES if g.fingerprint == guard_fp), None)
        unit = core[2] if len(core) == 4 else None
        if guard is None or not isinstance(unit, ast.If):
            return Located(self._drift(src, site, run, "the k3-kda guard is in no known shape"), [])
        located = self._judge_units(src, site, func, [unit], names=GUARD_NAMES, first=run[0])
        if located.result.verdict is Verdict.DRIFTED:
            return located
        result = located.result
        shape = f"{guard.name}; {result.shape}"
        return Located(
            SiteResult(
                patch_id=self.id,
                site=site.name,
                file=site.file,
                verdict=result.verdict,
                shape=shape,
                detail=result.detail,
                line=result.line,
            ),
            located.pending,
        )

    def _judge_units(
        self,
        src: SourceFile,
        site: Site,
        func: ast.FunctionDef,
        units: list[ast.If],
        names: tuple[str, str] | None,
        first: ast.AST,
    ) -> Located:
        shapes: list[Shape] = []
        for unit in units:
            shape = match_diagnostic(unit, names)
            if shape is None:
                return Located(
                    self._drift(src, site, unit, "the diagnostic is in no known shape"), []
                )
            if shape is LEGACY_DIAGNOSTIC and not _imports_k3os(src.tree, func):
                return Located(
                    self._drift(
                        src,
                        site,
                        unit,
                        "legacy gate without `import os as _k3os`: NameError on every call",
                    ),
                    [],
                )
            shapes.append(shape)
        binding = os_binding(src.tree)
        if APPLIED_DIAGNOSTIC in shapes and binding != "os":
            return Located(
                self._drift(
                    src, site, units[0], "gated, but the module does not `import os`: NameError"
                ),
                [],
            )
        if FORK_DIAGNOSTIC in shapes and binding == "other":
            return Located(
                self._drift(
                    src,
                    site,
                    units[0],
                    "the module binds `os` to something else; the gate needs it",
                ),
                [],
            )
        verdict = summarise(s.verdict for s in shapes)
        names_seen = list(dict.fromkeys(s.name for s in shapes))
        origins = list(dict.fromkeys(s.origin for s in shapes))
        result = SiteResult(
            patch_id=self.id,
            site=site.name,
            file=site.file,
            verdict=verdict,
            shape="; ".join(names_seen),
            detail="; ".join(origins),
            line=getattr(first, "lineno", None),
        )
        pending = [u for u, s in zip(units, shapes, strict=True) if s is FORK_DIAGNOSTIC]
        return Located(result, pending)

    def _result(self, site: Site, verdict: Verdict, detail: str) -> SiteResult:
        return self.result(site.name, site.file, verdict, detail)

    def _drift(
        self, src: SourceFile, site: Site, node: ast.AST | list[ast.stmt], why: str
    ) -> SiteResult:
        nodes = node if isinstance(node, list) else [node]
        found = "\n".join(src.segment(n) for n in nodes) if nodes else ""
        expected = (
            [
                f"{g.name} + {d.name} ({d.verdict.value})"
                for g in GUARD_SHAPES
                for d in DIAGNOSTIC_SHAPES
            ]
            if site.guarded
            else [f"{d.name} ({d.verdict.value})" for d in DIAGNOSTIC_SHAPES]
        )
        return SiteResult(
            patch_id=self.id,
            site=site.name,
            file=site.file,
            verdict=Verdict.DRIFTED,
            detail=f"{why}; nothing will be written",
            line=getattr(nodes[0], "lineno", None) if nodes else None,
            found=found,
            expected=tuple(expected),
        )

    def rewrite(self, sources: Sources, pending: list[SiteResult]) -> dict[str, str]:
        wanted = {(r.site, r.file) for r in pending}
        units: dict[str, list[ast.If]] = {}
        for site in SITES:
            if (site.name, site.file) not in wanted:
                continue
            located = self.locate(sources, site)
            if located.result.verdict is not Verdict.PENDING or not located.pending:
                raise ValueError(f"{site.name}: no longer pending ({located.result.verdict.value})")
            units.setdefault(site.file, []).extend(located.pending)
        return {
            rel: gate_diagnostics(sources[rel].text, sources[rel].tree, found)
            for rel, found in units.items()
        }

    def probe(self) -> ProbeOutcome:
        return probe_no_sync_unless_asked()


PATCH = KdaGatherDiagnostic()


# --------------------------------------------------------------------------------------------
# The rewrite: the diagnostic's own lines move one level in under the gate, and one
# `import os` line goes in above the module's imports. Every other byte stays as it was.

GATE_COMMENT = (
    "# k3patch kda-gather-diagnostic: each bool() below waits for the GPU stream to drain, once",
    f"# per KDA layer per prefill chunk; the diagnostic runs only with {ENV}=1.",
)


def gate_diagnostics(text: str, tree: ast.Module, diagnostics: list[ast.If]) -> str:
    """`text` with every diagnostic nested under the gate, and `import os` added once when the
    module has none. `diagnostics` are nodes of `tree`, which is `text` parsed."""
    for node in sorted(diagnostics, key=lambda n: n.lineno, reverse=True):
        text = _gate_one(text, node)
    if os_binding(tree) is None:
        text = _add_import_os(text, tree)
    return text


def _gate_one(text: str, node: ast.If) -> str:
    from k3patch.codemod import SpliceError, splice, statement_lines

    start, end = statement_lines(text, node)
    lines = text.splitlines(keepends=True)
    pad = lines[start][: node.col_offset]
    # One more level, spelled as the diagnostic's own body is indented (spaces or a tab).
    step = lines[node.body[0].lineno - 1][node.col_offset : node.body[0].col_offset]
    if not step or step.strip():
        raise SpliceError(f"line {node.body[0].lineno}: the diagnostic's body is not indented")
    # Lines inside a multi-line string literal are string content, not indentation.
    segment = "".join(lines[start:end])
    in_string = {
        start + row - 1
        for token in tokenize.generate_tokens(io.StringIO(segment).readline)
        for row in range(token.start[0] + 1, token.end[0] + 1)
    }
    moved = [
        step + line if line.strip() and number not in in_string else line
        for number, line in enumerate(lines[start:end], start=start)
    ]
    head = [f"{pad}{comment}\n" for comment in GATE_COMMENT] + [f"{pad}if {GATE}:\n"]
    return splice(text, start, end, "".join(head + moved))


def _add_import_os(text: str, tree: ast.Module) -> str:
    body = tree.body
    index = 0
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        index = 1
    while (
        index < len(body)
        and isinstance(body[index], ast.ImportFrom)
        and body[index].module == "__future__"  # type: ignore[attr-defined]
    ):
        index += 1
    lines = text.splitlines(keepends=True)
    if index == len(body):
        if lines and not lines[-1].endswith("\n"):
            lines[-1] += "\n"
        return "".join([*lines, "import os\n"])
    anchor = body[index]
    first = min([anchor.lineno, *(d.lineno for d in getattr(anchor, "decorator_list", []))])
    # isort's order: `import os` sits in the stdlib block, a blank line above anything else.
    stdlib = isinstance(anchor, ast.Import) and all(
        a.name.split(".")[0] in sys.stdlib_module_names for a in anchor.names
    )
    insert = "import os\n" if stdlib else "import os\n\n"
    return "".join([*lines[: first - 1], insert, *lines[first - 1 :]])


# --------------------------------------------------------------------------------------------
# The behaviour probe. It runs in the verify child (the tree's interpreter, torch, no GPU).


def probe_no_sync_unless_asked() -> ProbeOutcome:
    """Decide, on the code the tree really runs, that nothing syncs with K3_KDA_GATHER_LOG unset.

    Static: every sync-capable call in each site's function (the imported gather_initial_states,
    the callers read from their files, since kimi_k3 does not import without its GPU stack) must
    sit under the gate. Dynamic: gather_initial_states runs on CPU tensors, Triton launch stubbed,
    under a torch function and dispatch trace; unset must run no sync-capable op, =1 must log an
    out-of-range index, and the gathered rows must be the clamped ones either way.
    """
    checks: list[str] = []
    failures: list[str] = []
    package = _vllm_package_dir()
    ops_func: Callable[..., Any] | None = None
    ops_ast: ast.FunctionDef | None = None
    try:
        module = importlib.import_module(OPS_MODULE)
        ops_func = inspect.unwrap(module.gather_initial_states)
        parsed = ast.parse(textwrap.dedent(inspect.getsource(ops_func)))
        ops_ast = next(n for n in parsed.body if isinstance(n, ast.FunctionDef))
    except Exception as exc:  # verify judges the import itself; fall back to the file
        checks.append(f"gather_initial_states did not import ({type(exc).__name__}: {exc})")
        ops_func = None
    for site in SITES:
        func: ast.FunctionDef | None = None
        how = "absent"
        if site.file == OPS_FILE and ops_ast is not None:
            func, how = ops_ast, "source of the imported function"
        elif package is not None and (package / site.file).is_file():
            tree = ast.parse((package / site.file).read_text(encoding="utf-8"))
            func, how = find_site_function(tree, site), "read from its file"
        if func is None:
            checks.append(f"{site.name}: absent, nothing to check")
            continue
        gated, ungated = ungated_sync_points(func)
        checks.append(
            f"{site.name} (static, {how}): {len(gated)} sync-capable call(s) under the "
            f"{ENV} gate, {len(ungated)} outside it"
        )
        if ungated:
            failures.append(f"{site.name}: reachable with {ENV} unset: " + ", ".join(ungated))
    if ops_func is not None and ops_ast is not None:
        dynamic_checks, dynamic_failures = _run_gather(ops_func, ops_ast)
        checks.extend(dynamic_checks)
        failures.extend(dynamic_failures)
        how = "decided by the AST of every site and a traced CPU run of gather_initial_states"
    else:
        how = "decided by the AST of every site only: gather_initial_states did not import"
    if failures:
        return ProbeOutcome(False, f"{'; '.join(failures)} ({how})", tuple(checks))
    return ProbeOutcome(True, f"no sync reachable with {ENV} unset ({how})", tuple(checks))


def _vllm_package_dir() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _has_guard(func: ast.FunctionDef | None) -> bool:
    return func is not None and "_safe_idx" in {
        n.id for n in ast.walk(func) if isinstance(n, ast.Name)
    }


def _kernel_names(func: ast.FunctionDef) -> set[str]:
    """Globals launched Triton-style, `kernel[grid](...)`."""
    return {
        node.func.value.id
        for node in ast.walk(func)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Subscript)
        and isinstance(node.func.value, ast.Name)
    }


_SYNC_OPS = frozenset(
    {
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "item",
        "tolist",
        "cpu",
        "numpy",
        "nonzero",
        "masked_select",
        "unique",
        "unique_consecutive",
        "argwhere",
        "equal",
        "allclose",
        "is_nonzero",
        "__repr__",
        "__format__",
    }
)
# aten ops that read device memory on the host (seen below the Python layer).
_SYNC_ATEN = ("_local_scalar_dense", "nonzero", "masked_select")


def _run_gather(func: Callable[..., Any], func_ast: ast.FunctionDef) -> tuple[list[str], list[str]]:
    """Run the real function on CPU tensors posing as device tensors, with the Triton launch
    replaced by a host gather, and record every torch op that would sync on a GPU."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    checks: list[str] = []
    failures: list[str] = []
    paused = [False]  # the stubbed kernel's own host work is not the function's
    python_ops: list[str] = []
    aten_ops: list[str] = []
    launches: list[str] = []

    class DeviceLooking(torch.Tensor):
        # gather_initial_states asserts a device tensor; these are CPU tensors that say so.
        @property
        def is_cuda(self) -> bool:  # type: ignore[override]
            return True

    class PythonTrace(TorchFunctionMode):
        def __torch_function__(
            self, fn: Any, types_: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if not paused[0]:
                name = getattr(fn, "__name__", str(fn))
                if name in _SYNC_OPS:
                    python_ops.append(name)
                elif name in ("__getitem__", "index") and len(args) > 1:
                    index = args[1]
                    items = index if isinstance(index, tuple) else (index,)
                    if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items):
                        python_ops.append("boolean-mask indexing")
            return fn(*args, **(kwargs or {}))

    class AtenTrace(TorchDispatchMode):
        def __torch_dispatch__(
            self, fn: Any, types_: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if not paused[0] and any(s in str(fn) for s in _SYNC_ATEN):
                aten_ops.append(str(fn))
            return fn(*args, **(kwargs or {}))

    class KernelStub:
        def __init__(self, name: str) -> None:
            self.name = name

        def __getitem__(self, grid: Any) -> Callable[..., None]:
            def launch(*args: Any, **kwargs: Any) -> None:
                paused[0] = True
                try:
                    src, slots, valid, out = (t.as_subclass(torch.Tensor) for t in args[:4])
                    rows = slots.to(torch.int64)
                    n = src.shape[0]
                    if bool(((rows < 0) | (rows >= n))[valid].any()):
                        launches.append("an out-of-range index reached the kernel")
                    picked = src.reshape(n, -1)[rows.clamp(0, n - 1)].reshape(out.shape)
                    mask = valid.reshape(-1, *([1] * (out.ndim - 1)))
                    out.copy_(torch.where(mask, picked, torch.zeros_like(picked)))
                    launches.append(f"{self.name}[{grid}]")
                finally:
                    paused[0] = False

            return launch

    scope = dict(func.__globals__)  # type: ignore[attr-defined]
    for name in _kernel_names(func_ast):
        scope[name] = KernelStub(name)
    triton_module = scope.get("triton")
    if not all(hasattr(triton_module, a) for a in ("next_power_of_2", "cdiv")):
        # vLLM's Triton placeholder (no Triton on this machine) lacks these host helpers.
        scope["triton"] = types.SimpleNamespace(
            next_power_of_2=lambda n: 1 << max(int(n) - 1, 0).bit_length(),
            cdiv=lambda a, b: -(a // -b),
        )
    runnable = types.FunctionType(
        func.__code__,  # type: ignore[attr-defined]
        scope,
        func.__name__,
        func.__defaults__,  # type: ignore[attr-defined]
        func.__closure__,  # type: ignore[attr-defined]
    )
    logger = logging.getLogger(str(scope.get("__name__", "")))
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    pool = 6
    state = torch.arange(pool * 2 * 3, dtype=torch.float32).reshape(pool, 2, 3)
    has = torch.tensor([True, True, False, True])
    cases: list[tuple[str, list[int], str | None]] = [("indices in range", [0, 5, 3, 2], None)]
    if _has_guard(func_ast):
        # Only the fork's guard clamps; upstream's kernel must never see a bad index.
        cases.append(("index 9 of a pool of 6", [0, 9, 3, 2], None))
        cases.append(("index 9 of a pool of 6", [0, 9, 3, 2], "1"))
    saved_env = os.environ.get(ENV)
    saved_level = logger.level
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    # verify runs with VLLM_LOGGING_LEVEL=ERROR; the diagnostic logs at WARNING.
    logger.setLevel(logging.WARNING)
    try:
        for label, slots, env in cases:
            if env is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = env
            for log in (python_ops, aten_ops, launches, records):
                log.clear()
            indices = torch.tensor(slots, dtype=torch.int32)
            with PythonTrace(), AtenTrace():
                out = runnable(
                    state.as_subclass(DeviceLooking),
                    indices.as_subclass(DeviceLooking),
                    has.as_subclass(DeviceLooking),
                )
            out = out.as_subclass(torch.Tensor)
            rows = torch.tensor(slots).clamp(0, pool - 1)
            expected = torch.where(has[:, None, None], state[rows], torch.zeros(2, 3))
            right = torch.equal(out, expected)
            env_text = f"{ENV}={'unset' if env is None else env}"
            logged = [r for r in records if r.levelno >= logging.WARNING]
            ops = ", ".join(python_ops + aten_ops) or "none"
            checks.append(
                f"gather_initial_states (traced CPU run, {env_text}, {label}): sync-capable "
                f"ops: {ops}; {len(logged)} warning(s); rows {'right' if right else 'WRONG'}"
            )
            if not right:
                failures.append(f"{env_text}, {label}: the gathered rows are wrong")
            if "an out-of-range index reached the kernel" in launches:
                failures.append(f"{env_text}, {label}: an out-of-range index reached the kernel")
            if env is None and (python_ops or aten_ops):
                failures.append(f"{env_text}, {label}: sync-capable ops ran: {ops}")
            if env == "1" and not any("9" in r.getMessage() for r in logged):
                failures.append(f"{env_text}: the diagnostic did not log the out-of-range index")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved_level)
        if saved_env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = saved_env
    return checks, failures
