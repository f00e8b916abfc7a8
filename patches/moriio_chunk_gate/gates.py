"""How moriio-chunk-gate reads and rewrites its sites (stdlib ast only, to stay fast): the older
script's decision chains, else the one gate `if`: a known shape, or a fixed form by its meaning.
A rewrite hands the statements it found to the file's `Codemod` (libcst only in rewrite.py)."""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from k3patch import model
from k3patch.model import SiteResult, SourceFile, Verdict, loaded_names, mentioned_names
from k3patch.shapes import blocks, match, search

from . import (
    CLASS,
    FILE,
    FROM_SURROUNDINGS,
    G1,
    G1_TEMPLATE,
    G2,
    G2_TEMPLATE,
    LEGACY_DEFECTS,
    LEGACY_HELPER,
    LEGACY_HELPER_SHAPE,
    METHOD,
    SHAPES,
)

if TYPE_CHECKING:
    from k3patch.codemod import Codemod

# The forms told by predicate, not by a skeleton: upstream's, inline, and the older script's.
UPSTREAM_HELPER = "_is_final_prefill_chunk"
SATISFIED_UPSTREAM = "upstream fix (_is_final_prefill_chunk, 0.32.0 and later)"
SATISFIED_INLINE = "upstream-style progress gate (inline)"
LEGACY_PENDING = "older k3-chunk-gate script (legacy, defective)"
LEGACY_APPLIED = "k3patch (the older k3-chunk-gate form, repaired in place)"
# What a drift report says a site may be in, after its shapes.
FIXED_FORMS = (
    f"{SATISFIED_UPSTREAM} (satisfied)",
    f"{SATISFIED_INLINE} (satisfied)",
    f"{LEGACY_PENDING} (pending)",
    f"{LEGACY_APPLIED} (applied)",
)
LOOPS = {G1: "scheduler_output.scheduled_cached_reqs", G2: "self._reqs_need_save"}
SWEEP = "self._reqs_need_pending_save"
# Names whose appearance in an `if` test makes it a final-chunk gate.
GATE_WORDS = frozenset({"num_prompt_tokens", UPSTREAM_HELPER, LEGACY_HELPER})
FINAL, NOT_FINAL, WRONG = "final", "not final", "wrong"


def classify_sites(src: SourceFile) -> list[SiteResult]:
    if not src.exists:
        why = "no MoRIIO connector in this vLLM (it first ships in 0.14.1)"
        return [site_result(s, Verdict.NOT_APPLICABLE, why) for s in (G1, G2)]
    if model.find_def(src.tree, f"{CLASS}.{METHOD}") is None:
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


def site_result(
    site: str, verdict: Verdict, why: str, shape: str = "", line: int | None = None, found: str = ""
) -> SiteResult:
    """A drift located at a line says what it found and what was expected."""
    drifted = verdict is Verdict.DRIFTED and line is not None
    shapes = tuple(f"{s.name} ({s.verdict.value})" for s in SHAPES[site])
    found, expected = (found, (*shapes, *FIXED_FORMS)) if drifted else ("", ())
    return SiteResult("moriio-chunk-gate", site, FILE, verdict, shape, why, line, found, expected)


def rewrite_sites(src: SourceFile, pending: list[str], codemod: Codemod) -> None:
    context = Context.of(src.tree)
    for site in pending:
        if classify_site(context, site).verdict is not Verdict.PENDING:
            raise ValueError(f"{site} is no longer pending")
        chains = site_chains(context, site)
        for chain in chains or ():
            chain.rewrite(codemod)
        gate = None if chains else locate(context, site)[0]
        if gate is not None:
            gate.rewrite(codemod)


# The fork's mamba-blockids edit (SITES.md 1), by its statements: a name alone decides nothing.
_FORK_STARTS_EMPTY = ("self._reqs_save_mamba = {}", "self._reqs_save_mamba: HOLE_type = {}")
_FORK_FILES_BLOCKS = "self._reqs_save_mamba[HOLE_key] = HOLE_value"
_SKIPS_NOT_PENDING = "if req_id not in self._reqs_need_pending_save:\n    continue"
_UNKNOWN = "block-count gates of A-C, in surroundings of no known release"


@dataclass
class Context:
    module: ast.Module
    method: ast.FunctionDef
    cls: ast.ClassDef

    @classmethod
    def of(cls, module: ast.Module) -> Context:
        method, klass = model.find_def(module, f"{CLASS}.{METHOD}"), model.find_class(module, CLASS)
        if method is None or klass is None:
            raise ValueError(f"{CLASS}.{METHOD} is gone")
        return cls(module, method, klass)

    def loops(self, over: str) -> list[ast.For]:
        return model.loops_over(self.method, over.rsplit(".", 1)[-1])

    @functools.cached_property
    def release(self) -> str:
        """Where block-count gates of A-C come from, by the G1 loop and its producer branch
        (the same for both sites: found once)."""
        g1, _ = locate(self, G1)
        if g1 is None:
            return _UNKNOWN
        around = model.ancestors(g1.loop, model.parent_map(self.method))
        tests = {model.normalised_dump(n.test) for n in around if isinstance(n, ast.If)}
        write, producer = "self.mode == MoRIIOMode.WRITE", "get_role() == ROLE.PRODUCER"
        nested = {model.expression_dump(write), model.expression_dump(producer)} <= tests
        combined = model.expression_dump(f"{write} and {producer}") in tests
        if search(_SKIPS_NOT_PENDING, g1.loop):
            if not combined:
                return _UNKNOWN
            return "the fork (shape C gates)" if self._is_fork() else "C (0.28.0-0.29.0)"
        return "A (0.14.1-0.23.0)" if nested else "B (0.24.0-0.27.1)" if combined else _UNKNOWN

    def _is_fork(self) -> bool:
        init = model.find_method(self.cls, "__init__")
        alloc = model.find_method(self.cls, "update_state_after_alloc")
        keys = [f["HOLE_key"] for *_, f in search(_FORK_FILES_BLOCKS, alloc)] if alloc else []
        starts = init is not None and any(search(pattern, init) for pattern in _FORK_STARTS_EMPTY)
        return starts and any("request_id" in mentioned_names(key) for key in keys)

    def helper_is_progress(self) -> bool:
        helper = model.find_method(self.cls, UPSTREAM_HELPER)
        env = model.named_values(helper.body) if helper else {}
        returns = [n.value for n in ast.walk(helper) if isinstance(n, ast.Return)] if helper else []
        meanings = [progress_meaning(v, env) if v is not None else None for v in returns]
        return bool(meanings) and set(meanings) == {FINAL}


def locate(context: Context, site: str) -> tuple[Gate | None, str]:
    found = []
    for loop in context.loops(LOOPS[site]):
        parents, gates = model.parent_map(loop), []
        for block in blocks(loop):
            for index, stmt in enumerate(block):
                if not isinstance(stmt, ast.If):
                    continue
                temps = model.temporaries_before(block, index, stmt.test)
                if any(GATE_WORDS & mentioned_names(n) for n in [stmt.test, *temps]):
                    around = model.ancestors(stmt, parents, stop=loop)
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
        """Drift shows the gate's conditions (a header line each), temporaries and header."""
        inner = [*map(ast.unparse, self.temps), f"if {ast.unparse(self.node.test)}:", "    ..."]
        found = model.outline(self.conditions, inner)
        return site_result(self.site, verdict, why, shape, self.node.lineno, found)

    def classify(self, context: Context) -> SiteResult:
        shape = next((s for s in SHAPES[self.site] if s.match(self.loop.body) is not None), None)
        if shape is None:
            return self.classify_fixed(context)
        problems = self.preconditions(context, shape.verdict is Verdict.PENDING)
        if not problems:
            name = context.release if shape.name == FROM_SURROUNDINGS else shape.name
            return self.result(shape.verdict, name, shape.origin)
        return self.result(Verdict.DRIFTED, "", f"{shape.name} gate, but " + "; ".join(problems))

    def classify_fixed(self, context: Context) -> SiteResult:
        """A fixed form: a progress gate, inline or upstream's, that decides what its body needs."""
        core, times = model.strip_nots(self.node.test)
        upstream = model.is_call_to(core, UPSTREAM_HELPER)
        env = model.named_values(self.temps)
        meaning = flip(FINAL, times) if upstream else progress_meaning(self.node.test, env)
        wanted = needed_meaning(self.node)
        tests = [getattr(c, "test", c) for c in self.conditions]
        if meaning is None:
            problem = "the gate is in no shape k3patch knows; nothing will be written"
        elif upstream and not context.helper_is_progress():
            problem = (
                f"the gate calls self.{UPSTREAM_HELPER}, whose body is no progress comparison "
                "(num_computed_tokens + num_scheduled_tokens >= num_prompt_tokens)"
            )
        elif meaning == WRONG:
            problem = (
                "a comparison of progress with the prompt, but not `progress >= "
                "num_prompt_tokens` (final) or `progress < num_prompt_tokens` (not yet): an "
                "inverted, off-by-one or slack gate; nothing will be written"
            )
        elif meaning != wanted:
            problem = (
                f"a progress gate whose test means {meaning!r} where its body needs {wanted!r} "
                "(inverted); nothing will be written"
            )
        elif any("new_block_ids" in mentioned_names(test) for test in tests):
            problem = (
                "a progress gate, but still only evaluated when the step allocated a new "
                "block: a final chunk without a new block would never send"
            )
        elif model.expression_dump(f"req_id in {SWEEP}") in map(model.normalised_dump, tests):
            problem = "k3patch's gate, edited since k3patch wrote it"
        elif self.conditions:  # upstream's gates sit directly in their loops
            problem = "a progress gate nested under a condition k3patch does not know"
        else:
            name = SATISFIED_UPSTREAM if upstream else SATISFIED_INLINE
            return self.result(Verdict.SATISFIED, name, "gates on compute progress")
        return self.result(Verdict.DRIFTED, "", problem)

    def preconditions(self, context: Context, pending: bool) -> list[str]:
        """Why a gate in a known shape still cannot take (or does not hold) the post-image."""
        problems = []
        if pending and "scheduler_output" not in model.parameter_names(context.method):
            problems.append(f"{METHOD} has no parameter named scheduler_output")
        bound = model.stored_names([self.loop.target])
        needs = {"req_id"} if self.site == G1 else {"req_id", "req"}
        if not needs <= bound:
            problems.append(f"the loop does not bind {', '.join(sorted(needs - bound))}")
        for temp in self.temps if pending else ():
            name = model.assigned_name(temp)
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
            local = model.stored_names(self.block[: self.block.index(self.node)])
            local |= loaded_names(self.conditions[:1], skip=self.block)
        else:
            before = self.loop.body[: self.loop.body.index((self.conditions or [self.node])[0])]
            ifs = [s for s in before if isinstance(s, ast.If)]
            branches = [s for s in ifs if "new_block_ids" in mentioned_names(s.test)]
            local = model.stored_names([s for branch in branches for s in branch.body])
        read = loaded_names(self.node.body + self.node.orelse) & (local - {"req"})
        if read:
            problems.append(
                "its body reads " + ", ".join(sorted(read)) + ", bound only when the step "
                "allocated a block"
            )
        return problems

    def rewrite(self, codemod: Codemod) -> None:
        """The gate's temporaries go (with the comments above them) and its header becomes the
        post-image's; comments right above the gate stay. G1's gate then leaves
        `if new_block_ids is not None:` for the guard after it, which runs for every pending
        request."""
        from .rewrite import new_header, under_guard  # libcst: only when rewriting

        for temp in self.temps:
            codemod.remove(temp)
        if self.site == G1:
            codemod.change(self.conditions[0], under_guard(G1_TEMPLATE))
        else:
            codemod.change(self.node, new_header(G2_TEMPLATE))


def needed_meaning(gate: ast.If) -> str:
    """ "final" where the gate's body sends the request, else "not final" (it defers or skips)."""
    funcs = [n.func for stmt in gate.body for n in ast.walk(stmt) if isinstance(n, ast.Call)]
    sends = any(match("HOLE_connector.add_new_req", func) is not None for func in funcs)
    return FINAL if sends else NOT_FINAL


def flip(meaning: str, times: int) -> str:
    return {FINAL: NOT_FINAL, NOT_FINAL: FINAL}.get(meaning, meaning) if times % 2 else meaning


# This step's scheduled tokens of a request, as vLLM and the older scripts read them.
_SCHEDULED = [
    f"HOLE_out.num_scheduled_tokens{s}" for s in ("[HOLE_k]", ".get(HOLE_k)", ".get(HOLE_k, 0)")
]
# `progress OP prompt` decides final for >=, not final for <; `prompt OP progress` the mirror.
_MEANING = {ast.GtE: FINAL, ast.Lt: NOT_FINAL}
_MIRRORED = {ast.LtE: ast.GtE, ast.Gt: ast.Lt, ast.GtE: ast.LtE, ast.Lt: ast.Gt}


def progress_meaning(expr: ast.expr, env: dict[str, ast.expr]) -> str | None:
    """ "final" for `progress >= prompt`, "not final" for `progress < prompt` (mirrored and
    negated forms too), "wrong" for another comparison of the two, else None."""

    def progress_of(side: ast.expr) -> str | None:  # `r` of `r.num_computed_tokens + <scheduled>`
        side = model.resolve_name(side, env)
        if not (isinstance(side, ast.BinOp) and isinstance(side.op, ast.Add)):
            return None
        for computed, scheduled in ((side.left, side.right), (side.right, side.left)):
            req = model.attribute_owner(model.resolve_name(computed, env), "num_computed_tokens")
            step = model.resolve_name(scheduled, env)
            if req is not None and any(match(p, step) is not None for p in _SCHEDULED):
                return req
        return None

    core, times = model.strip_nots(expr)
    core = model.resolve_name(core, env)
    if not isinstance(core, ast.Compare):
        return None
    resolved = [model.resolve_name(n, env) for n in ast.walk(core) if isinstance(n, ast.Name)]
    words = mentioned_names(core).union(*map(mentioned_names, resolved))
    wrong = WRONG if {"num_computed_tokens", "num_prompt_tokens"} <= words else None
    if len(core.ops) != 1:
        return wrong
    left, right, op = core.left, core.comparators[0], type(core.ops[0])
    req = progress_of(left)
    prompt = model.attribute_owner(model.resolve_name(right, env), "num_prompt_tokens")
    if req is None or prompt is None:
        req, op = progress_of(right), _MIRRORED.get(op, op)
        prompt = model.attribute_owner(model.resolve_name(left, env), "num_prompt_tokens")
    if req is None or req != prompt:
        return wrong
    return flip(_MEANING.get(op, WRONG), times)


# The older k3-chunk-gate script's form (SITES.md 2): a decision chain `NAME = <its helper call
# or k3patch's repair>`, `if NAME is None:` (its fallback), debug `if`s, then `if [not] NAME:`.
LEGACY_MAP = "_k3_prog"
# k3patch's repair of a decision, in place.
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
# k3patch's repaired decision about `req`, as a report shows it (without its `x = `).
_REPAIRED = ast.unparse(ast.parse(LEGACY_TEMPLATE.format(name="x", req="req", req_id="req_id")))[4:]
# The block-count fallback each site's older form keeps, as the script writes it.
LEGACY_FALLBACK = {
    G1: "len(self._reqs_need_pending_save[req_id][1]) * self.block_size >= req.num_prompt_tokens",
    G2: "not (req.num_prompt_tokens > len(block_ids) * self.block_size)",
}


@dataclass
class Chain:
    part: str  # "gate" or "sweep"
    block: list[ast.stmt]
    name: str
    decision: ast.Assign
    fallback: ast.If | None
    gate: ast.If

    @classmethod
    def at(cls, block: list[ast.stmt], index: int, part: str) -> Chain | None:
        decision, name = block[index], model.assigned_name(block[index])
        if not isinstance(decision, ast.Assign) or name is None:
            return None
        helper_call = model.is_call_to(decision.value, LEGACY_HELPER)
        if not (helper_call or "num_prompt_tokens" in mentioned_names(decision.value)):
            return None
        after = block[index + 1 :]
        end = next((i for i, s in enumerate(after) if not isinstance(s, ast.If)), len(after))
        ifs = [s for s in after[:end] if isinstance(s, ast.If)]
        fallback = ifs.pop(0) if ifs and match(f"{name} is None", ifs[0].test) is not None else None
        while ifs and "K3_CHUNK_GATE_DEBUG" in mentioned_names(ifs[0].test, everything=True):
            ifs.pop(0)
        if not ifs or match(name, model.strip_nots(ifs[0].test)[0]) is None:
            return None
        return cls(part, block, name, decision, fallback, ifs[0])

    @property
    def statements(self) -> list[ast.stmt]:
        return self.block[self.block.index(self.decision) : self.block.index(self.gate) + 1]

    def kind(self) -> str:
        """ "legacy" (the script's helper), "progress" (k3patch's repair) or "other"."""
        value = self.decision.value
        if isinstance(value, ast.Call) and model.is_call_to(value, LEGACY_HELPER):
            names = len(value.args) == 3 and all(isinstance(a, ast.Name) for a in value.args)
            return "legacy" if names else "other"
        return "progress" if progress_meaning(value, {}) == FINAL else "other"

    def rewrite(self, codemod: Codemod) -> None:
        """The decision replaced in place by compute progress; an `is None` fallback goes.
        Helper, map and debug lines stay: nothing reads them to decide any more."""
        value = self.decision.value  # `_k3_prefill_done(self, <request id>, <request>)`
        args = value.args if isinstance(value, ast.Call) and len(value.args) == 3 else []
        if not (args and isinstance(args[1], ast.Name) and isinstance(args[2], ast.Name)):
            raise ValueError(f"{self.name}: a decision chain without its request names")
        source = LEGACY_TEMPLATE.format(name=self.name, req=args[2].id, req_id=args[1].id)
        stmts = [self.decision] if self.fallback is None else [self.decision, self.fallback]
        codemod.replace(stmts, source)


def site_chains(context: Context, site: str) -> list[Chain] | None:
    """The site's decision chains (G1: its gate and its sweep; G2: its gate), or None."""

    def chains_in(roots: list[ast.For], part: str) -> list[Chain]:
        found = (Chain.at(b, i, part) for r in roots for b in blocks(r) for i in range(len(b)))
        return [chain for chain in found if chain is not None]

    own = context.loops(LOOPS[site])
    gates = chains_in(own, "gate")
    if not gates or site == G2:
        return gates or None
    return [*gates, *chains_in([loop for loop in context.loops(SWEEP) if loop not in own], "sweep")]


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
    """Why decision chains are in no form the script or k3patch's repair leaves."""
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
        wanted = NOT_FINAL if chain.part == "sweep" else needed_meaning(chain.gate)
        if flip(FINAL, model.strip_nots(chain.gate.test)[1]) != wanted:
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
    prints = [model.site_fingerprint(n) for n in helpers if n.name == LEGACY_HELPER]
    if legacy and prints != [LEGACY_HELPER_SHAPE.fingerprint]:
        problems.append(
            f"the module's {LEGACY_HELPER}() is not the script's (missing, defined twice, or "
            "its comparison edited)"
        )
    if legacy and LEGACY_MAP not in model.attribute_names([context.method], "self", ast.Store):
        problems.append(f"{METHOD} never sets self.{LEGACY_MAP}, which {LEGACY_HELPER}() reads")
    # Names the chains read that nothing binds: the script's debug `if` reads `os` at module
    # level, its sweep reads maps that other older scripts add to the scheduler. Either raises
    # when a chunked request comes (the sweep's inside its `try`: the request is never sent).
    statements = [s for c in chains for s in c.statements]
    free = model.unbound_names(statements, context.module, context.method)
    if free:
        problems.append(
            "it reads " + ", ".join(sorted(free)) + ", which moriio_connector.py never binds"
        )
    decisions = [c.decision for c in chains if c.part == "sweep"]
    loops = [loop for loop in context.loops(SWEEP) if any(d in ast.walk(loop) for d in decisions)]
    unset = model.unset_attributes(loops, context.cls) if loops else set()  # G2 has no sweep
    if unset:
        problems.append(
            "its sweep reads self." + ", self.".join(sorted(unset)) + f", which {CLASS} never sets "
            "(it raises inside the sweep's try and the request is never sent)"
        )
    return problems
