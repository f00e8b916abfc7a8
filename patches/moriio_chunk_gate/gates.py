"""moriio-chunk-gate's sites, read with stdlib ast (fast): the older script's decision chains, else
the one gate `if`, in a known shape or a fixed form told by its meaning. Private to this patch."""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from k3patch import astkit
from k3patch.astkit import mentioned_names
from k3patch.shapes import blocks, match, search
from k3patch.sources import SourceFile
from k3patch.verdicts import SiteResult, Verdict

from . import (
    CLASS,
    FROM_SURROUNDINGS,
    G1,
    G1_TEMPLATE,
    G2,
    G2_TEMPLATE,
    LEGACY_HELPER,
    LOOPS,
    METHOD,
    SATISFIED_INLINE,
    SATISFIED_UPSTREAM,
    SHAPES,
    SWEEP,
    names,
    site_result,
)
from .legacy import Chain, classify_chains, site_chains
from .names import FINAL, WRONG, Context, flip

if TYPE_CHECKING:
    from k3patch.codemod import Codemod

UPSTREAM_HELPER = "_is_final_prefill_chunk"
# Names whose appearance in an `if` test makes it a final-chunk gate.
GATE_WORDS = frozenset({"num_prompt_tokens", UPSTREAM_HELPER, LEGACY_HELPER})


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


def helper_is_progress(cls: ast.ClassDef) -> bool:
    helper = astkit.find_method(cls, UPSTREAM_HELPER)
    env = names.named_values(helper.body) if helper else {}
    returns = [n.value for n in ast.walk(helper) if isinstance(n, ast.Return)] if helper else []
    meanings = [names.progress_meaning(v, env) if v is not None else None for v in returns]
    return bool(meanings) and set(meanings) == {FINAL}


def locate(context: Context, site: str) -> tuple[Gate | None, str]:
    found = []
    for loop in names.loops_over(context.method, LOOPS[site]):
        parents, gates = parent_map(loop), []
        for block in blocks(loop):
            for index, stmt in enumerate(block):
                if not isinstance(stmt, ast.If):
                    continue
                temps = names.temporaries_before(block, index, stmt.test)
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
        if shape is None:
            return self.classify_fixed(context)
        problems = self.preconditions(context, shape.verdict is Verdict.PENDING)
        if not problems:
            name = release(context) if shape.name == FROM_SURROUNDINGS else shape.name
            return self.result(shape.verdict, name, shape.origin)
        return self.result(Verdict.DRIFTED, "", f"{shape.name} gate, but " + "; ".join(problems))

    def classify_fixed(self, context: Context) -> SiteResult:
        core, times = names.strip_nots(self.node.test)
        upstream = names.is_call_to(core, UPSTREAM_HELPER)
        env = names.named_values(self.temps)
        meaning = flip(FINAL, times) if upstream else names.progress_meaning(self.node.test, env)
        wanted = names.needed_meaning(self.node)
        tests = [getattr(c, "test", c) for c in self.conditions]
        if meaning is None:
            problem = "the gate is in no shape k3patch knows; nothing will be written"
        elif upstream and not helper_is_progress(context.cls):
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
        elif any(match(f"req_id in {SWEEP}", test) is not None for test in tests):
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
        if pending and "scheduler_output" not in astkit.parameter_names(context.method):
            problems.append(f"{METHOD} has no parameter named scheduler_output")
        bound = astkit.stored_names([self.loop.target])
        needs = {"req_id"} if self.site == G1 else {"req_id", "req"}
        if not needs <= bound:
            problems.append(f"the loop does not bind {', '.join(sorted(needs - bound))}")
        for temp in self.temps if pending else ():
            name = names.assigned_name(temp)
            if name in names.loaded_names(self.loop.body, skip=[*self.temps, self.node.test]):
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
            local |= names.loaded_names(self.conditions[:1], skip=self.block)
        else:
            before = self.loop.body[: self.loop.body.index((self.conditions or [self.node])[0])]
            ifs = [s for s in before if isinstance(s, ast.If)]
            branches = [s for s in ifs if "new_block_ids" in mentioned_names(s.test)]
            local = astkit.stored_names([s for branch in branches for s in branch.body])
        read = names.loaded_names(self.node.body + self.node.orelse) & (local - {"req"})
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


def parent_map(root: ast.AST) -> dict[int, ast.AST]:
    """id(node) -> its parent, for every node under `root`."""
    return {id(child): node for node in ast.walk(root) for child in ast.iter_child_nodes(node)}


def ancestors(
    node: ast.AST, parents: Mapping[int, ast.AST], stop: ast.AST | None = None
) -> list[ast.AST]:
    """The nodes enclosing `node`, innermost first, up to the root or to (not including) `stop`."""
    found = []
    parent = parents.get(id(node))
    while parent is not None and parent is not stop:
        found.append(parent)
        parent = parents.get(id(parent))
    return found


def outline(outer: Sequence[ast.stmt], inner: Sequence[str], unit: str = "    ") -> str:
    """The first line of each of `outer` (outermost first), a `unit` deeper each, then `inner`."""
    heads = [unit * depth + ast.unparse(stmt).splitlines()[0] for depth, stmt in enumerate(outer)]
    return "\n".join([*heads, *(unit * len(outer) + line for line in inner)])
