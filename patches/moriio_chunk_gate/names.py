"""What moriio-chunk-gate's checks read of the code: where a node sits, the names code reads, binds
or leaves unbound, and what a final-chunk gate's test means (compute progress:
`num_computed_tokens` plus this step's scheduled tokens, against the prompt)."""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeGuard

from k3patch.astkit import (
    attribute_owner,
    imported_names,
    mentioned_names,
    parameter_names,
    stored_names,
)
from k3patch.shapes import match

FINAL, NOT_FINAL, WRONG = "final", "not final", "wrong"


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


def strip_nots(expr: ast.expr) -> tuple[ast.expr, int]:
    """`expr` without its leading `not`s, and how many there were."""
    count = 0
    while isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        expr, count = expr.operand, count + 1
    return expr, count


def is_call_to(expr: ast.AST, name: str, owner: str = "self") -> TypeGuard[ast.Call]:
    """Whether `expr` calls `name(...)` or `<owner>.name(...)`."""
    if not isinstance(expr, ast.Call):
        return False
    func = expr.func
    return (isinstance(func, ast.Name) and func.id == name) or attribute_owner(func, name) == owner


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
        side = resolve_name(side, env)
        if not (isinstance(side, ast.BinOp) and isinstance(side.op, ast.Add)):
            return None
        for computed, scheduled in ((side.left, side.right), (side.right, side.left)):
            req = attribute_owner(resolve_name(computed, env), "num_computed_tokens")
            step = resolve_name(scheduled, env)
            if req is not None and any(match(p, step) is not None for p in _SCHEDULED):
                return req
        return None

    core, times = strip_nots(expr)
    core = resolve_name(core, env)
    if not isinstance(core, ast.Compare):
        return None
    resolved = [resolve_name(n, env) for n in ast.walk(core) if isinstance(n, ast.Name)]
    words = mentioned_names(core).union(*map(mentioned_names, resolved))
    wrong = WRONG if {"num_computed_tokens", "num_prompt_tokens"} <= words else None
    if len(core.ops) != 1:
        return wrong
    left, right, op = core.left, core.comparators[0], type(core.ops[0])
    req = progress_of(left)
    prompt = attribute_owner(resolve_name(right, env), "num_prompt_tokens")
    if req is None or prompt is None:
        req, op = progress_of(right), _MIRRORED.get(op, op)
        prompt = attribute_owner(resolve_name(left, env), "num_prompt_tokens")
    if req is None or req != prompt:
        return wrong
    return flip(_MEANING.get(op, WRONG), times)
