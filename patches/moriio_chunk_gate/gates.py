"""moriio-chunk-gate's sites, read with stdlib ast (fast): the older k3-chunk-gate script's decision
chains (SITES.md 2: found, checked and repaired in place), else the one gate `if`, in a known shape
or a fixed form told by its meaning. Private to this patch."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from k3patch import astkit
from k3patch.astkit import blocks, mentioned_names
from k3patch.fingerprints import Shape, site_fingerprint
from k3patch.shapes import holes, match, search
from k3patch.sources import SourceFile
from k3patch.verdicts import SiteResult, Verdict

from .names import (
    ancestors,
    assigned_name,
    attribute_names,
    loaded_names,
    loops_over,
    outline,
    parent_map,
    temporaries_before,
    unbound_names,
    unset_attributes,
)
from .sites import (
    CLASS,
    FROM_SURROUNDINGS,
    G1,
    G1_TEMPLATE,
    G2,
    G2_TEMPLATE,
    LEGACY_APPLIED,
    LEGACY_DECISION,
    LEGACY_DEFECTS,
    LEGACY_HELPER,
    LEGACY_HELPER_SHAPE,
    LEGACY_PENDING,
    LOOPS,
    METHOD,
    REPAIRED_DECISION,
    SHAPES,
    SWEEP,
    UPSTREAM_HELPER,
    UPSTREAM_HELPER_BODY,
    site_result,
)

if TYPE_CHECKING:
    from k3patch.codemod import Codemod

# Names whose appearance in an `if` test makes it a final-chunk gate.
GATE_WORDS = frozenset({"num_prompt_tokens", UPSTREAM_HELPER, LEGACY_HELPER})


@dataclass
class Context:
    """The method whose gates k3patch reads, its class and its module."""

    module: ast.Module
    method: ast.FunctionDef
    cls: ast.ClassDef

    @classmethod
    def of(cls, module: ast.Module) -> Context:
        method = astkit.find_def(module, f"{CLASS}.{METHOD}")
        klass = astkit.find_class(module, CLASS)
        if method is None or klass is None:
            raise ValueError(f"{CLASS}.{METHOD} is gone")
        return cls(module, method, klass)


def classify_sites(src: SourceFile) -> list[SiteResult]:
    if not src.exists:
        why = "no MoRIIO connector in this vLLM (it first ships in 0.14.1)"
        return [site_result(s, Verdict.NOT_APPLICABLE, why) for s in (G1, G2)]
    if astkit.find_def(src.tree, f"{CLASS}.{METHOD}") is None:
        why = f"moriio_connector.py has no {CLASS}.{METHOD}; the connector was restructured"
        return [site_result(s, Verdict.DRIFTED, why) for s in (G1, G2)]
    context = Context.of(src.tree)
    return [classify_site(context, site) for site in (G1, G2)]


def classify_site(context: Context, site: str) -> SiteResult:
    chains = site_chains(context, site)
    if chains:
        return classify_chains(context, site, chains)
    gate, why = locate(context, site)
    if gate is None:
        return site_result(site, Verdict.DRIFTED, why, line=context.method.lineno)
    return gate.classify(context)


def rewrite_sites(src: SourceFile, pending: list[str], codemod: Codemod) -> None:
    context = Context.of(src.tree)
    for site in pending:
        if classify_site(context, site).verdict is not Verdict.PENDING:
            raise ValueError(f"{site} is no longer pending")
        parts: Sequence[Chain | Gate | None] = site_chains(context, site) or [
            locate(context, site)[0]
        ]
        for part in parts:
            if part is not None:
                part.rewrite(codemod)


# The fork's mamba-blockids edit (SITES.md 1), by its statements: a name alone decides nothing.
_FORK_STARTS_EMPTY = ("self._reqs_save_mamba = {}", "self._reqs_save_mamba: HOLE_type = {}")
_FORK_FILES_BLOCKS = "self._reqs_save_mamba[HOLE_key] = HOLE_value"
_SKIPS_NOT_PENDING = "if req_id not in self._reqs_need_pending_save:\n    continue"
_UNKNOWN = "block-count gates of A-C, in surroundings of no known release"


def release(context: Context) -> str:
    """Where block-count gates of A-C come from, by the G1 loop and its producer branch."""
    g1, _ = locate(context, G1)
    if g1 is None:
        return _UNKNOWN
    around = ancestors(g1.loop, parent_map(context.method))
    tests = [n.test for n in around if isinstance(n, ast.If)]
    write, producer = "self.mode == MoRIIOMode.WRITE", "get_role() == ROLE.PRODUCER"
    both = f"{write} and {producer}"
    held = {t for t in (write, producer, both) for n in tests if match(t, n) is not None}
    nested, combined = {write, producer} <= held, both in held
    if search(_SKIPS_NOT_PENDING, g1.loop):
        if not combined:
            return _UNKNOWN
        return "the fork (shape C gates)" if is_fork(context.cls) else "C (0.28.0-0.29.0)"
    return "A (0.14.1-0.23.0)" if nested else "B (0.24.0-0.27.1)" if combined else _UNKNOWN


def is_fork(cls: ast.ClassDef) -> bool:
    init = astkit.find_method(cls, "__init__")
    alloc = astkit.find_method(cls, "update_state_after_alloc")
    keys = [f["HOLE_key"] for *_, f in search(_FORK_FILES_BLOCKS, alloc)] if alloc else []
    starts = init is not None and any(search(pattern, init) for pattern in _FORK_STARTS_EMPTY)
    return starts and any("request_id" in mentioned_names(key) for key in keys)


def helper_is_upstream(cls: ast.ClassDef) -> bool:
    helper = astkit.find_method(cls, UPSTREAM_HELPER)
    return helper is not None and match(UPSTREAM_HELPER_BODY, helper.body) is not None


def locate(context: Context, site: str) -> tuple[Gate | None, str]:
    found = []
    for loop in loops_over(context.method, LOOPS[site]):
        parents, gates = parent_map(loop), []
        for block in blocks(loop):
            for index, stmt in enumerate(block):
                if not isinstance(stmt, ast.If):
                    continue
                temps = temporaries_before(block, index, stmt.test)
                if any(GATE_WORDS & mentioned_names(n) for n in [stmt.test, *temps]):
                    around = ancestors(stmt, parents, stop=loop)
                    conditions = [n for n in reversed(around) if isinstance(n, ast.stmt)]
                    gates.append(Gate(site, loop, block, temps, stmt, conditions))
        found += [gates] if gates else []
    what = f"a loop over {LOOPS[site]} that holds a final-chunk gate"
    if len(found) != 1:
        return None, f"expected one {what} in {METHOD}, found {len(found)}"
    if len(found[0]) != 1:
        return None, (
            f"expected one final-chunk gate (an `if` on num_prompt_tokens) in {what}, "
            f"found {len(found[0])}"
        )
    return found[0][0], ""


@dataclass
class Gate:
    """A final-chunk gate `if`, the temporaries that feed its test, the statements around it."""

    site: str
    loop: ast.For
    block: list[ast.stmt]
    temps: list[ast.Assign]
    node: ast.If
    conditions: list[ast.stmt]

    def result(self, verdict: Verdict, shape: str, why: str) -> SiteResult:
        inner = [*map(ast.unparse, self.temps), f"if {ast.unparse(self.node.test)}:", "    ..."]
        found = outline(self.conditions, inner)
        return site_result(self.site, verdict, why, shape, self.node.lineno, found)

    def classify(self, context: Context) -> SiteResult:
        shape = next((s for s in SHAPES[self.site] if s.match(self.loop.body) is not None), None)
        if shape is None or shape.verdict is Verdict.DRIFTED:
            why = shape.origin if shape else "the gate is in no shape k3patch knows"
            return self.result(Verdict.DRIFTED, "", f"{why}; nothing will be written")
        if shape.verdict is Verdict.SATISFIED and not helper_is_upstream(context.cls):
            why = (
                f"{shape.name} gate, but self.{UPSTREAM_HELPER} is not upstream's comparison "
                "(req.num_computed_tokens + num_scheduled >= req.num_prompt_tokens)"
            )
            return self.result(Verdict.DRIFTED, "", why)
        problems = [] if shape.verdict is Verdict.SATISFIED else self.preconditions(context, shape)
        if not problems:
            name = release(context) if shape.name == FROM_SURROUNDINGS else shape.name
            return self.result(shape.verdict, name, shape.origin)
        return self.result(Verdict.DRIFTED, "", f"{shape.name} gate, but " + "; ".join(problems))

    def preconditions(self, context: Context, shape: Shape) -> list[str]:
        """Why a gate in a known shape still cannot take (or does not hold) the post-image."""
        problems, pending = [], shape.verdict is Verdict.PENDING
        if pending and "scheduler_output" not in astkit.parameter_names(context.method):
            problems.append(f"{METHOD} has no parameter named scheduler_output")
        bound = astkit.stored_names([self.loop.target])
        needs = {"req_id"} if self.site == G1 else {"req_id", "req"}
        if not needs <= bound:
            problems.append(f"the loop does not bind {', '.join(sorted(needs - bound))}")
        for temp in self.temps if pending else ():
            name = assigned_name(temp)
            if name in loaded_names(self.loop.body, skip=[*self.temps, self.node.test]):
                problems.append(f"{name} is read outside the gate test; it cannot be dropped")
            # The codemod removes a temporary's lines whole: no other statement may be on them.
            end = temp.end_lineno or temp.lineno
            if any(
                s is not temp and s.lineno <= end and temp.lineno <= (s.end_lineno or 0)
                for s in self.block
            ):
                problems.append(f"{name} shares its line with another statement")
        if self.site != G1:
            return problems
        if pending and self.block.index(self.node) == len(self.temps):
            # The branch keeps the statements before the gate; with none it would be empty.
            problems.append("it is all that `if new_block_ids is not None:` holds")
        # G1's body runs outside `if new_block_ids is not None:` after the rewrite, so it must
        # not read what only that branch binds (`req` is rebound by the post-image).
        if pending:  # the gate's block is the body of that branch; what its test reads counts
            local = astkit.stored_names(self.block[: self.block.index(self.node)])
            local |= loaded_names(self.conditions[:1], skip=self.block)
        else:
            before = self.loop.body[: self.loop.body.index((self.conditions or [self.node])[0])]
            ifs = [s for s in before if isinstance(s, ast.If)]
            branches = [s for s in ifs if "new_block_ids" in mentioned_names(s.test)]
            local = astkit.stored_names([s for branch in branches for s in branch.body])
        read = loaded_names(self.node.body + self.node.orelse) & (local - {"req"})
        if read:
            problems.append(
                "its body reads " + ", ".join(sorted(read)) + ", bound only when the step "
                "allocated a block"
            )
        return problems

    def rewrite(self, codemod: Codemod) -> None:
        """The temporaries go and the header becomes the post-image's; G1's gate also leaves
        `if new_block_ids is not None:` for a guard after it, run for every pending request."""
        from .rewrite import new_header, under_guard  # libcst: only when rewriting

        for temp in self.temps:
            codemod.remove(temp)
        if self.site == G1:
            codemod.change(self.conditions[0], under_guard(G1_TEMPLATE))
        else:
            codemod.change(self.node, new_header(G2_TEMPLATE))


# A decision chain: `NAME = <the script's helper call or k3patch's repair>`, `if NAME is None:`
# (its fallback), debug `if`s, then `if [not] NAME:`.
LEGACY_MAP = "_k3_prog"
LEGACY_TEMPLATE = """
# k3patch moriio-chunk-gate: final when compute progress reaches
# the prompt; no slack (it sent up to 2 tokens early) and no
# block-count fallback (the original bug).
{name} = (
    {req}.num_computed_tokens
    + scheduler_output.num_scheduled_tokens.get({req_id}, 0)
    >= {req}.num_prompt_tokens
)
"""
# The repaired decision about `req`, as a report shows it (without its `x = `).
_REPAIRED = ast.unparse(ast.parse(LEGACY_TEMPLATE.format(name="x", req="req", req_id="req_id")))[4:]
# The block-count fallback each site's older form keeps, as the script writes it.
LEGACY_FALLBACK = {
    G1: "len(self._reqs_need_pending_save[req_id][1]) * self.block_size >= req.num_prompt_tokens",
    G2: "not (req.num_prompt_tokens > len(block_ids) * self.block_size)",
}


@dataclass
class Chain:
    part: str  # "gate" or "sweep"
    loop: ast.For
    block: list[ast.stmt]
    name: str
    decision: ast.Assign
    fallback: ast.If | None
    gate: ast.If

    @classmethod
    def at(cls, loop: ast.For, block: list[ast.stmt], index: int, part: str) -> Chain | None:
        decision, name = block[index], assigned_name(block[index])
        if not isinstance(decision, ast.Assign) or name is None:
            return None
        if not {LEGACY_HELPER, "num_prompt_tokens"} & mentioned_names(decision.value):
            return None
        after = block[index + 1 :]
        end = next((i for i, s in enumerate(after) if not isinstance(s, ast.If)), len(after))
        ifs = [s for s in after[:end] if isinstance(s, ast.If)]
        fallback = ifs.pop(0) if ifs and match(f"{name} is None", ifs[0].test) is not None else None
        while ifs and "K3_CHUNK_GATE_DEBUG" in mentioned_names(ifs[0].test, everything=True):
            ifs.pop(0)
        if not ifs or all(match(t, ifs[0].test) is None for t in (name, f"not {name}")):
            return None
        return cls(part, loop, block, name, decision, fallback, ifs[0])

    @property
    def statements(self) -> list[ast.stmt]:
        return self.block[self.block.index(self.decision) : self.block.index(self.gate) + 1]

    @property
    def request(self) -> tuple[str, str] | None:
        """The request id and request named in the script's `_k3_prefill_done(self, id, req)`."""
        found = holes(match(LEGACY_DECISION, self.decision.value) or {})
        names = (found.get("HOLE_req_id", ""), found.get("HOLE_req", ""))
        return names if all(n.isidentifier() for n in names) else None

    def kind(self) -> str:
        """ "legacy" (the script's helper call), "progress" (k3patch's repair) or "other"."""
        if self.request is not None:
            return "legacy"
        return "progress" if match(REPAIRED_DECISION, self.decision.value) is not None else "other"

    def rewrite(self, codemod: Codemod) -> None:
        """The decision replaced in place by compute progress; an `is None` fallback goes.
        Helper, map and debug lines stay: nothing reads them to decide any more."""
        if self.request is None:
            raise ValueError(f"{self.name}: a decision chain without its request names")
        req_id, req = self.request
        source = LEGACY_TEMPLATE.format(name=self.name, req=req, req_id=req_id)
        stmts = [self.decision] if self.fallback is None else [self.decision, self.fallback]
        codemod.replace(stmts, source)


def site_chains(context: Context, site: str) -> list[Chain] | None:
    """The site's decision chains (G1: its gate and its sweep; G2: its gate), or None."""

    def chains_in(roots: list[ast.For], part: str) -> list[Chain]:
        found = (Chain.at(r, b, i, part) for r in roots for b in blocks(r) for i in range(len(b)))
        return [chain for chain in found if chain is not None]

    own = loops_over(context.method, LOOPS[site])
    gates = chains_in(own, "gate")
    if not gates or site == G2:
        return gates or None
    sweeps = [loop for loop in loops_over(context.method, SWEEP) if loop not in own]
    return [*gates, *chains_in(sweeps, "sweep")]


def classify_chains(context: Context, site: str, chains: list[Chain]) -> SiteResult:
    line = next((c for c in chains if c.part == "gate"), chains[0]).decision.lineno
    problems = _chain_problems(context, site, chains)
    if problems:
        detail = f"the older k3-chunk-gate form, but {'; '.join(problems)}; nothing will be written"
        found = "\n".join(ast.unparse(ast.Module(c.statements, [])) for c in chains)
        return site_result(site, Verdict.DRIFTED, detail, "", line, found)
    if {c.kind() for c in chains} == {"legacy"}:
        return site_result(site, Verdict.PENDING, "; ".join(LEGACY_DEFECTS), LEGACY_PENDING, line)
    detail = "compute progress, no slack, no fallback"
    return site_result(site, Verdict.APPLIED, detail, LEGACY_APPLIED, line)


def _chain_problems(context: Context, site: str, chains: list[Chain]) -> list[str]:
    gates = [c for c in chains if c.part == "gate"]
    sweeps = [c for c in chains if c.part == "sweep"]
    if len(gates) != 1:
        return [f"{len(gates)} decision chains in the site's loop (the script writes one)"]
    if site == G1 and len(sweeps) != 1:
        return [
            f"{len(sweeps)} sweeps over _reqs_need_pending_save after the G1 loop (the script "
            "writes one; without it a final chunk that allocates no block is never sent)"
        ]
    kinds = {c.kind() for c in chains}
    if "other" in kinds:
        return [
            f"a decision that is neither the script's helper call nor `{_REPAIRED}` (inverted, "
            "off-by-one or another slack)"
        ]
    if len(kinds) != 1:
        return ["the gate and the sweep decide differently (partly repaired)"]
    problems = []
    legacy = kinds == {"legacy"}
    for chain in chains:
        # G1's gate sends when the prompt is done; G2's gate and the sweep defer or skip.
        wanted = chain.name if (site, chain.part) == (G1, "gate") else f"not {chain.name}"
        if match(wanted, chain.gate.test) is None:
            problems.append(f"`{ast.unparse(chain.gate.test)}` is inverted for what its body does")
        if chain.part == "sweep" and [type(s) for s in chain.gate.body] != [ast.Continue]:
            problems.append("the sweep's gate does not skip the request")
    for chain in chains:
        fallback = chain.fallback
        if not legacy and fallback is not None:
            problems.append(f"`if {chain.name} is None:` is left beside a progress decision")
        elif legacy and chain.part == "sweep" and fallback is not None:
            problems.append("the sweep has a fallback the script never writes")
        elif legacy and chain.part == "gate":
            expected = LEGACY_FALLBACK[site]
            pattern = f"if {chain.name} is None:\n    {chain.name} = {expected}"
            if fallback is None or match(pattern, fallback) is None:
                problems.append(f"its fallback is not the block count `{expected}`")
    # The helper and the progress map the script's decisions rely on.
    helpers = [n for n in context.module.body if isinstance(n, ast.FunctionDef)]
    prints = [site_fingerprint(n) for n in helpers if n.name == LEGACY_HELPER]
    if legacy and prints != [LEGACY_HELPER_SHAPE.fingerprint]:
        problems.append(
            f"the module's {LEGACY_HELPER}() is not the script's (missing, defined twice, or "
            "its comparison edited)"
        )
    if legacy and LEGACY_MAP not in attribute_names([context.method], "self", ast.Store):
        problems.append(f"{METHOD} never sets self.{LEGACY_MAP}, which {LEGACY_HELPER}() reads")
    # Names the chains read that nothing binds: the script's debug `if` reads `os` at module
    # level, its sweep reads maps that other older scripts add to the scheduler. Either raises
    # when a chunked request comes (the sweep's inside its `try`: the request is never sent).
    statements = [s for c in chains for s in c.statements]
    free = unbound_names(statements, context.module, context.method)
    if free:
        problems.append(
            "it reads " + ", ".join(sorted(free)) + ", which moriio_connector.py never binds"
        )
    unset = unset_attributes([c.loop for c in sweeps], context.cls)  # G2 has no sweep
    if unset:
        problems.append(
            "its sweep reads self." + ", self.".join(sorted(unset)) + f", which {CLASS} never sets "
            "(it raises inside the sweep's try and the request is never sent)"
        )
    return problems
