"""What moriio-chunk-gate's checks read of the code around a gate: where a node sits, and the
names code reads, binds or leaves unbound (a chain that reads an unbound name raises)."""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterable, Mapping, Sequence

from k3patch.astkit import (
    SCOPES,
    attribute_owner,
    imported_names,
    mentioned_names,
    parameter_names,
    stored_names,
    walk,
)


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


def loaded_names(nodes: Iterable[ast.AST], skip: Iterable[ast.AST] = ()) -> set[str]:
    """The bare names read under `nodes`, not counting the subtrees in `skip` (by identity)."""
    skipped = {id(n) for node in skip for n in ast.walk(node)}
    found = (n for node in nodes for n in walk(node) if id(n) not in skipped)
    return {n.id for n in found if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def attribute_names(nodes: Iterable[ast.AST], owner: str, ctx: type[ast.expr_context]) -> set[str]:
    """The attributes of the bare name `owner` that `nodes` read (ast.Load) or assign (Store)."""
    found = (n for node in nodes for n in ast.walk(node) if isinstance(n, ast.Attribute))
    return {n.attr for n in found if attribute_owner(n, n.attr) == owner and isinstance(n.ctx, ctx)}


def loops_over(node: ast.AST, over: str) -> list[ast.For]:
    """The `for` loops under `node` (itself included) whose iterable mentions the last name of
    `over` (`self._reqs_need_save`: `_reqs_need_save`)."""
    name = over.rsplit(".", 1)[-1]
    return [n for n in ast.walk(node) if isinstance(n, ast.For) and name in mentioned_names(n.iter)]


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
    """The names a module binds when it runs (imports, defs, classes, assignments in its own
    scope), not under `if TYPE_CHECKING:`."""
    nodes = list(walk(module, scope=True))
    typing_only = {
        id(n)
        for node in nodes
        if isinstance(node, ast.If) and "TYPE_CHECKING" in mentioned_names(node.test)
        for stmt in node.body
        for n in ast.walk(stmt)
    }
    names: set[str] = set()
    for node in (n for n in nodes if id(n) not in typing_only):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names |= imported_names(node)
        elif isinstance(node, SCOPES):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            names |= stored_names([node])
    return names
