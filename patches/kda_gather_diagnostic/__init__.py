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
gathered either way (probe.py).
Real trees: the fork trees (tests/forktree: the vLLM 0.28.0 wheel plus the older scripts) a,
a-comments, a-nodebug and c read pending (the guard script's `.clamp`), b pending (the fork's
folded file, `.clamp_`), d satisfied (the older anchor script's `k3-kda-nosync` gate). Upstream
vLLM has no clamp and no diagnostic (its kernel masks on device): every wheel reads not
applicable, and k3patch writes nothing there.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, replace

from k3patch.edits import Edit, SourceText, apply_edits, ensure_import, insert_before, nest_under
from k3patch.model import (
    Patch,
    ProbeOutcome,
    Shape,
    SiteResult,
    SourceFile,
    Sources,
    Verdict,
    bindings,
    find_scope,
    shape_detail,
    summarise,
    walk_scope,
)
from k3patch.shapes import VersionRange, holes, match

from .syncs import ENV, sync_points

OPS_FILE = "model_executor/layers/mamba/ops/gather_initial_states.py"
OPS_MODULE = "vllm.model_executor.layers.mamba.ops.gather_initial_states"
PREFILL_FILE = "models/kimi_k3/amd/ops/kda_prefill.py"
KDA_FILE = "models/kimi_k3/amd/kda.py"


@dataclass(frozen=True)
class Site:
    """A function that holds (or, in some fork build, may hold) the diagnostic."""

    name: str  # its scope path in `file`
    file: str
    # In gather_initial_states the diagnostic sits inside the fork's guard, between the clamp
    # and `indices = _safe_idx`; the guard must be intact for any verdict but not applicable.
    guarded: bool
    absent: str
    clean: str


SITES = (
    Site(
        "gather_initial_states",
        OPS_FILE,
        True,
        absent="gather_initial_states is absent (upstream has it from 0.27.1): nothing to gate",
        clean="no clamp or diagnostic: upstream gather_initial_states masks on device, no sync",
    ),
    Site(
        "chunk_kda_prefill",
        PREFILL_FILE,
        False,
        absent="kda_prefill.py or chunk_kda_prefill is absent here: no inlined diagnostic to gate",
        clean="no inlined diagnostic: it calls gather_initial_states as upstream does",
    ),
    Site(
        "KimiK3DeltaAttention._forward",
        KDA_FILE,
        False,
        absent="the Kimi-K3 ROCm KDA layer is absent here: no inlined diagnostic to gate",
        clean="no inlined diagnostic in the KDA layer",
    ),
)

# --------------------------------------------------------------------------------------------
# The shapes, as SITES.md section 3 gives them. In the diagnostic, HOLE_indices (the index
# tensor) and HOLE_bound (the pool size) carry other names where a caller inlines it, and
# HOLE_message (the log text, a plain string) differs between fork builds. Everything else,
# down to the `[:8]`, must match.

FORK_BUILDS = VersionRange("0.27.1", "0.28.0")  # the fork's file is 0.27.1/0.28.0's plus the guard

DIAGNOSTIC = """
if bool((HOLE_indices >= HOLE_bound).any()) or bool((HOLE_indices < 0).any()):
    import logging as _lg

    _bad = HOLE_indices[(HOLE_indices >= HOLE_bound) | (HOLE_indices < 0)]
    _lg.getLogger(__name__).warning(
        HOLE_message, int(_bad.numel()), HOLE_bound, _bad[:8].tolist()
    )
"""

GATE = f'os.environ.get("{ENV}", "0") == "1"'
# The older anchor script's gate; its `import os as _k3os` stands in the function or the module.
LEGACY_GATE = f"_k3os.environ.get('{ENV}', '0') == '1'"


def _gated(gate: str) -> str:
    inner = DIAGNOSTIC.strip("\n").replace("\n", "\n    ")
    return f"if {gate}:\n    {inner}\n"


FORK_DIAGNOSTIC = Shape(
    "fork diagnostic",
    Verdict.PENDING,
    DIAGNOSTIC,
    origin="two bool() syncs on every call",
    versions=FORK_BUILDS,
)
APPLIED_DIAGNOSTIC = Shape(
    "k3patch", Verdict.APPLIED, _gated(GATE), origin=f"the diagnostic runs only with {ENV}=1"
)
LEGACY_DIAGNOSTIC = Shape(
    "older anchor script (k3-kda-nosync)",
    Verdict.SATISFIED,
    _gated(LEGACY_GATE),
    origin=f"legacy fix: the diagnostic runs only with {ENV}=1",
    versions=FORK_BUILDS,
)
DIAGNOSTIC_SHAPES = (FORK_DIAGNOSTIC, APPLIED_DIAGNOSTIC, LEGACY_DIAGNOSTIC)

# The fork's guard in gather_initial_states, from the clamp to `indices = _safe_idx`, with the
# diagnostic (in any of the shapes above) as its third statement. k3patch never rewrites the
# other three; they only have to be there, unchanged, in every verdict.
_GUARD = """
_n_state_blocks = int(state.shape[0])
_safe_idx = torch.where(
    has_initial_state,
    indices.to(torch.int64).CLAMP(0, _n_state_blocks - 1),
    torch.zeros_like(indices, dtype=torch.int64),
)
HOLE_diagnostic
indices = _safe_idx
"""
GUARD_FOLDED = Shape(
    "fork, folded guard (clamp_)",
    Verdict.PENDING,
    _GUARD.replace("CLAMP", "clamp_"),
    versions=FORK_BUILDS,
)
GUARD_SCRIPT = Shape(
    "fork, guard script (clamp)",
    Verdict.PENDING,
    _GUARD.replace("CLAMP", "clamp"),
    versions=FORK_BUILDS,
)
GUARD_SHAPES = (GUARD_FOLDED, GUARD_SCRIPT)
GUARD_END = "indices = _safe_idx"
GUARD_NAMES = ("indices", "_n_state_blocks")  # HOLE_indices, HOLE_bound in gather_initial_states

# Names and texts that only the fork's guard (or a fix of it) puts into these functions.
TRACE_NAMES = frozenset({"_n_state_blocks", "_safe_idx", "_bad", "_k3os"})
TRACE_TEXTS = (ENV, "k3-kda")


def match_diagnostic(node: ast.stmt, names: tuple[str, str] | None = None) -> Shape | None:
    """The known shape of a diagnostic (bare, gated or legacy-gated), or None. With `names`,
    the index tensor and the pool size must be exactly those names."""
    for shape in DIAGNOSTIC_SHAPES:
        found = shape.match(node)
        if found is None:
            continue
        message = found["HOLE_message"]
        if not (isinstance(message, ast.Constant) and isinstance(message.value, str)):
            continue
        text = holes(found)
        if names is not None and (text["HOLE_indices"], text["HOLE_bound"]) != names:
            continue
        return shape
    return None


def _mentions_env(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Constant) and isinstance(n.value, str) and ENV in n.value
        for n in ast.walk(node)
    )


def diagnostic_units(func: ast.FunctionDef) -> list[ast.If]:
    """The `if` statements that are the diagnostic, or a gate around it, in source order."""
    units: list[ast.If] = []
    inside_gates: set[int] = set()
    for node in walk_scope(func.body):
        if isinstance(node, ast.If) and _mentions_env(node.test):
            units.append(node)
            inside_gates.update(id(n) for n in ast.walk(node) if n is not node)
    for node in walk_scope(func.body):
        if not isinstance(node, ast.If) or id(node) in inside_gates or node in units:
            continue
        if sync_points(ast.If(test=node.test, body=[], orelse=[])):
            units.append(node)
    return sorted(units, key=lambda n: (n.lineno, n.col_offset))


def fork_traces(func: ast.FunctionDef) -> list[str]:
    """What in `func` says a fork's guard or diagnostic was here, in whatever form."""
    nodes = list(walk_scope(func.body))
    names = {n.id for n in nodes if isinstance(n, ast.Name)}
    names |= {a.asname or a.name for n in nodes if isinstance(n, ast.Import) for a in n.names}
    traces = [f"name {name}" for name in sorted(names & TRACE_NAMES)]
    for node in nodes:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            traces.extend(f"text {t!r}" for t in TRACE_TEXTS if t in node.value)
    return sorted(set(traces))


def os_binding(module: ast.Module) -> str | None:
    """'os' when every top-level binding of `os` imports the os module as `os`, 'other' when
    `os` names something else there, None when the name is free."""
    found = bindings(module.body, "os")
    if not found:
        return None
    for stmt in found:
        if not isinstance(stmt, ast.Import):
            return "other"
        for alias in stmt.names:
            if (alias.asname or alias.name.split(".")[0]) != "os":
                continue
            if not (alias.name == "os" or (alias.asname is None and alias.name.startswith("os."))):
                return "other"
    return "os"


def _is_k3os_import(node: ast.AST) -> bool:
    return isinstance(node, ast.Import) and any(
        a.name == "os" and a.asname == "_k3os" for a in node.names
    )


def find_site_function(module: ast.Module, site: Site) -> ast.FunctionDef | None:
    found = find_scope(module, site.name)
    return found if isinstance(found, ast.FunctionDef) else None


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
        func = find_site_function(src.tree, site) if src.exists else None
        if func is None:
            return Located(self._result(site, Verdict.NOT_APPLICABLE, site.absent), [])
        if site.guarded:
            return self._locate_guarded(src, site, func)
        units = diagnostic_units(func)
        if units:
            return self._judge_units(src, site, func, units, names=None, first=units[0])
        if fork_traces(func):
            return Located(self._drift(src, site, func, "fork traces without the diagnostic"), [])
        return Located(self._result(site, Verdict.NOT_APPLICABLE, site.clean), [])

    def _locate_guarded(self, src: SourceFile, site: Site, func: ast.FunctionDef) -> Located:
        body = func.body
        start = next((i for i, s in enumerate(body) if bindings([s], "_n_state_blocks")), None)
        if start is None:
            traces = fork_traces(func)
            if traces or diagnostic_units(func):
                why = "; ".join(traces) or "a syncing test"
                drift = self._drift(src, site, func, f"fork traces ({why}) outside the known guard")
                return Located(drift, [])
            return Located(self._result(site, Verdict.NOT_APPLICABLE, site.clean), [])
        end = next(
            (i for i in range(start, len(body)) if match(GUARD_END, body[i]) is not None),
            len(body) - 1,
        )
        run = body[start : end + 1]
        # The older anchor script may put its `import os as _k3os` anywhere in the run.
        core = [s for s in run if not _is_k3os_import(s)]
        guard = next((g for g in GUARD_SHAPES if g.match(core) is not None), None)
        unit = core[2] if guard is not None else None
        if guard is None or not isinstance(unit, ast.If):
            return Located(self._drift(src, site, run, "the k3-kda guard is in no known shape"), [])
        located = self._judge_units(src, site, func, [unit], names=GUARD_NAMES, first=run[0])
        if located.result.verdict is not Verdict.DRIFTED:
            shape = f"{guard.name}; {located.result.shape}"
            located.result = replace(located.result, shape=shape)
        return located

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
                why = "the diagnostic is in no known shape"
                return Located(self._drift(src, site, unit, why), [])
            legacy_import = any(map(_is_k3os_import, [*src.tree.body, *walk_scope(func.body)]))
            if shape is LEGACY_DIAGNOSTIC and not legacy_import:
                why = "legacy gate without `import os as _k3os`: NameError on every call"
                return Located(self._drift(src, site, unit, why), [])
            shapes.append(shape)
        binding = os_binding(src.tree)
        if APPLIED_DIAGNOSTIC in shapes and binding != "os":
            why = "gated, but the module does not `import os`: NameError"
            return Located(self._drift(src, site, units[0], why), [])
        if FORK_DIAGNOSTIC in shapes and binding == "other":
            why = "the module binds `os` to something else; the gate needs it"
            return Located(self._drift(src, site, units[0], why), [])
        result = SiteResult(
            patch_id=self.id,
            site=site.name,
            file=site.file,
            verdict=summarise(s.verdict for s in shapes),
            shape="; ".join(dict.fromkeys(s.name for s in shapes)),
            detail="; ".join(dict.fromkeys(shape_detail(s, src) for s in shapes)),
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
        guards = GUARD_SHAPES if site.guarded else (None,)
        expected = tuple(
            f"{g.name + ' + ' if g else ''}{d.name} ({d.verdict.value})"
            for g in guards
            for d in DIAGNOSTIC_SHAPES
        )
        return SiteResult(
            patch_id=self.id,
            site=site.name,
            file=site.file,
            verdict=Verdict.DRIFTED,
            detail=f"{why}; nothing will be written",
            line=getattr(nodes[0], "lineno", None) if nodes else None,
            found="\n".join(src.segment(n) for n in nodes),
            expected=expected,
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
        from .probe import probe_no_sync_unless_asked

        return probe_no_sync_unless_asked()


PATCH = KdaGatherDiagnostic()

# The rewrite: the diagnostic's own lines move one level in under the gate, with this comment
# above it, and `import os` goes in where isort would put it. Every other byte stays.
GATE_COMMENT = (
    "# k3patch kda-gather-diagnostic: each bool() below waits for the GPU stream to drain, once\n"
    f"# per KDA layer per prefill chunk; the diagnostic runs only with {ENV}=1."
)


def gate_diagnostics(text: str, tree: ast.Module, diagnostics: list[ast.If]) -> str:
    """`text` with every diagnostic nested under the gate, and `import os` added once when the
    module has none. `diagnostics` are nodes of `tree`, which is `text` parsed."""
    src = SourceText(text)
    edits: list[Edit] = []
    for node in diagnostics:
        edits.append(insert_before(src, node, GATE_COMMENT))
        edits.append(nest_under(src, [node], f"if {GATE}:"))
    import_os = ensure_import(src, tree, "os")
    return apply_edits(text, [*edits, *([import_os] if import_os else [])])
