"""What a final-chunk gate's test means: compute progress (`num_computed_tokens` plus this step's
scheduled tokens) against the prompt."""

from __future__ import annotations

import ast

from k3patch.astkit import attribute_owner, mentioned_names
from k3patch.shapes import match

from .names import resolve_name

FINAL, NOT_FINAL, WRONG = "final", "not final", "wrong"


def strip_nots(expr: ast.expr) -> tuple[ast.expr, int]:
    """`expr` without its leading `not`s, and how many there were."""
    count = 0
    while isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        expr, count = expr.operand, count + 1
    return expr, count


def is_call_to(expr: ast.AST, name: str, owner: str = "self") -> bool:
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
