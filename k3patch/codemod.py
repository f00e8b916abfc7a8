"""The one way a patch changes a file: a libcst codemod over the file's concrete syntax tree.

Classification reads the code with `ast` (fast; the fingerprints). A pending site is rewritten
here: the file is parsed with `libcst.parse_module`, the statements classification picked out
(as `ast` nodes) are found again in the libcst tree by their place in it (the same statement of
the same block, from the module down: both trees hold one node per statement), and one
`libcst.CSTTransformer` pass makes every change a patch asked for, on `updated_node`s. New code
is parsed by libcst into nodes (`parse_statement`, `parse_expression`); the module's own
indentation and newline style are libcst's to keep (tabs stay tabs, CRLF stays CRLF), and every
byte outside the changed statements is printed back as it was.

A patch builds one `Codemod` per file it changes, calls its operations (insert, replace, nest,
change a statement, append an item, a definition or an import) with the ast nodes it found,
and returns `codemod.code()`. Two changes of one statement that cannot be composed (two
replacements, a change inside a replaced statement) raise `CodemodError`; nothing is applied.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor

from k3patch.astkit import module_binds
from k3patch.itemlayout import appended

if TYPE_CHECKING:
    from k3patch.sources import Sources

Statement = cst.SimpleStatementLine | cst.BaseCompoundStatement
Change = Callable[[Statement], "Statement | Sequence[Statement]"]


class CodemodError(ValueError):
    """A change cannot be made safely (a statement shares its line, changes collide, ...)."""


def statements(source: str, newline: str = "\n") -> list[Statement]:
    """`source` (any indentation) as libcst statements; comment lines above the first one and
    blank lines between them stay with the statement they precede. `newline`: the target
    file's, which a multi-line string's own lines take too (libcst prints tokens verbatim)."""
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


# ---------------------------------------------------------------------------------------------
# Finding an ast statement's libcst node: both trees hold the same blocks in the same order.


def _suite(node: cst.CSTNode | None) -> list[cst.CSTNode]:
    """The statements of a block: a suite, or what holds one (`else:`, `finally:`, a handler,
    a case), or an `elif` (the one statement of the ast `orelse`)."""
    if node is None:
        return []
    if isinstance(node, cst.If):
        return [node]
    if isinstance(node, cst.BaseSuite):
        return list(node.body)
    return _suite(node.body)  # type: ignore[attr-defined]


def _blocks(cst_node: cst.CSTNode, ast_node: ast.AST) -> Iterator[tuple[list[ast.stmt], list]]:
    """The (ast block, libcst block) pairs directly under a statement or the module."""
    if isinstance(ast_node, ast.Module):
        yield ast_node.body, list(cst_node.body)  # type: ignore[attr-defined]
        return
    c: object = cst_node
    pairs: list[tuple[list[ast.stmt], cst.CSTNode | None]] = []
    if isinstance(ast_node, ast.If) and isinstance(c, cst.If):
        pairs = [(ast_node.body, c.body), (ast_node.orelse, c.orelse)]
    elif isinstance(ast_node, ast.For | ast.AsyncFor | ast.While) and isinstance(
        c, cst.For | cst.While
    ):
        pairs = [(ast_node.body, c.body), (ast_node.orelse, c.orelse)]
    elif isinstance(ast_node, ast.Try | ast.TryStar) and isinstance(c, cst.Try | cst.TryStar):
        pairs = [(ast_node.body, c.body)]
        pairs += list(zip((h.body for h in ast_node.handlers), c.handlers, strict=True))
        pairs += [(ast_node.orelse, c.orelse), (ast_node.finalbody, c.finalbody)]
    elif isinstance(ast_node, ast.Match) and isinstance(c, cst.Match):
        pairs = list(zip((case.body for case in ast_node.cases), c.cases, strict=True))
    elif isinstance(
        ast_node, ast.With | ast.AsyncWith | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef
    ):
        pairs = [(ast_node.body, c.body)]  # type: ignore[attr-defined]
    for ast_block, holder in pairs:
        yield ast_block, _suite(holder)


@dataclass(frozen=True)
class Slot:
    """Where an ast statement is in the libcst tree: its line or compound statement, and its
    index among the small statements of that line (None for a compound statement)."""

    node: cst.CSTNode
    small: int | None
    alone: bool  # the only statement of its line (always True for a compound statement)


def _index(module: cst.Module, tree: ast.Module) -> tuple[dict[int, Slot], dict[int, int]]:
    """id(ast statement) -> Slot for every statement of the file, and id(libcst statement) ->
    id(the compound statement that holds it) for every statement below the module."""
    found: dict[int, Slot] = {}
    parents: dict[int, int] = {}
    todo: list[tuple[cst.CSTNode, ast.AST]] = [(module, tree)]
    while todo:
        cst_node, ast_node = todo.pop()
        for ast_block, cst_block in _blocks(cst_node, ast_node):
            slots: list[Slot] = []
            for item in cst_block:
                if cst_node is not module:
                    parents[id(item)] = id(cst_node)
                if isinstance(item, cst.SimpleStatementLine | cst.SimpleStatementSuite):
                    smalls = item.body
                    slots += [Slot(item, i, len(smalls) == 1) for i in range(len(smalls))]
                else:
                    slots.append(Slot(item, None, True))
            if len(slots) != len(ast_block):
                raise CodemodError("the libcst and ast trees of the file disagree")
            for stmt, slot in zip(ast_block, slots, strict=True):
                found[id(stmt)] = slot
                if slot.small is None:
                    todo.append((slot.node, stmt))
    return found, parents


# ---------------------------------------------------------------------------------------------
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
    """The libcst tree of one file and the changes a patch makes to it."""

    def __init__(self, text: str, tree: ast.Module) -> None:
        self.text, self.tree = text, tree
        self.module = cst.parse_module(text)
        self.newline = self.module.default_newline
        self._slots, self._parents = _index(self.module, tree)
        self._plans: dict[int, _Plan] = {}
        self._imports: list[str] = []
        self._definitions: list[Statement] = []
        self._transformers: list[cst.CSTTransformer] = []

    # -- finding ------------------------------------------------------------------------------

    def node(self, stmt: ast.stmt) -> Statement:
        """The libcst statement (line or compound statement) that holds `stmt`, alone."""
        slot = self._slots.get(id(stmt))
        if slot is None:
            raise CodemodError(f"line {stmt.lineno}: not a statement of this file")
        if not slot.alone or isinstance(slot.node, cst.SimpleStatementSuite):
            raise CodemodError(f"line {stmt.lineno}: another statement shares its line")
        return slot.node  # type: ignore[return-value]

    def _plan(self, stmt: ast.stmt) -> _Plan:
        return self._plans.setdefault(id(self.node(stmt)), _Plan())

    # -- statement changes --------------------------------------------------------------------

    def insert_before(self, stmt: ast.stmt, source: str) -> None:
        """`source` as statements right before `stmt` (before its decorators); a `source` of
        comments only goes right above the statement (or what replaces it)."""
        if not source.strip() or all(
            line.strip().startswith("#") or not line.strip() for line in source.splitlines()
        ):
            lines = textwrap.dedent(source.strip("\n")).splitlines()
            self._plan(stmt).comments += [
                cst.EmptyLine(comment=cst.Comment(line.strip()))
                if line.strip()
                else cst.EmptyLine(indent=False)
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

    def replace(self, stmts: Sequence[ast.stmt], source: str) -> None:
        """The consecutive statements `stmts` by `source`; the comments above the first stay."""
        new = statements(source, self.newline)

        def put(node: Statement) -> list[Statement]:
            return [with_leading_lines(new[0], node.leading_lines), *new[1:]]

        self.change(stmts[0], put)
        for stmt in stmts[1:]:
            self.remove(stmt)

    def nest_under(self, stmts: Sequence[ast.stmt], header: str) -> None:
        """The consecutive statements `stmts` one level in under `header` (`if cond:`, ...);
        the comments above the first stay above the header."""
        shell = statements(f"{header.strip()}\n    pass")[0]
        if not isinstance(shell, cst.BaseCompoundStatement):
            raise CodemodError(f"{header!r} is not a compound statement header")
        # The later statements move as they are (nothing may change inside them).
        moved = [self.node(stmt) for stmt in stmts[1:]]

        def nest(node: Statement) -> Statement:
            return shell.with_changes(body=cst.IndentedBlock(body=[node, *moved]))

        self.change(stmts[0], nest)
        for stmt in stmts[1:]:
            self.remove(stmt)

    # -- items --------------------------------------------------------------------------------

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
            self.change(holder, lambda node: _append_param(node, item))
            return
        if within is None:
            raise CodemodError("a call or dict literal needs the statement that holds it")
        kind = ast.Call if isinstance(holder, ast.Call) else ast.Dict
        same = sorted(
            (n for n in ast.walk(within) if isinstance(n, kind)),
            key=lambda n: (n.lineno, n.col_offset, -(n.end_lineno or 0), -(n.end_col_offset or 0)),
        )
        ordinal = next(i for i, n in enumerate(same) if n is holder)
        target: type[cst.CSTNode] = cst.Call if kind is ast.Call else cst.Dict

        def edit(node: Statement) -> Statement:
            found = [n for n in _preorder(node) if isinstance(n, target)]
            if len(found) != len(same):
                raise CodemodError(f"line {within.lineno}: the calls of the statement disagree")
            new = node.deep_replace(found[ordinal], _append_element(found[ordinal], item))
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
        AddImportsVisitor, which puts it after the module's first block of imports, only
        knows imports of the module itself)."""
        if not module_binds(self.tree, name):
            self._imports.append(name)

    def transform(self, transformer: cst.CSTTransformer) -> None:
        """Run `transformer` over the file after the statement changes (a patch's own
        matcher-driven codemod, e.g. a `ScopedTransformer`)."""
        self._transformers.append(transformer)

    # -- the result ---------------------------------------------------------------------------

    def code(self) -> str:
        """The file's new text: every change made in one pass, then imports and definitions."""
        module = self.module
        if self._plans:
            ancestors: set[int] = set()
            removed = {key for key, plan in self._plans.items() if plan.removed}
            for plan in self._plans.values():
                if plan.removed and (plan.before or plan.after or plan.comments):
                    raise CodemodError("an insertion beside a statement that is removed or moved")
            for key in self._plans:
                path = set()
                while (key := self._parents.get(key, 0)) != 0:
                    path.add(key)
                if path & removed:
                    raise CodemodError("a change inside a statement that is removed or moved")
                ancestors |= path
            module = module.visit(_Apply(self._plans, ancestors))
        for transformer in self._transformers:
            module = module.visit(transformer)
        if self._definitions:
            # Comments and blank lines that ended the file stay above the new definitions.
            first = with_leading_lines(self._definitions[0], module.footer)
            body = [*module.body, first, *self._definitions[1:]]
            module = module.with_changes(body=body, footer=[], has_trailing_newline=True)
        if self._imports:
            context = CodemodContext()
            for name in self._imports:
                AddImportsVisitor.add_needed_import(context, name)
            module = module.visit(AddImportsVisitor(context))
        code = module.code
        if self.text.endswith(("\n", "\r")) and not code.endswith(("\n", "\r")):
            code += module.default_newline  # libcst drops a lone `\r` that ends the file
        return code


def _preorder(node: cst.CSTNode) -> Iterator[cst.CSTNode]:
    yield node
    for child in node.children:
        yield from _preorder(child)


# Items appended to a parameter list, an argument list or a dict display (laid out by itemlayout).


def _append_param(node: Statement, item: str) -> Statement:
    if not isinstance(node, cst.FunctionDef):
        raise CodemodError("parameters belong to a def")
    shell = cst.parse_statement(f"def f({item}): pass")
    assert isinstance(shell, cst.FunctionDef)
    new = shell.params.params[0]
    params = node.params
    return node.with_changes(params=params.with_changes(params=appended(params.params, new)))


def _append_element(node: cst.CSTNode, item: str) -> cst.CSTNode:
    if isinstance(node, cst.Call):
        new = cst.parse_expression(f"f({item})").args[0]  # type: ignore[attr-defined]
        return node.with_changes(args=appended(node.args, new))
    if isinstance(node, cst.Dict):
        new = cst.parse_expression(f"{{{item}}}").elements[0]  # type: ignore[attr-defined]
        return node.with_changes(elements=appended(node.elements, new))
    raise CodemodError(f"cannot append an item to {type(node).__name__}")


class ScopedTransformer(cst.CSTTransformer):
    """A transformer that enters only the classes and functions on the way to `scope`
    (`Class.method`, `function`, ...), so it costs a few milliseconds on a large module, and
    calls `leave_scope` on each node of that qualified name (`found` counts them)."""

    scope: str = ""

    def __init__(self) -> None:
        super().__init__()
        self._path: list[str] = []
        self._entered: list[bool] = []
        self.found = 0

    def _visit(self, name: str) -> bool:
        inside = self.scope.split(".")[: len(self._path) + 1] == [*self._path, name]
        self._entered.append(inside)
        if inside:
            self._path.append(name)
        return inside

    def _leave(self, node: cst.CSTNode) -> cst.CSTNode:
        if not self._entered.pop():
            return node
        here = ".".join(self._path)
        self._path.pop()
        if here != self.scope:
            return node
        self.found += 1
        return self.leave_scope(node)

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        return self._visit(node.name.value)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return self._visit(node.name.value)

    def leave_ClassDef(  # type: ignore[override]
        self, original_node: cst.ClassDef, updated_node: cst.ClassDef
    ) -> cst.CSTNode:
        return self._leave(updated_node)

    def leave_FunctionDef(  # type: ignore[override]
        self, original_node: cst.FunctionDef, updated_node: cst.FunctionDef
    ) -> cst.CSTNode:
        return self._leave(updated_node)

    def leave_scope(self, node: cst.CSTNode) -> cst.CSTNode:
        raise NotImplementedError


class Codemods:
    """The libcst trees of a run's changed files: each parsed once, on first use, however many
    patches change it; `texts()` prints every touched file."""

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
