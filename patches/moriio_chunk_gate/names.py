"""The names moriio-chunk-gate's checks follow through the connector's code: what a statement
reads, binds or leaves unbound, a gate's temporaries, and the attributes of `self`."""

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
    """The attributes of the bare name `owner` (`self`) that `nodes` read (ctx ast.Load) or
    assign (ast.Store)."""
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
    """(attribute, value) of every one-target `owner.attribute = value` and
    `owner.attribute: T = value` under `nodes` (nested scopes included), in `ast.walk` order."""
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
    """The name a plain `name = value` statement binds (one target, a bare name); else None."""
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
    """`expr`, or, when it is a bare name in `values`, the value it names, followed through
    further names at most `limit` times in all (a cycle stops there)."""
    while limit > 0 and isinstance(expr, ast.Name) and expr.id in values:
        expr, limit = values[expr.id], limit - 1
    return expr


def temporaries_before(block: Sequence[ast.stmt], index: int, expr: ast.AST) -> list[ast.Assign]:
    """The run of plain `name = value` statements right before `block[index]` that `expr` reads,
    directly or through one another, in source order: it ends at the first statement that is
    not such a temporary."""
    wanted = loaded_names([expr])
    temps: list[ast.Assign] = []
    for stmt in reversed(block[:index]):
        if not isinstance(stmt, ast.Assign) or assigned_name(stmt) not in wanted:
            break
        temps.insert(0, stmt)
        wanted |= loaded_names([stmt.value])
    return temps


def unbound_names(nodes: Iterable[ast.AST], module: ast.Module, func: ast.FunctionDef) -> set[str]:
    """The bare names `nodes` (code of `func`, a function of `module`) read that nothing binds:
    not the module as it runs, not the builtins, not `func`'s parameters, nor an assignment or
    import anywhere in `func` (coarse: bound somewhere in it counts as bound). Reading one
    raises NameError."""
    bound = runtime_module_names(module) | set(dir(builtins)) | parameter_names(func)
    return loaded_names(nodes) - bound - imported_names(func) - stored_names([func])


def unset_attributes(nodes: Iterable[ast.AST], cls: ast.ClassDef) -> set[str]:
    """The attributes of `self` that `nodes` read but that nothing in `cls` assigns to `self`
    and that are not methods of `cls`. Reading one raises AttributeError."""
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    return (
        attribute_names(nodes, "self", ast.Load)
        - attribute_names([cls], "self", ast.Store)
        - methods
    )


def runtime_module_names(module: ast.Module) -> set[str]:
    """The names a module binds when it runs: top-level imports, defs, classes and assignments,
    also inside top-level `if` and `try` blocks, but not under `if TYPE_CHECKING:` (those
    imports exist only for the type checker)."""
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
