"""The older k3-chunk-gate script's form (apply_kimik3_chunk_gate_fix.py): decision chains,
what is wrong with them, and their repair in place."""

from __future__ import annotations

import ast
import builtins
from dataclasses import dataclass

from k3patch.edits import Edit, SourceText, replace
from k3patch.model import (
    SiteResult,
    Verdict,
    attribute_names,
    loaded_names,
    mentioned_names,
    runtime_module_names,
    site_fingerprint,
    stored_names,
)
from k3patch.shapes import blocks, match

from . import (
    CLASS,
    G1,
    G2,
    LEGACY_APPLIED,
    LEGACY_DEBUG,
    LEGACY_DEFECTS,
    LEGACY_FALLBACK,
    LEGACY_HELPER,
    LEGACY_HELPER_SHAPE,
    LEGACY_MAP,
    LEGACY_PENDING,
    LEGACY_REPAIR,
    MARKER_LEGACY,
    METHOD,
)
from .gates import (
    FINAL,
    NOT_FINAL,
    Context,
    calls,
    flip,
    loops,
    needed_meaning,
    negated,
    progress_meaning,
    site_result,
)

# --------------------------------------------------------------------------------------------
# The older k3-chunk-gate script's form: decision chains. A chain is `NAME = <decision>`, an
# optional `if NAME is None: NAME = <fallback>`, the script's debug `if`s, and the gate
# `if NAME:` (it sends) or `if not NAME:` (it defers or skips). The decision is the script's
# helper call (pending: it carries the slack and the fallback) or k3patch's progress
# comparison (applied: the repair in place).


@dataclass
class Chain:
    part: str  # "gate" or "sweep" (G1's post-loop pass over the pending requests)
    block: list[ast.stmt]
    index: int  # of the decision in block
    name: str
    decision: ast.Assign
    fallback: ast.If | None
    debug: list[ast.If]
    gate: ast.If

    @property
    def statements(self) -> list[ast.stmt]:
        last = self.block.index(self.gate)
        return self.block[self.index : last + 1]

    def kind(self) -> str:
        """ "legacy" (the script's helper), "progress" (k3patch's repair) or "other"."""
        value = self.decision.value
        if calls(value, LEGACY_HELPER) and isinstance(value, ast.Call):
            if len(value.args) == 3 and all(isinstance(a, ast.Name) for a in value.args):
                return "legacy"
            return "other"
        if progress_meaning(value, {}) == FINAL:
            return "progress"
        return "other"

    def request_names(self) -> tuple[str, str] | None:
        """(request, request id) the decision is about."""
        value = self.decision.value
        if isinstance(value, ast.Call) and len(value.args) == 3:
            req_id, req = value.args[1], value.args[2]
            if isinstance(req_id, ast.Name) and isinstance(req, ast.Name):
                return req.id, req_id.id
        return None

    def gate_meaning(self) -> str:
        """What the gate's test makes of the decision ("final" when it is the bare name)."""
        return flip(FINAL, negated(self.gate.test)[1])

    def found(self) -> str:
        return ast.unparse(ast.Module(body=self.statements, type_ignores=[]))


def _is_name(expr: ast.expr, name: str) -> bool:
    return isinstance(expr, ast.Name) and expr.id == name


def _chains_in(root: ast.stmt, part: str) -> list[Chain]:
    found = (_chain_at(block, i, part) for block in blocks(root) for i in range(len(block)))
    return [chain for chain in found if chain is not None]


def _chain_at(block: list[ast.stmt], index: int, part: str) -> Chain | None:
    stmt = block[index]
    if not (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
    ):
        return None
    name = stmt.targets[0].id
    value_words = mentioned_names(stmt.value)
    if not (calls(stmt.value, LEGACY_HELPER) or "num_prompt_tokens" in value_words):
        return None
    j = index + 1
    fallback = None
    if j < len(block) and isinstance(block[j], ast.If):
        test = block[j].test  # type: ignore[attr-defined]
        if (
            isinstance(test, ast.Compare)
            and _is_name(test.left, name)
            and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Is)
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None
        ):
            fallback = block[j]
            j += 1
    debug: list[ast.If] = []
    while j < len(block):
        candidate = block[j]
        if not (
            isinstance(candidate, ast.If)
            and LEGACY_DEBUG in mentioned_names(candidate.test, everything=True)
        ):
            break
        debug.append(candidate)
        j += 1
    if j >= len(block):
        return None
    gate = block[j]
    if not isinstance(gate, ast.If) or not _is_name(negated(gate.test)[0], name):
        return None
    assert fallback is None or isinstance(fallback, ast.If)
    return Chain(part, block, index, name, stmt, fallback, debug, gate)


def site_chains(context: Context, site: str) -> list[Chain] | None:
    """The site's decision chains (G1: its gate and its sweep; G2: its gate), or None when the
    site's loop holds none (the gate forms of upstream, the fork and k3patch)."""
    attribute = "scheduled_cached_reqs" if site == G1 else "_reqs_need_save"
    own = loops(context.method, attribute)
    gates = [c for loop in own for c in _chains_in(loop, "gate")]
    if not gates:
        return None
    if site == G2:
        return gates
    sweeps = [
        c
        for loop in loops(context.method, "_reqs_need_pending_save")
        if loop not in own
        for c in _chains_in(loop, "sweep")
    ]
    return [*gates, *sweeps]


def classify_chains(context: Context, site: str, chains: list[Chain]) -> SiteResult:
    gates = [c for c in chains if c.part == "gate"]
    sweeps = [c for c in chains if c.part == "sweep"]
    first = gates[0] if gates else chains[0]

    def result(verdict: Verdict, shape: str, detail: str) -> SiteResult:
        found = "\n".join(c.found() for c in chains)
        return site_result(site, verdict, detail, shape, first.decision.lineno, found)

    problems = _chain_problems(context, site, gates, sweeps)
    if problems:
        return result(
            Verdict.DRIFTED,
            "",
            "the older k3-chunk-gate form, but "
            + "; ".join(problems)
            + "; nothing will be written",
        )
    if {c.kind() for c in chains} == {"legacy"}:
        return result(Verdict.PENDING, LEGACY_PENDING, "; ".join(LEGACY_DEFECTS))
    return result(Verdict.APPLIED, LEGACY_APPLIED, "compute progress, no slack, no fallback")


def _chain_problems(
    context: Context, site: str, gates: list[Chain], sweeps: list[Chain]
) -> list[str]:
    """Why a decision chain is in no form the script or k3patch's repair leaves."""
    if len(gates) != 1:
        return [f"{len(gates)} decision chains in the site's loop (the script writes one)"]
    if site == G1 and len(sweeps) != 1:
        return [
            f"{len(sweeps)} sweeps over _reqs_need_pending_save after the G1 loop (the script "
            "writes one; without it a final chunk that allocates no block is never sent)"
        ]
    chains = [*gates, *sweeps]
    kinds = {c.kind() for c in chains}
    if "other" in kinds:
        return [
            "a decision that is neither the script's helper call nor "
            f"`{LEGACY_REPAIR.format(req='req', req_id='req_id')}` (inverted, off-by-one or "
            "another slack)".replace("\n", " ")
        ]
    if len(kinds) != 1:
        return ["the gate and the sweep decide differently (partly repaired)"]
    problems = []
    for chain in chains:
        wanted = NOT_FINAL if chain.part == "sweep" else needed_meaning(chain.gate)
        if chain.gate_meaning() != wanted:
            problems.append(f"`{ast.unparse(chain.gate.test)}` is inverted for what its body does")
        if chain.part == "sweep" and not (
            len(chain.gate.body) == 1 and isinstance(chain.gate.body[0], ast.Continue)
        ):
            problems.append("the sweep's gate does not skip the request")
    legacy = kinds == {"legacy"}
    for chain in chains:
        fallback = chain.fallback
        if not legacy:
            if fallback is not None:
                problems.append(f"`if {chain.name} is None:` is left beside a progress decision")
            continue
        if chain.part == "sweep":
            if fallback is not None:
                problems.append("the sweep has a fallback the script never writes")
            continue
        expected = LEGACY_FALLBACK[site]
        pattern = f"if {chain.name} is None:\n    {chain.name} = {expected}"
        if fallback is None or match(pattern, fallback) is None:
            problems.append(f"its fallback is not the block count `{expected}`")
    if legacy:
        problems.extend(_legacy_support_problems(context))
    problems.extend(_unbound_problems(context, chains))
    return problems


def _legacy_support_problems(context: Context) -> list[str]:
    """The helper and the progress map the script's decisions rely on."""
    helpers = [
        node
        for node in context.module.body
        if isinstance(node, ast.FunctionDef) and node.name == LEGACY_HELPER
    ]
    problems = []
    if len(helpers) != 1 or site_fingerprint(helpers[0]) != LEGACY_HELPER_SHAPE.fingerprint:
        problems.append(
            f"the module's {LEGACY_HELPER}() is not the script's (missing, defined twice, or "
            "its comparison edited)"
        )
    if not any(
        isinstance(node, ast.Attribute)
        and node.attr == LEGACY_MAP
        and isinstance(node.ctx, ast.Store)
        for node in ast.walk(context.method)
    ):
        problems.append(f"{METHOD} never sets self.{LEGACY_MAP}, which {LEGACY_HELPER}() reads")
    return problems


def _unbound_problems(context: Context, chains: list[Chain]) -> list[str]:
    """Names the chains read that nothing binds: the script's debug `if` reads `os` at module
    level, its sweep reads maps that other older scripts add to the scheduler. Either raises
    when a chunked request comes (the sweep's inside its `try`: the request is never sent)."""
    problems = []
    bound = (
        runtime_module_names(context.module)
        | set(dir(builtins))
        | stored_names([context.method])
        | context.params()
        | {
            (alias.asname or alias.name).split(".")[0]
            for node in ast.walk(context.method)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
    )
    stmts = [s for c in chains for s in c.statements]
    free = loaded_names(stmts) - bound
    if free:
        problems.append(
            "it reads " + ", ".join(sorted(free)) + ", which moriio_connector.py never binds"
        )
    sweep_roots: list[ast.AST] = [
        loop
        for loop in loops(context.method, "_reqs_need_pending_save")
        if any(c.part == "sweep" and c.decision in ast.walk(loop) for c in chains)
    ]
    methods = {
        n.name for n in context.cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    unset = sorted(
        attribute_names(sweep_roots, "self", ast.Load)
        - attribute_names([context.cls], "self", ast.Store)
        - methods
    )
    if unset:
        problems.append(
            "its sweep reads self." + ", self.".join(unset) + f", which {CLASS} never sets "
            "(it raises inside the sweep's try and the request is never sent)"
        )
    return problems


def repair_edits(src: SourceText, chains: list[Chain]) -> list[Edit]:
    """The older form's decisions replaced in place by compute progress; each `is None`
    fallback goes. Helper, map and debug lines stay: nothing reads them to decide any more."""
    edits = []
    for chain in chains:
        names = chain.request_names()
        if names is None:
            raise ValueError(f"{chain.name}: a decision chain without its request names")
        req, req_id = names
        progress = LEGACY_REPAIR.format(req=req, req_id=req_id).split("\n")
        source = "\n".join(
            [*MARKER_LEGACY, f"{chain.name} = (", *(f"    {line}" for line in progress), ")"]
        )
        stmts: list[ast.stmt] = [chain.decision]
        if chain.fallback is not None:
            stmts.append(chain.fallback)
        edits.append(replace(src, stmts, source))
    return edits
