"""kda-gather-diagnostic: the KDA state-index diagnostic syncs the GPU only when asked to.

Symptom: a long prompt looks hung. At 750K tokens the prefill issues about 25,000 full GPU
stream drains, one per KDA layer per prefill chunk; above about 500K nothing seems to move.
Cause: the Kimi-K3 fork's "k3-kda guard" in `gather_initial_states` clamps the state indices on
the device (sync-free), then runs `if bool((indices >= n).any()) or bool((indices < 0).any()):`
only to log a warning. Each `bool()` copies a flag to the host, so the CPU waits for every queued
kernel. Some fork builds inline the same diagnostic in the callers (`chunk_kda_prefill`,
`KimiK3DeltaAttention._forward`).
Fix: the diagnostic `if` is nested under `if os.environ.get("K3_KDA_GATHER_LOG", "0") == "1":`,
a host-only test (`import os` is added when the module lacks it). The clamp and
`indices = _safe_idx` stay as they were, so the kernel still never sees an out-of-range index.
Check: `k3patch verify` requires every sync-capable call of each site to sit inside the gate,
then runs `gather_initial_states` on CPU tensors under a torch op trace: no sync-capable op with
the variable unset, the out-of-range index logged with it =1, the clamped rows either way.
Real trees: fork trees a, a-comments, a-nodebug, c (the guard script's `.clamp`) and b (the
fork's folded file, `.clamp_`) read pending; d satisfied (the older `k3-kda-nosync` gate).
Upstream has neither clamp nor diagnostic (its kernel masks on device): not applicable.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
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
    find_def,
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
    """A function that holds (or, in some fork build, may hold) the diagnostic: its scope path,
    its file, and the details of its two not-applicable verdicts."""

    name: str
    file: str
    absent: str
    clean: str

    @property
    def guarded(self) -> bool:
        """Whether the diagnostic sits inside the fork's guard (in gather_initial_states)."""
        return self.file == OPS_FILE


SITES = (
    Site(
        "gather_initial_states",
        OPS_FILE,
        "gather_initial_states is absent (upstream has it from 0.27.1): nothing to gate",
        "no clamp or diagnostic: upstream gather_initial_states masks on device, no sync",
    ),
    Site(
        "chunk_kda_prefill",
        PREFILL_FILE,
        "kda_prefill.py or chunk_kda_prefill is absent here: no inlined diagnostic to gate",
        "no inlined diagnostic: it calls gather_initial_states as upstream does",
    ),
    Site(
        "KimiK3DeltaAttention._forward",
        KDA_FILE,
        "the Kimi-K3 ROCm KDA layer is absent here: no inlined diagnostic to gate",
        "no inlined diagnostic in the KDA layer",
    ),
)

# The shapes, as SITES.md section 3 gives them. HOLE_indices (the index tensor) and HOLE_bound
# (the pool size) carry other names where a caller inlines the diagnostic; HOLE_message (a plain
# string) differs between fork builds. Everything else, down to the `[:8]`, must match.

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
    return f"if {gate}:\n    " + DIAGNOSTIC.strip("\n").replace("\n", "\n    ") + "\n"


FORK_DIAGNOSTIC = Shape(
    "fork diagnostic", Verdict.PENDING, DIAGNOSTIC, "two bool() syncs on every call", FORK_BUILDS
)
APPLIED_DIAGNOSTIC = Shape(
    "k3patch", Verdict.APPLIED, _gated(GATE), f"the diagnostic runs only with {ENV}=1"
)
LEGACY_DIAGNOSTIC = Shape(
    "older anchor script (k3-kda-nosync)",
    Verdict.SATISFIED,
    _gated(LEGACY_GATE),
    f"legacy fix: the diagnostic runs only with {ENV}=1",
    FORK_BUILDS,
)
DIAGNOSTIC_SHAPES = (FORK_DIAGNOSTIC, APPLIED_DIAGNOSTIC, LEGACY_DIAGNOSTIC)

# The fork's guard in gather_initial_states, from the clamp to `indices = _safe_idx`, with the
# diagnostic (in any shape above) third. k3patch never rewrites the other three statements; they
# must be there, unchanged, for any verdict but not applicable.
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
GUARD_FOLDED, GUARD_SCRIPT = (
    Shape(
        f"fork, {how} ({clamp})", Verdict.PENDING, _GUARD.replace("CLAMP", clamp), "", FORK_BUILDS
    )
    for how, clamp in (("folded guard", "clamp_"), ("guard script", "clamp"))
)
GUARD_SHAPES = (GUARD_FOLDED, GUARD_SCRIPT)
GUARD_END = "indices = _safe_idx"
GUARD_NAMES = ("indices", "_n_state_blocks")  # HOLE_indices, HOLE_bound in gather_initial_states

# Names and texts that only the fork's guard (or a fix of it) puts into these functions.
TRACE_NAMES = frozenset({"_n_state_blocks", "_safe_idx", "_bad", "_k3os"})
TRACE_TEXTS = (ENV, "k3-kda")


def _strings(nodes: Iterable[ast.AST]) -> list[str]:
    return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def match_diagnostic(node: ast.stmt, names: tuple[str, str] | None = None) -> Shape | None:
    """The known shape of a diagnostic (bare, gated or legacy-gated), or None. With `names`,
    the index tensor and the pool size must be exactly those names."""
    for shape in DIAGNOSTIC_SHAPES:
        found = shape.match(node)
        if found is None or not _strings([found["HOLE_message"]]):
            continue
        text = holes(found)
        if names is None or (text["HOLE_indices"], text["HOLE_bound"]) == names:
            return shape
    return None


def diagnostic_units(func: ast.FunctionDef) -> list[ast.If]:
    """The `if` statements that are the diagnostic, or a gate around it, in source order: those
    whose test names the variable, and those outside them whose test can sync."""
    ifs = [node for node in walk_scope(func.body) if isinstance(node, ast.If)]
    gates = [node for node in ifs if any(ENV in s for s in _strings(ast.walk(node.test)))]
    inside = {id(n) for gate in gates for n in ast.walk(gate)}
    syncing = [
        node
        for node in ifs
        if id(node) not in inside and sync_points(ast.If(test=node.test, body=[], orelse=[]))
    ]
    return sorted(gates + syncing, key=lambda n: (n.lineno, n.col_offset))


def fork_traces(func: ast.FunctionDef) -> list[str]:
    """What in `func` says a fork's guard or diagnostic was here, in whatever form."""
    nodes = list(walk_scope(func.body))
    names = {n.id for n in nodes if isinstance(n, ast.Name)}
    names |= {a.asname or a.name for n in nodes if isinstance(n, ast.Import) for a in n.names}
    texts = {f"text {t!r}" for s in _strings(nodes) for t in TRACE_TEXTS if t in s}
    return sorted(texts | {f"name {name}" for name in names & TRACE_NAMES})


def os_binding(module: ast.Module) -> str | None:
    """'os' when every top-level binding of `os` imports the os module as `os`, 'other' when
    `os` names something else there, None when the name is free."""
    found = bindings(module.body, "os")
    if not found:
        return None
    imports = [stmt for stmt in found if isinstance(stmt, ast.Import)]
    aliases = [a for s in imports for a in s.names if (a.asname or a.name.split(".")[0]) == "os"]
    plain = all(a.name == "os" or (a.asname is None and a.name.startswith("os.")) for a in aliases)
    return "os" if plain and len(imports) == len(found) else "other"


def _is_k3os_import(node: ast.AST) -> bool:
    return isinstance(node, ast.Import) and any(
        a.name == "os" and a.asname == "_k3os" for a in node.names
    )


Located = tuple[SiteResult, list[ast.If]]  # a site's result, and the diagnostics to gate


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
        return [self.locate(sources, site)[0] for site in SITES]

    def locate(self, sources: Sources, site: Site) -> Located:
        """One site as classify finds it (the rewrite locates it again the same way)."""
        src = sources[site.file]
        func = find_def(src.tree, site.name) if src.exists else None
        if func is None:
            return self.result(site.name, site.file, Verdict.NOT_APPLICABLE, site.absent), []
        if site.guarded:
            return self._locate_guarded(src, site, func)
        units = diagnostic_units(func)
        if units:
            return self._judge(src, site, func, units)
        if fork_traces(func):
            return self._drift(src, site, [func], "fork traces without the diagnostic")
        return self.result(site.name, site.file, Verdict.NOT_APPLICABLE, site.clean), []

    def _locate_guarded(self, src: SourceFile, site: Site, func: ast.FunctionDef) -> Located:
        body = func.body
        start = next((i for i, s in enumerate(body) if bindings([s], "_n_state_blocks")), None)
        if start is None:
            traces = fork_traces(func)
            if not traces and not diagnostic_units(func):
                return self.result(site.name, site.file, Verdict.NOT_APPLICABLE, site.clean), []
            why = "; ".join(traces) or "a syncing test"
            return self._drift(src, site, [func], f"fork traces ({why}) outside the known guard")
        ends = (i for i in range(start, len(body)) if match(GUARD_END, body[i]) is not None)
        run = body[start : next(ends, len(body) - 1) + 1]
        # The older anchor script may put its `import os as _k3os` anywhere in the run.
        core = [s for s in run if not _is_k3os_import(s)]
        guard = next((g for g in GUARD_SHAPES if g.match(core) is not None), None)
        if guard is None or not isinstance(core[2], ast.If):
            return self._drift(src, site, run, "the k3-kda guard is in no known shape")
        result, pending = self._judge(src, site, func, [core[2]])
        if result.verdict is not Verdict.DRIFTED:
            result = replace(result, shape=f"{guard.name}; {result.shape}", line=run[0].lineno)
        return result, pending

    def _judge(
        self, src: SourceFile, site: Site, func: ast.FunctionDef, units: list[ast.If]
    ) -> Located:
        # Inside the guard the index tensor and the pool size are the guard's own names.
        names = GUARD_NAMES if site.guarded else None
        legacy_import = any(map(_is_k3os_import, [*src.tree.body, *walk_scope(func.body)]))
        shapes: list[Shape] = []
        for unit in units:
            shape = match_diagnostic(unit, names)
            if shape is None:
                return self._drift(src, site, [unit], "the diagnostic is in no known shape")
            if shape is LEGACY_DIAGNOSTIC and not legacy_import:
                why = "legacy gate without `import os as _k3os`: NameError on every call"
                return self._drift(src, site, [unit], why)
            shapes.append(shape)
        binding = os_binding(src.tree)
        if APPLIED_DIAGNOSTIC in shapes and binding != "os":
            why = "gated, but the module does not `import os`: NameError"
            return self._drift(src, site, [units[0]], why)
        if FORK_DIAGNOSTIC in shapes and binding == "other":
            why = "the module binds `os` to something else; the gate needs it"
            return self._drift(src, site, [units[0]], why)
        verdict = summarise(s.verdict for s in shapes)
        detail = "; ".join(dict.fromkeys(shape_detail(s, src) for s in shapes))
        result = self.result(
            site.name, site.file, verdict, detail, "; ".join(dict.fromkeys(s.name for s in shapes))
        )
        pending = [u for u, s in zip(units, shapes, strict=True) if s is FORK_DIAGNOSTIC]
        return replace(result, line=units[0].lineno), pending

    def _drift(self, src: SourceFile, site: Site, nodes: list[ast.stmt], why: str) -> Located:
        guards = [f"{g.name} + " for g in GUARD_SHAPES] if site.guarded else [""]
        expected = [f"{g}{d.name} ({d.verdict.value})" for g in guards for d in DIAGNOSTIC_SHAPES]
        found = "\n".join(src.segment(n) for n in nodes)
        result = self.result(
            site.name, site.file, Verdict.DRIFTED, f"{why}; nothing will be written"
        )
        return replace(result, line=nodes[0].lineno, found=found, expected=tuple(expected)), []

    def rewrite(self, sources: Sources, pending: list[SiteResult]) -> dict[str, str]:
        wanted = {(r.site, r.file) for r in pending}
        units: dict[str, list[ast.If]] = {}
        for site in (s for s in SITES if (s.name, s.file) in wanted):
            result, found = self.locate(sources, site)
            if result.verdict is not Verdict.PENDING or not found:
                raise ValueError(f"{site.name}: no longer pending ({result.verdict.value})")
            units.setdefault(site.file, []).extend(found)
        return {rel: gate_diagnostics(sources[rel], found) for rel, found in units.items()}

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


def gate_diagnostics(source: SourceFile, diagnostics: list[ast.If]) -> str:
    """The file with every diagnostic (nodes of its tree) nested under the gate, and
    `import os` added once when the module has none."""
    src = SourceText(source.text)
    edits: list[Edit | None] = [ensure_import(src, source.tree, "os")]
    for node in diagnostics:
        edits += [insert_before(src, node, GATE_COMMENT), nest_under(src, [node], f"if {GATE}:")]
    return apply_edits(source.text, [edit for edit in edits if edit is not None])
