"""The one way a patch changes a file: a libcst codemod over the file's concrete syntax tree.

Classification picks statements out with `ast`; they are found again in the libcst tree by their
place in it (both trees hold one node per statement) and changed in one `CSTTransformer` pass, so
every byte outside the changed statements (indentation, tabs, CRLF) prints back as it was. Two
changes of one statement that cannot be composed raise `CodemodError`; nothing is applied.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import libcst as cst
import libcst.matchers as m
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor
from libcst.helpers import ensure_type

from k3patch.astkit import BLOCKS, module_binds, walk
from k3patch.itemlayout import appended

if TYPE_CHECKING:
    from k3patch.sources import Sources

Statement = cst.SimpleStatementLine | cst.BaseCompoundStatement
Change = Callable[[Statement], "Statement | Sequence[Statement]"]
_Node = TypeVar("_Node", bound=cst.CSTNode)


class CodemodError(ValueError):
    """A change cannot be made safely (a statement shares its line, changes collide, ...)."""


def statements(source: str, newline: str = "\n") -> list[Statement]:
    """`source` (any indentation) as libcst statements, comments above each kept with it.
    `newline` is the target file's: a multi-line string's lines take it too (libcst prints
    tokens verbatim)."""
    text = textwrap.dedent(source.strip("\n")) + "\n"
    module = cst.parse_module(text.replace("\n", newline))
    body = list(module.body)
    if not body:
        raise CodemodError(f"no statement in {source!r}")
    if module.header:
        body[0] = body[0].with_changes(leading_lines=[*module.header, *body[0].leading_lines])
    if any(line.comment for line in module.footer):
        raise CodemodError(f"comments after the last statement of {source!r} have no place")
    return body


def with_leading_lines(stmt: Statement, lines: Sequence[cst.EmptyLine]) -> Statement:
    """`stmt` with `lines` (blank lines and comments of the code it replaces) above its own."""
    return stmt.with_changes(leading_lines=[*lines, *stmt.leading_lines])


# Finding an ast statement's libcst node: both trees hold the same statements in the same order
# (astkit.walk yields them so), and name a compound statement's blocks alike. The libcst side
# needs its own walk: another tree type, and one node for a line of `a; b`.
def _cst_statements(
    node: cst.CSTNode, path: tuple[int, ...]
) -> Iterator[tuple[Statement | None, tuple[int, ...]]]:
    """Each statement under `node` (None where it shares its line) and the ids of the compound
    statements that hold it."""
    for name in BLOCKS:
        value = getattr(node, name, None)
        for child in value if isinstance(value, list | tuple) else [value]:
            if isinstance(child, cst.SimpleStatementLine) and len(child.body) == 1:
                yield child, path
            elif isinstance(child, cst.SimpleStatementLine | cst.SimpleStatementSuite):
                yield from [(None, path)] * len(child.body)
            elif isinstance(child, cst.BaseCompoundStatement):
                yield child, path
                yield from _cst_statements(child, (*path, id(child)))
            elif child is not None:  # a block, or what holds one (`else:`, a handler, a case)
                yield from _cst_statements(child, path)


# The changes of one statement, composed in one transformer pass.


@dataclass
class _Plan:
    before: list[Statement] = field(default_factory=list)
    comments: list[cst.EmptyLine] = field(default_factory=list)  # right above the statement
    change: Change | None = None
    after: list[Statement] = field(default_factory=list)
    removed: bool = False


class _Apply(cst.CSTTransformer):
    """Enters only the statements that hold a changed one; changes those on leave."""

    def __init__(self, plans: dict[int, _Plan], ancestors: set[int]) -> None:
        super().__init__()
        self.plans, self.ancestors = plans, ancestors

    def on_visit(self, node: cst.CSTNode) -> bool:
        is_statement = isinstance(node, cst.SimpleStatementLine | cst.BaseCompoundStatement)
        return not is_statement or id(node) in self.ancestors

    def on_leave(  # type: ignore[override]  # returns statements where statements stood
        self, original_node: cst.CSTNode, updated_node: cst.CSTNode
    ) -> cst.CSTNode | cst.RemovalSentinel | cst.FlattenSentinel[cst.CSTNode]:
        plan = self.plans.get(id(original_node))
        if plan is None:
            return updated_node
        if plan.removed:
            return cst.RemoveFromParent()
        node: Statement = updated_node  # type: ignore[assignment]
        # A change sees the statement without the lines above it; they stay above what the
        # change leaves in its place (or above what is inserted before it).
        lead, bare = node.leading_lines, node.with_changes(leading_lines=[])
        changed = plan.change(bare) if plan.change else bare
        middle = [changed] if isinstance(changed, cst.CSTNode) else list(changed)
        if middle and plan.comments:
            middle[0] = with_leading_lines(middle[0], plan.comments)
        out = [*plan.before, *middle, *plan.after]
        if not out:
            return cst.RemoveFromParent()
        out[0] = with_leading_lines(out[0], lead)
        return cst.FlattenSentinel(out) if len(out) != 1 else out[0]


class Codemod:
    """The libcst tree of one file and the changes a patch makes to it; `code()` prints it."""

    def __init__(self, text: str, tree: ast.Module) -> None:
        self.text, self.tree = text, tree
        self.module = cst.parse_module(text)
        self.newline = self.module.default_newline
        found = list(_cst_statements(self.module, ()))
        stmts = [n for n in walk(tree) if isinstance(n, ast.stmt)]
        if len(found) != len(stmts):
            raise CodemodError("the libcst and ast trees of the file disagree")
        self._nodes = {id(stmt): node for stmt, (node, _) in zip(stmts, found, strict=True)}
        self._holders = {id(node): path for node, path in found if node is not None}
        self._plans: dict[int, _Plan] = {}
        self._imports = CodemodContext()  # AddImportsVisitor's list of what to import
        self._definitions: list[Statement] = []
        self._transformers: list[cst.CSTTransformer] = []

    def node(self, stmt: ast.stmt) -> Statement:
        """The libcst statement (line or compound statement) that holds `stmt`, alone."""
        if id(stmt) not in self._nodes:
            raise CodemodError(f"line {stmt.lineno}: not a statement of this file")
        node = self._nodes[id(stmt)]
        if node is None:
            raise CodemodError(f"line {stmt.lineno}: another statement shares its line")
        return node

    def _plan(self, stmt: ast.stmt) -> _Plan:
        return self._plans.setdefault(id(self.node(stmt)), _Plan())

    def insert_before(self, stmt: ast.stmt, source: str) -> None:
        """`source` as statements right before `stmt` (before its decorators); a `source` of
        comments only goes right above the statement (or what replaces it)."""
        lines = [line.strip() for line in source.strip("\n").splitlines()]
        if all(not line or line.startswith("#") for line in lines):
            self._plan(stmt).comments += [
                cst.EmptyLine(comment=cst.Comment(line)) if line else cst.EmptyLine(indent=False)
                for line in lines
            ]
            return
        self._plan(stmt).before += statements(source, self.newline)

    def insert_after(self, stmt: ast.stmt, source: str) -> None:
        self._plan(stmt).after += statements(source, self.newline)

    def change(self, stmt: ast.stmt, change: Change) -> None:
        """`change(node)` replaces the statement's (updated) node: a statement or several."""
        plan = self._plan(stmt)
        if plan.change is not None or plan.removed:
            raise CodemodError(f"line {stmt.lineno}: two changes of one statement")
        plan.change = change

    def remove(self, stmt: ast.stmt) -> None:
        plan = self._plan(stmt)
        if plan.change is not None or plan.before or plan.after:
            raise CodemodError(f"line {stmt.lineno}: a removed statement is also changed")
        plan.removed = True

    def _fold(self, stmts: Sequence[ast.stmt], change: Change) -> None:
        self.change(stmts[0], change)
        for stmt in stmts[1:]:
            self.remove(stmt)

    def replace(self, stmts: Sequence[ast.stmt], source: str) -> None:
        """The consecutive statements `stmts` by `source`; the comments above the first stay."""
        new = statements(source, self.newline)
        self._fold(stmts, lambda node: [with_leading_lines(new[0], node.leading_lines), *new[1:]])

    def nest_under(self, stmts: Sequence[ast.stmt], header: str) -> None:
        """The consecutive statements `stmts` one level in under `header` (`if cond:`, ...);
        the comments above the first stay above the header."""
        shell = statements(f"{header.strip()}\n    pass")[0]
        if not isinstance(shell, cst.BaseCompoundStatement):
            raise CodemodError(f"{header!r} is not a compound statement header")
        # The later statements move as they are (nothing may change inside them).
        moved = [self.node(stmt) for stmt in stmts[1:]]
        self._fold(
            stmts, lambda node: shell.with_changes(body=cst.IndentedBlock(body=[node, *moved]))
        )

    def append_to(
        self,
        holder: ast.ClassDef | ast.FunctionDef | ast.Call | ast.Dict,
        item: str,
        within: ast.stmt | None = None,
    ) -> None:
        """`item` after the last of a class's annotated fields (as statements), a function's
        positional parameters, a call's arguments or a dict literal's entries. A call or dict
        is found in `within`, the statement that holds it, by its order among the calls (or
        dicts) of that statement."""
        if isinstance(holder, ast.ClassDef):
            fields = [s for s in holder.body if isinstance(s, ast.AnnAssign)]
            if not fields:
                raise CodemodError(f"class {holder.name} has no annotated field")
            self.insert_after(fields[-1], item)
            return
        if isinstance(holder, ast.FunctionDef):
            self.change(holder, lambda node: _append_item(node, item))
            return
        if within is None:
            raise CodemodError("a call or dict literal needs the statement that holds it")
        kind = ast.Call if isinstance(holder, ast.Call) else ast.Dict
        same = sorted(
            (n for n in ast.walk(within) if isinstance(n, kind)),
            key=lambda n: (n.lineno, n.col_offset, -(n.end_lineno or 0), -(n.end_col_offset or 0)),
        )
        ordinal = next(i for i, n in enumerate(same) if n is holder)

        def edit(node: Statement) -> Statement:
            found = m.findall(node, m.Call() if kind is ast.Call else m.Dict())  # in preorder
            if len(found) != len(same):
                raise CodemodError(f"line {within.lineno}: the calls of the statement disagree")
            new = node.deep_replace(found[ordinal], _append_item(found[ordinal], item))
            assert isinstance(new, cst.SimpleStatementLine | cst.BaseCompoundStatement)
            return new

        self.change(within, edit)

    def append_definition(self, source: str) -> None:
        """A top-level def or class at the end of the file, after two blank lines."""
        new = statements(source, self.newline)
        blank = cst.EmptyLine(indent=False)
        self._definitions += [with_leading_lines(new[0], [blank, blank]), *new[1:]]

    def ensure_import(self, name: str) -> None:
        """`import name` unless the module binds `name` at its top level, however (libcst's
        AddImportsVisitor only knows imports of the module itself)."""
        if not module_binds(self.tree, name):
            AddImportsVisitor.add_needed_import(self._imports, name)

    def transform(self, transformer: cst.CSTTransformer) -> None:
        """A patch's own transformer (a `ScopedTransformer`), run after the statement changes."""
        self._transformers.append(transformer)

    def code(self) -> str:
        """The file's new text: every change made in one pass, then imports and definitions."""
        module = self.module
        if self._plans:
            removed = {key for key, plan in self._plans.items() if plan.removed}
            for plan in self._plans.values():
                if plan.removed and (plan.before or plan.after or plan.comments):
                    raise CodemodError("an insertion beside a statement that is removed or moved")
            ancestors = {holder for key in self._plans for holder in self._holders[key]}
            if ancestors & removed:
                raise CodemodError("a change inside a statement that is removed or moved")
            module = module.visit(_Apply(self._plans, ancestors))
        for transformer in self._transformers:
            module = module.visit(transformer)
        if self._definitions:
            # Comments and blank lines that ended the file stay above the new definitions.
            first = with_leading_lines(self._definitions[0], module.footer)
            body = [*module.body, first, *self._definitions[1:]]
            module = module.with_changes(body=body, footer=[], has_trailing_newline=True)
        if self._imports.scratch:
            module = module.visit(AddImportsVisitor(self._imports))
        code = module.code
        if self.text.endswith(("\n", "\r")) and not code.endswith(("\n", "\r")):
            code += module.default_newline  # libcst drops a lone `\r` that ends the file
        return code


def _append_item(node: _Node, item: str) -> _Node:
    """`node` (a def, a call or a dict display) with `item` after its last parameter, argument or
    entry."""
    if isinstance(node, cst.FunctionDef):
        shell = ensure_type(cst.parse_statement(f"def f({item}): pass"), cst.FunctionDef)
        params = appended(node.params.params, shell.params.params[0])
        return node.with_changes(params=node.params.with_changes(params=params))
    if isinstance(node, cst.Call):
        new = cst.parse_expression(f"f({item})").args[0]  # type: ignore[attr-defined]
        return node.with_changes(args=appended(node.args, new))
    if isinstance(node, cst.Dict):
        new = cst.parse_expression(f"{{{item}}}").elements[0]  # type: ignore[attr-defined]
        return node.with_changes(elements=appended(node.elements, new))
    raise CodemodError(f"cannot append an item to {type(node).__name__}")


class ScopedTransformer(cst.CSTTransformer):
    """Enters only the classes and functions on the way to `scope` (`Class.method`, ...), so it
    costs milliseconds on a large module, and calls `leave_scope` on each node of that
    qualified name."""

    scope: str = ""

    def __init__(self) -> None:
        super().__init__()
        self._inside: list[cst.ClassDef | cst.FunctionDef] = []  # entered, outermost first

    def on_visit(self, node: cst.CSTNode) -> bool:
        if not isinstance(node, cst.ClassDef | cst.FunctionDef):
            return super().on_visit(node)
        path = [*(n.name.value for n in self._inside), node.name.value]
        if self.scope.split(".")[: len(path)] != path:
            return False
        self._inside.append(node)
        return True

    def on_leave(  # type: ignore[override]
        self, original_node: cst.CSTNode, updated_node: cst.CSTNode
    ) -> cst.CSTNode | cst.RemovalSentinel | cst.FlattenSentinel[cst.CSTNode]:
        if not self._inside or original_node is not self._inside[-1]:
            return super().on_leave(original_node, updated_node)
        self._inside.pop()
        if len(self._inside) != self.scope.count("."):  # on the way to `scope`, not `scope`
            return updated_node
        return self.leave_scope(updated_node)

    def leave_scope(self, node: cst.CSTNode) -> cst.CSTNode:
        raise NotImplementedError


class Codemods:
    """The libcst trees of a run's changed files, each parsed once, on first use."""

    def __init__(self, sources: Sources) -> None:
        self._sources = sources
        self._files: dict[str, Codemod] = {}

    def __getitem__(self, rel: str) -> Codemod:
        if rel not in self._files:
            src = self._sources[rel]
            self._files[rel] = Codemod(src.text, src.tree)
        return self._files[rel]

    def texts(self) -> dict[str, str]:
        return {rel: codemod.code() for rel, codemod in self._files.items()}
