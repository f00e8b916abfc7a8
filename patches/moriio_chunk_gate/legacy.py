"""moriio-chunk-gate on the older k3-chunk-gate script's decision chains (SITES.md 2): found,
checked and repaired in place."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import TYPE_CHECKING

from k3patch.astkit import mentioned_names
from k3patch.fingerprints import site_fingerprint
from k3patch.shapes import blocks, match
from k3patch.verdicts import SiteResult, Verdict

from . import (
    CLASS,
    G1,
    G2,
    LEGACY_APPLIED,
    LEGACY_DEFECTS,
    LEGACY_HELPER,
    LEGACY_HELPER_SHAPE,
    LEGACY_PENDING,
    LOOPS,
    METHOD,
    SWEEP,
    names,
    site_result,
)
from .names import Context

if TYPE_CHECKING:
    from k3patch.codemod import Codemod


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
        decision, name = block[index], names.assigned_name(block[index])
        if not isinstance(decision, ast.Assign) or name is None:
            return None
        helper_call = names.is_call_to(decision.value, LEGACY_HELPER)
        if not (helper_call or "num_prompt_tokens" in mentioned_names(decision.value)):
            return None
        after = block[index + 1 :]
        end = next((i for i, s in enumerate(after) if not isinstance(s, ast.If)), len(after))
        ifs = [s for s in after[:end] if isinstance(s, ast.If)]
        fallback = ifs.pop(0) if ifs and match(f"{name} is None", ifs[0].test) is not None else None
        while ifs and "K3_CHUNK_GATE_DEBUG" in mentioned_names(ifs[0].test, everything=True):
            ifs.pop(0)
        if not ifs or match(name, names.strip_nots(ifs[0].test)[0]) is None:
            return None
        return cls(part, loop, block, name, decision, fallback, ifs[0])

    @property
    def statements(self) -> list[ast.stmt]:
        return self.block[self.block.index(self.decision) : self.block.index(self.gate) + 1]

    @property
    def request(self) -> tuple[str, str] | None:
        """The request id and request named in the script's `_k3_prefill_done(self, id, req)`."""
        value = self.decision.value
        args = value.args if names.is_call_to(value, LEGACY_HELPER) else []
        ids = [a.id for a in args if isinstance(a, ast.Name)]
        return (ids[1], ids[2]) if len(args) == len(ids) == 3 else None

    def kind(self) -> str:
        """ "legacy" (the script's helper call), "progress" (k3patch's repair) or "other"."""
        if self.request is not None:
            return "legacy"
        return (
            "progress"
            if names.progress_meaning(self.decision.value, {}) == names.FINAL
            else "other"
        )

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

    own = names.loops_over(context.method, LOOPS[site])
    gates = chains_in(own, "gate")
    if not gates or site == G2:
        return gates or None
    sweeps = [loop for loop in names.loops_over(context.method, SWEEP) if loop not in own]
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
        wanted = names.NOT_FINAL if chain.part == "sweep" else names.needed_meaning(chain.gate)
        if names.flip(names.FINAL, names.strip_nots(chain.gate.test)[1]) != wanted:
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
    if legacy and LEGACY_MAP not in names.attribute_names([context.method], "self", ast.Store):
        problems.append(f"{METHOD} never sets self.{LEGACY_MAP}, which {LEGACY_HELPER}() reads")
    # Names the chains read that nothing binds: the script's debug `if` reads `os` at module
    # level, its sweep reads maps that other older scripts add to the scheduler. Either raises
    # when a chunked request comes (the sweep's inside its `try`: the request is never sent).
    statements = [s for c in chains for s in c.statements]
    free = names.unbound_names(statements, context.module, context.method)
    if free:
        problems.append(
            "it reads " + ", ".join(sorted(free)) + ", which moriio_connector.py never binds"
        )
    unset = names.unset_attributes([c.loop for c in sweeps], context.cls)  # G2 has no sweep
    if unset:
        problems.append(
            "its sweep reads self." + ", self.".join(sorted(unset)) + f", which {CLASS} never sets "
            "(it raises inside the sweep's try and the request is never sent)"
        )
    return problems
