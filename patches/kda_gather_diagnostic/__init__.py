"""kda-gather-diagnostic: the KDA state-index diagnostic syncs the GPU only when asked to.

Symptom: a long prompt looks hung (at 750K tokens, about 25,000 GPU stream drains in the prefill).
Cause: the Kimi-K3 fork's "k3-kda guard" in `gather_initial_states` (inlined by some fork builds
in `chunk_kda_prefill` and `KimiK3DeltaAttention._forward`) clamps the state indices on the device,
then logs under `if bool((indices >= n).any()) or bool((indices < 0).any()):`; each `bool()` waits
for every queued kernel, once per KDA layer per prefill chunk.
Fix: that `if` goes under `if os.environ.get("K3_KDA_GATHER_LOG", "0") == "1":`; the clamp stays.
Check: `k3patch verify` finds every sync-capable call of each site inside the gate and traces a
CPU run of `gather_initial_states`: no sync while unset, the bad index logged at =1, rows clamped.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from typing import TYPE_CHECKING

import k3patch.astkit as astkit
from k3patch.fingerprints import Shape, shape_detail
from k3patch.patch import Patch, ProbeOutcome
from k3patch.shapes import holes, match
from k3patch.sources import SourceFile, Sources
from k3patch.verdicts import SiteResult, Verdict, summarise

from .sites import (
    APPLIED_DIAGNOSTIC,
    DIAGNOSTIC_SHAPES,
    FORK_DIAGNOSTIC,
    GATE,
    GATE_COMMENT,
    GUARD_END,
    GUARD_NAMES,
    GUARD_SHAPES,
    KDA_FILE,
    LEGACY_DIAGNOSTIC,
    OPS_FILE,
    OPS_MODULE,
    PREFILL_FILE,
    SITES,
    Site,
)
from .syncs import ENV, sync_points

if TYPE_CHECKING:
    from k3patch.codemod import Codemods


def match_diagnostic(node: ast.stmt, names: tuple[str, str] | None = None) -> Shape | None:
    """The known shape of a diagnostic (bare, gated or legacy-gated), or None; with `names`, the
    index tensor and the pool size must be those."""
    for shape in DIAGNOSTIC_SHAPES:
        found = shape.match(node)
        text = holes(found) if found and string_constants([found["HOLE_message"]]) else {}
        if text and names in (None, (text["HOLE_indices"], text["HOLE_bound"])):
            return shape
    return None


def diagnostic_units(func: ast.FunctionDef) -> list[ast.If]:
    """The `if`s that are the diagnostic or a gate around it, in source order: those whose test
    names the variable, and those outside them whose test can sync."""
    ifs = [node for node in astkit.walk(func, scope=True) if isinstance(node, ast.If)]
    gates = [n for n in ifs if any(ENV in s for s in string_constants(ast.walk(n.test)))]
    inside = {id(n) for gate in gates for n in ast.walk(gate)}
    syncing = [n for n in ifs if id(n) not in inside and sync_points(ast.If(n.test, [], []))]
    return sorted(gates + syncing, key=lambda n: (n.lineno, n.col_offset))


def fork_traces(func: ast.FunctionDef) -> list[str]:
    """The names and texts in `func` that only a fork's guard (or a fix of it) puts there."""
    nodes = list(astkit.walk(func, scope=True))
    names = {n.id for n in nodes if isinstance(n, ast.Name)}
    names |= {name for n in nodes if isinstance(n, ast.Import) for name in astkit.imported_names(n)}
    strings = string_constants(nodes)
    found = [f"name {n}" for n in names & {"_n_state_blocks", "_safe_idx", "_bad", "_k3os"}]
    return sorted(found + [f"text {t!r}" for t in (ENV, "k3-kda") if any(t in s for s in strings)])


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
        func = astkit.find_def(src.tree, site.name) if src.exists else None
        if func is None:
            return self.result(site.name, site.file, Verdict.NOT_APPLICABLE, site.absent), []
        body, guarded = func.body, site.file == OPS_FILE
        blocks = (i for i, s in enumerate(body) if astkit.bindings([s], "_n_state_blocks"))
        start = next(blocks, None) if guarded else None
        if start is None:
            units = diagnostic_units(func)
            if units and not guarded:
                return self._judge(src, site, func, units)
            traces = fork_traces(func)
            if not units and not traces:
                return self.result(site.name, site.file, Verdict.NOT_APPLICABLE, site.clean), []
            why = "fork traces without the diagnostic"
            if guarded:
                traced = "; ".join(traces) or "a syncing test"
                why = f"fork traces ({traced}) outside the known guard"
            return self._drift(src, site, [func], why)
        ends = (i for i in range(start, len(body)) if match(GUARD_END, body[i]) is not None)
        run = body[start : next(ends, len(body) - 1) + 1]
        # The older anchor script may put its `import os as _k3os` anywhere in the run.
        core = [s for s in run if imported_module([s], "_k3os") != "os"]
        guard = next((g for g in GUARD_SHAPES if g.match(core) is not None), None)
        if guard is None or not isinstance(core[2], ast.If):
            return self._drift(src, site, run, "the k3-kda guard is in no known shape")
        result, pending = self._judge(src, site, func, [core[2]])
        if result.verdict is not Verdict.DRIFTED:
            result = result._replace(shape=f"{guard.name}; {result.shape}", line=run[0].lineno)
        return result, pending

    def _judge(
        self, src: SourceFile, site: Site, func: ast.FunctionDef, units: list[ast.If]
    ) -> Located:
        # Inside the guard the index tensor and the pool size are the guard's own names.
        names = GUARD_NAMES if site.file == OPS_FILE else None
        shapes = [match_diagnostic(unit, names) for unit in units]
        scope = [*src.tree.body, *astkit.walk(func, scope=True)]
        k3os = {imported_module([s], "_k3os") for s in scope if isinstance(s, ast.Import)}
        for unit, shape in zip(units, shapes, strict=True):
            if shape is None:
                return self._drift(src, site, [unit], "the diagnostic is in no known shape")
            if shape is LEGACY_DIAGNOSTIC and "os" not in k3os:
                why = "legacy gate without `import os as _k3os`: NameError on every call"
                return self._drift(src, site, [unit], why)
        os_module = imported_module(src.tree.body, "os")
        if APPLIED_DIAGNOSTIC in shapes and os_module != "os":
            why = "gated, but the module does not `import os`: NameError"
            return self._drift(src, site, [units[0]], why)
        if FORK_DIAGNOSTIC in shapes and os_module not in (None, "os"):
            why = "the module binds `os` to something else; the gate needs it"
            return self._drift(src, site, [units[0]], why)
        known = [s for s in shapes if s is not None]
        verdict = summarise(s.verdict for s in known)
        detail = "; ".join(dict.fromkeys(shape_detail(s, src) for s in known))
        named = "; ".join(dict.fromkeys(s.name for s in known))
        result = self.result(site.name, site.file, verdict, detail, named)
        pending = [u for u, s in zip(units, shapes, strict=True) if s is FORK_DIAGNOSTIC]
        return result._replace(line=units[0].lineno), pending

    def _drift(self, src: SourceFile, site: Site, nodes: list[ast.stmt], why: str) -> Located:
        """Drifted: `why`, the source of `nodes` as found (at the first one's line), and the
        shapes expected."""
        guards = [f"{g.name} + " for g in GUARD_SHAPES] if site.file == OPS_FILE else [""]
        expected = [f"{g}{d.name} ({d.verdict.value})" for g in guards for d in DIAGNOSTIC_SHAPES]
        found = "\n".join(src.segment(node) for node in nodes)
        why = f"{why}; nothing will be written"
        line = nodes[0].lineno
        return SiteResult.drift(self.id, site.name, site.file, why, line, found, expected), []

    def rewrite(self, sources: Sources, pending: list[SiteResult], files: Codemods) -> None:
        """Each diagnostic moves in under the gate, GATE_COMMENT above it; a module without
        `import os` gets one. Every other statement stays as it was."""
        wanted = {(r.site, r.file) for r in pending}
        for site in (s for s in SITES if (s.name, s.file) in wanted):
            result, found = self.locate(sources, site)
            if result.verdict is not Verdict.PENDING or not found:
                raise ValueError(f"{site.name}: no longer pending ({result.verdict.value})")
            codemod = files[site.file]
            # Pending means `os` is unbound or `import os`; AddImportsVisitor sees only the
            # first import block, so an `import os` further down would be written again.
            if imported_module(sources[site.file].tree.body, "os") is None:
                codemod.ensure_import("os")
            for node in found:
                codemod.insert_before(node, GATE_COMMENT)
                codemod.nest_under([node], f"if {GATE}:")

    def probe(self) -> ProbeOutcome:
        from .probe import probe_no_sync_unless_asked

        return probe_no_sync_unless_asked()


def string_constants(nodes: Iterable[ast.AST]) -> list[str]:
    """The values of the string constants among `nodes` (not under them), in order."""
    return [n.value for n in nodes if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def imported_module(body: Iterable[ast.stmt], name: str) -> str | None:
    """The module `name` stands for where each statement of the scope `body` binding it imports
    one module (`import os.path`: "os", `import posix as os`: "posix"); "" when anything else
    binds it too (a def, an assignment, `from m import name`, a second module); None: unbound."""
    found = astkit.bindings(body, name)
    if not found:
        return None
    modules = {
        alias.name if alias.asname else alias.name.split(".")[0]
        for stmt in found
        if isinstance(stmt, ast.Import)
        for alias in stmt.names
        if (alias.asname or alias.name.split(".")[0]) == name
    }
    plain = len(modules) == 1 and all(isinstance(stmt, ast.Import) for stmt in found)
    return modules.pop() if plain else ""


PATCH = KdaGatherDiagnostic()
