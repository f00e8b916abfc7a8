"""The AST helpers two or more patches use to find their sites: scope lookup that refuses
ambiguity, and the names a piece of code mentions, binds or imports."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T", bound=ast.stmt)
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
BLOCKS = ("body", "handlers", "orelse", "finalbody", "cases")


def walk(root: ast.AST, *, scope: bool = False) -> Iterator[ast.AST]:
    """`root` and every node under it, depth first, each node before its children (statements
    in source order), skipping annotations and parameter lists (types; defaults are walked).
    With `scope`, a def or class under `root` is yielded but not entered: its code runs in
    another scope, when it is called or never. The one walker every AST reader uses."""
    stack = [root]
    while stack:
        node = stack.pop()
        yield node
        if scope and node is not root and isinstance(node, SCOPES):
            continue
        children: list[ast.AST] = []
        for name, value in ast.iter_fields(node):
            if name in ("returns", "annotation") or isinstance(value, ast.arguments):
                continue
            children += [c for c in (value if isinstance(value, list) else [value])]
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            children += [d for d in (*node.args.defaults, *node.args.kw_defaults) if d]
        stack.extend(reversed([c for c in children if isinstance(c, ast.AST)]))


def blocks(node: ast.AST) -> list[list[ast.stmt]]:
    """Every statement list in `node`'s scope (`walk` with `scope`): its own body and the bodies
    of its nested `if`, loops, `with`, `try` and its handlers, `match` cases, in source order."""
    found = [
        value
        for holder in walk(node, scope=True)
        if holder is node or not isinstance(holder, SCOPES)
        for value in (getattr(holder, name, None) for name in BLOCKS)
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt)
    ]
    return sorted(found, key=lambda block: (block[0].lineno, block[0].col_offset))


class AmbiguousDefinition(Exception):
    """A name a patch looks up is bound more than once in its scope. The last binding is the live
    one, so patching the first would patch dead code and still read as applied: this is drift."""

    def __init__(self, scope: ast.AST, name: str, lines: list[int]) -> None:
        self.scope, self.name, self.lines = scope, name, lines
        super().__init__(
            f"{name} is bound {len(lines)} times in one scope (lines "
            f"{', '.join(str(n) for n in lines)}); "
            "the last binding is the live one, so k3patch will not guess which to patch"
        )


def _binds(stmt: ast.stmt, name: str) -> bool:
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return stmt.name == name
    if isinstance(stmt, ast.Import | ast.ImportFrom):
        return name in imported_names(stmt)
    if isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        # Only a stored name binds: `name.attr = x` and `table[name] = x` read `name`.
        return name in stored_names(targets)
    return False


def bindings(body: Iterable[ast.stmt], name: str) -> list[ast.stmt]:
    """The statements of a scope's body that bind `name` in that scope (an import, a def, a
    class, an assignment to the bare name), in source order. The one rule for "what binds"."""
    return [stmt for stmt in body if _binds(stmt, name)]


def _bound_once(scope: ast.AST, body: list[ast.stmt], name: str, kind: type[T]) -> T | None:
    """The one statement of `body` that defines `name` as a `kind`, else None;
    AmbiguousDefinition when `name` is bound more than once there."""
    found = bindings(body, name)
    if len(found) > 1:
        raise AmbiguousDefinition(scope, name, [stmt.lineno for stmt in found])
    return found[0] if found and isinstance(found[0], kind) else None


# Each lookup raises AmbiguousDefinition where its scope binds the name twice.


def find_class(module: ast.Module, name: str) -> ast.ClassDef | None:
    return _bound_once(module, module.body, name, ast.ClassDef)


def find_method(cls: ast.ClassDef, name: str) -> ast.FunctionDef | None:
    return _bound_once(cls, cls.body, name, ast.FunctionDef)


def find_function(module: ast.Module, name: str) -> ast.FunctionDef | None:
    return _bound_once(module, module.body, name, ast.FunctionDef)


def find_def(module: ast.Module, path: str) -> ast.FunctionDef | None:
    """The function or method at `path` ("function", "Class.method"), each component looked up
    as find_class / find_method do; None for a class."""
    node: ast.stmt | ast.Module | None = module
    for part in path.split("."):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef):
            return None
        node = _bound_once(node, node.body, part, ast.stmt)
    return node if isinstance(node, ast.FunctionDef) else None


def mentioned_names(node: ast.AST, *, everything: bool = False) -> set[str]:
    """The names, attribute names and keyword-argument names a node mentions. With
    `everything`, also parameter names, def/class names and string constants (the identifiers
    a marker or a fork field can hide in)."""
    found: set[str] = set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name):
            found.add(child.id)
        elif isinstance(child, ast.Attribute):
            found.add(child.attr)
        elif isinstance(child, ast.keyword) and child.arg:
            found.add(child.arg)
        elif not everything:
            continue
        elif isinstance(child, ast.arg):
            found.add(child.arg)
        elif isinstance(child, ast.Constant) and isinstance(child.value, str):
            found.add(child.value)
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found.add(child.name)
    return found


def module_binds(module: ast.Module, name: str) -> bool:
    return bool(bindings(module.body, name))


def stored_names(nodes: Iterable[ast.AST]) -> set[str]:
    """The bare names assigned under `nodes` (targets, loop variables, `as` names of `with`)."""
    return {
        n.id
        for node in nodes
        for n in ast.walk(node)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }


def imported_names(node: ast.AST) -> set[str]:
    """The names the imports anywhere under `node` bind (`import a.b` binds `a`)."""
    return {
        (alias.asname or alias.name).split(".")[0]
        for n in ast.walk(node)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for alias in n.names
    }


def parameter_names(
    func: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda, *, positional: bool = False
) -> set[str]:
    """The named parameters of `func` (not `*args` or `**kwargs`); with `positional`, only
    those a caller can pass by position."""
    args = func.args
    return {
        a.arg for a in [*args.posonlyargs, *args.args, *([] if positional else args.kwonlyargs)]
    }


def attribute_owner(expr: ast.AST, attr: str) -> str | None:
    """The bare name `x` of an `x.<attr>` expression, else None."""
    if isinstance(expr, ast.Attribute) and expr.attr == attr and isinstance(expr.value, ast.Name):
        return expr.value.id
    return None


def callee_name(call: ast.Call) -> str:
    """`f` for `f(...)`, `m` for `a.b.m(...)`; "" for anything else (`f()()`, `t[k](...)`)."""
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
