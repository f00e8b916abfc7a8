"""moriio-chunk-gate's rewrite. Each gate's loop is cut out on its own lines, parsed alone with
libcst, edited and spliced back (k3patch.codemod), so every byte outside the two loops stays as
it was. In the loop only the gate headers change (and their named temporaries go); G1 also
leaves `if new_block_ids is not None:` for a sibling right after it, keeping its body as it was.
The older script's form is repaired in place first (legacy.py)."""

from __future__ import annotations

import ast

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

from k3patch.codemod import cut
from k3patch.model import SourceFile, Verdict

from . import G1, G1_TEMPLATE, G2_TEMPLATE, MARKER_G1, MARKER_G2
from .gates import Context, Gate, classify_site, locate
from .legacy import Chain, repair_chains, site_chains


def rewrite_sites(src: SourceFile, pending: list[str]) -> str:
    context = Context.of(src.tree)
    gates: dict[str, Gate] = {}
    chains: list[Chain] = []
    for site in pending:
        if classify_site(src, context, site).verdict is not Verdict.PENDING:
            raise ValueError(f"{site} is no longer pending")
        legacy = site_chains(context, site)
        if legacy is not None:
            chains.extend(legacy)
            continue
        gate, _ = locate(context, site)
        assert gate is not None
        gates[site] = gate
    text = repair_chains(src.text, chains)
    if gates and chains:
        # The older form's repair never touches a loop the gate rewrite cuts out; only line
        # numbers move, so the gates are located again in the repaired text.
        context = Context.of(ast.parse(text))
        gates = {site: _relocate(context, site) for site in gates}
    # Splice the later loop first so the earlier one's line numbers still hold.
    for gate in sorted(gates.values(), key=lambda g: -g.loop.lineno):
        piece = cut(text, gate.loop)
        text = piece.put(_rewrite_loop(piece.segment, gate, first_line=piece.first_line))
    return text


def _relocate(context: Context, site: str) -> Gate:
    gate, why = locate(context, site)
    if gate is None:
        raise ValueError(f"{site}: {why}")
    return gate


def _rewrite_loop(segment: str, gate: Gate, first_line: int) -> str:
    """The loop's new source; `segment` is the loop alone, its first line at `first_line`."""

    def comments(lines: tuple[str, ...]) -> list[cst.EmptyLine]:
        return [cst.EmptyLine(comment=cst.Comment(line)) for line in lines]

    def template(source: str) -> cst.If:
        node = cst.parse_module(source.lstrip("\n")).body[0]
        assert isinstance(node, cst.If)
        return node

    def new_header(template_if: cst.If, old: cst.BaseStatement) -> cst.If:
        if not isinstance(old, cst.If):
            raise ValueError("the gate is not an if statement")
        return template_if.with_changes(
            body=old.body, orelse=old.orelse, leading_lines=old.leading_lines
        )

    temp_lines = {t.lineno for t in gate.temps}

    class LoopRewriter(cst.CSTTransformer):
        METADATA_DEPENDENCIES = (PositionProvider,)

        def __init__(self) -> None:
            super().__init__()
            self.done = False

        def line(self, node: cst.CSTNode) -> int:
            return int(self.get_metadata(PositionProvider, node).start.line) + first_line - 1

        def statements(
            self, original: cst.BaseSuite, updated: cst.BaseSuite
        ) -> list[tuple[int, cst.BaseStatement, cst.BaseStatement]]:
            if not (
                isinstance(original, cst.IndentedBlock) and isinstance(updated, cst.IndentedBlock)
            ):
                raise ValueError("a one-line block where an indented block was expected")
            return [(self.line(o), o, u) for o, u in zip(original.body, updated.body, strict=True)]

        def leave_For(self, original: cst.For, updated: cst.For) -> cst.For:
            if self.line(original) != gate.loop.lineno:
                return updated
            self.done = True
            body = self.g1(original, updated) if gate.site == G1 else self.g2(original, updated)
            return updated.with_changes(body=updated.body.with_changes(body=body))

        def g1(self, original: cst.For, updated: cst.For) -> list[cst.BaseStatement]:
            branch_line = gate.conditions[0].lineno
            out: list[cst.BaseStatement] = []
            for line, orig, stmt in self.statements(original.body, updated.body):
                if line != branch_line:
                    out.append(stmt)
                    continue
                if not (isinstance(orig, cst.If) and isinstance(stmt, cst.If)):
                    raise ValueError("G1's branch is not an if statement")
                kept: list[cst.BaseStatement] = []
                old_gate: cst.BaseStatement | None = None
                for inner_line, _, inner in self.statements(orig.body, stmt.body):
                    if inner_line == gate.node.lineno:
                        old_gate = inner
                    elif inner_line not in temp_lines:
                        kept.append(inner)
                if old_gate is None or not kept:
                    raise ValueError("G1's gate is not where classification found it")
                guard = template(G1_TEMPLATE)
                assert isinstance(guard.body, cst.IndentedBlock)
                rebind, inner_if = guard.body.body
                assert isinstance(inner_if, cst.If)
                guard = guard.with_changes(
                    leading_lines=comments(MARKER_G1),
                    body=guard.body.with_changes(body=[rebind, new_header(inner_if, old_gate)]),
                )
                out.append(stmt.with_changes(body=stmt.body.with_changes(body=kept)))
                out.append(guard)
            return out

        def g2(self, original: cst.For, updated: cst.For) -> list[cst.BaseStatement]:
            out: list[cst.BaseStatement] = []
            for line, _, stmt in self.statements(original.body, updated.body):
                if line in temp_lines:
                    continue
                if line == gate.node.lineno:
                    new = new_header(template(G2_TEMPLATE), stmt)
                    stmt = new.with_changes(
                        leading_lines=[*new.leading_lines, *comments(MARKER_G2)]
                    )
                out.append(stmt)
            return out

    rewriter = LoopRewriter()
    module = cst.parse_module(segment)
    new_module = MetadataWrapper(module, unsafe_skip_copy=True).visit(rewriter)
    if not rewriter.done:
        raise ValueError(f"{gate.site}: the loop is not where classification found it")
    return new_module.code
