"""The names moriio-chunk-gate's checks follow: what code reads, binds or leaves unbound."""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterable, Mapping, Sequence

from k3patch.astkit import (
    attribute_owner,
    imported_names,
    mentioned_names,
    parameter_names,
    stored_names,
)


def loaded_names(nodes: Iterable[ast.AST], skip: Iterable[ast.AST] = ()) -> set[str]:
    """The bare names read under `nodes`, not counting the subtrees in `skip` (by identity)."""
    skipped = {id(node) for node in skip}
    found: set[str] = set()
    stack = [node for node in nodes if id(node) not in skipped]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            found.add(node.id)
        stack.extend(c for c in ast.iter_child_nodes(node) if id(c) not in skipped)
    return found


def attribute_names(nodes: Iterable[ast.AST], owner: str, ctx: type[ast.expr_context]) -> set[str]:
    """The attributes of the bare name `owner` that `nodes` read (ast.Load) or assign (Store)."""
    return {
        n.attr
        for node in nodes
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == owner
        and isinstance(n.ctx, ctx)
    }


def attribute_assignments(nodes: Iterable[ast.AST], owner: str) -> list[tuple[str, ast.expr]]:
    """(attribute, value) of every one-target `owner.attribute [: T] = value` under `nodes`."""
    found = []
    for n in (n for node in nodes for n in ast.walk(node)):
        if isinstance(n, ast.Assign) and len(n.targets) == 1:
            target, value = n.targets[0], n.value
        elif isinstance(n, ast.AnnAssign) and n.value is not None:
            target, value = n.target, n.value
        else:
            continue
        if isinstance(target, ast.Attribute) and attribute_owner(target, target.attr) == owner:
            found.append((target.attr, value))
    return found


def assigned_name(stmt: ast.AST) -> str | None:
    """The name a plain `name = value` binds (one target, a bare name); else None."""
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
        target = stmt.targets[0]
        return target.id if isinstance(target, ast.Name) else None
    return None


def named_values(stmts: Iterable[ast.AST]) -> dict[str, ast.expr]:
    """name -> value of the plain `name = value` statements among `stmts` (the last one wins)."""
    return {
        name: s.value for s in stmts if (name := assigned_name(s)) and isinstance(s, ast.Assign)
    }


def resolve_name(expr: ast.expr, values: Mapping[str, ast.expr], limit: int = 4) -> ast.expr:
    """`expr`, or the value the bare name names, followed at most `limit` times (cycles stop)."""
    while limit > 0 and isinstance(expr, ast.Name) and expr.id in values:
        expr, limit = values[expr.id], limit - 1
    return expr


def temporaries_before(block: Sequence[ast.stmt], index: int, expr: ast.AST) -> list[ast.Assign]:
    """The run of `name = value` right before `block[index]` that `expr` reads, directly or
    through one another, in source order."""
    wanted = loaded_names([expr])
    temps: list[ast.Assign] = []
    for stmt in reversed(block[:index]):
        if not isinstance(stmt, ast.Assign) or assigned_name(stmt) not in wanted:
            break
        temps.insert(0, stmt)
        wanted |= loaded_names([stmt.value])
    return temps


def unbound_names(nodes: Iterable[ast.AST], module: ast.Module, func: ast.FunctionDef) -> set[str]:
    """The bare names `nodes` (in `func`, of `module`) read that nothing binds: not the module as
    it runs, the builtins, nor anything in `func` (coarse). Reading one raises NameError."""
    bound = runtime_module_names(module) | set(dir(builtins)) | parameter_names(func)
    return loaded_names(nodes) - bound - imported_names(func) - stored_names([func])


def unset_attributes(nodes: Iterable[ast.AST], cls: ast.ClassDef) -> set[str]:
    """The attributes of `self` that `nodes` read and `cls` neither assigns nor defines as methods.
    Reading one raises AttributeError."""
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    return (
        attribute_names(nodes, "self", ast.Load)
        - attribute_names([cls], "self", ast.Store)
        - methods
    )


def runtime_module_names(module: ast.Module) -> set[str]:
    """The names a module binds when it runs, also in top-level `if` and `try` blocks, but not
    under `if TYPE_CHECKING:`."""
    names: set[str] = set()

    def visit(block: list[ast.stmt]) -> None:
        for node in block:
            if isinstance(node, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                names.update(stored_names([node]))
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in mentioned_names(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                for sub in (node.body, *(h.body for h in node.handlers), node.orelse):
                    visit(sub)
                visit(node.finalbody)

    visit(module.body)
    return names
