"""Locating and classifying moriio-chunk-gate's two gates (stdlib ast only: classification must
stay fast): the gate `if` in its loop, the shapes it is in, and the progress comparisons that
decide exactly "final chunk" or "not yet"."""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from k3patch.edits import EditError, SourceText, header_end
from k3patch.model import (
    Shape,
    SiteResult,
    SourceFile,
    Verdict,
    find_method,
    find_scope,
    loaded_names,
    mentioned_names,
    normalised_dump,
    parent_map,
    stored_names,
)
from k3patch.shapes import blocks, match

from . import (
    CLASS,
    FILE,
    G1,
    G1_BLOCK_COUNT_D,
    G2_BLOCK_COUNT_D,
    GATE_WORDS,
    LEGACY_APPLIED,
    LEGACY_PENDING,
    METHOD,
    SATISFIED_INLINE,
    SATISFIED_UPSTREAM,
    SHAPES,
    UPSTREAM_HELPER,
)

# --------------------------------------------------------------------------------------------
# Locating the gates (stdlib ast only: classification must stay fast).


def method_of(module: ast.Module) -> ast.FunctionDef | None:
    found = find_scope(module, f"{CLASS}.{METHOD}")
    return found if isinstance(found, ast.FunctionDef) else None


def expr_dump(source: str) -> str:
    return normalised_dump(ast.parse(source, mode="eval").body)


@dataclass
class Gate:
    """A final-chunk gate: the `if`, the block that holds it, the named temporaries right
    before it that feed its test, and the compound statements between its loop and it."""

    site: str
    loop: ast.For
    block: list[ast.stmt]
    index: int
    temps: list[ast.Assign]
    node: ast.If
    conditions: list[ast.stmt]

    def found(self) -> str:
        """The gate as a drift report shows it: its conditions, temporaries and header."""
        heads = [ast.unparse(c).splitlines()[0] for c in self.conditions]
        lines = [f"{'    ' * i}{head}" for i, head in enumerate(heads)]
        pad = "    " * len(self.conditions)
        lines += [f"{pad}{ast.unparse(t)}" for t in self.temps]
        return "\n".join([*lines, f"{pad}if {ast.unparse(self.node.test)}:", f"{pad}    ..."])


def _temps_before(block: list[ast.stmt], index: int, test: ast.expr) -> list[ast.Assign]:
    """The run of `name = ...` statements right before block[index] that feed its test."""
    wanted = loaded_names([test])
    temps: list[ast.Assign] = []
    for stmt in reversed(block[:index]):
        if not (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id in wanted
        ):
            break
        temps.insert(0, stmt)
        wanted |= loaded_names([stmt.value])
    return temps


def _gates_in(loop: ast.For, site: str) -> list[Gate]:
    parents = parent_map(loop)
    found = []
    for block in blocks(loop):
        for index, stmt in enumerate(block):
            if not isinstance(stmt, ast.If):
                continue
            temps = _temps_before(block, index, stmt.test)
            words = mentioned_names(stmt.test).union(*(mentioned_names(t.value) for t in temps))
            if not GATE_WORDS & words:
                continue
            conditions: list[ast.stmt] = []
            node = parents[id(stmt)]
            while node is not loop:
                if isinstance(node, ast.stmt):
                    conditions.insert(0, node)
                node = parents[id(node)]
            found.append(Gate(site, loop, block, index, temps, stmt, conditions))
    return found


def loops(method: ast.FunctionDef, attribute: str) -> list[ast.For]:
    return [
        node
        for node in ast.walk(method)
        if isinstance(node, ast.For) and attribute in mentioned_names(node.iter)
    ]


# --------------------------------------------------------------------------------------------
# What the surroundings say (names only, and the preconditions of the rewrite).

# The surroundings of the gates name the upstream release they come from (the gates of A, B, C
# and the fork are the same statements).
_WRITE_MODE = "self.mode == MoRIIOMode.WRITE"
_PRODUCER = "get_role() == ROLE.PRODUCER"
_PRODUCER_BRANCH = f"{_WRITE_MODE} and {_PRODUCER}"
_NOT_PENDING_SKIP = "req_id not in self._reqs_need_pending_save"
# The fork's mamba-blockids edit (SITES.md 1), as statements: `update_state_after_alloc` files
# each saved request's mamba block ids under `self._reqs_save_mamba[request.request_id]`, a map
# that `__init__` starts empty. A name alone decides nothing.
_FORK_STARTS_EMPTY = ("self._reqs_save_mamba = {}", "self._reqs_save_mamba: HOLE_type = {}")
_FORK_FILES_BLOCKS = "self._reqs_save_mamba[HOLE_key] = HOLE_value"


@dataclass
class Context:
    module: ast.Module
    method: ast.FunctionDef
    cls: ast.ClassDef
    parents: dict[int, ast.AST] = field(default_factory=dict)

    @classmethod
    def of(cls, module: ast.Module) -> Context:
        method = method_of(module)
        klass = find_scope(module, CLASS)
        if method is None or not isinstance(klass, ast.ClassDef):
            raise ValueError(f"{CLASS}.{METHOD} is gone")
        return cls(module, method, klass, parent_map(method))

    def params(self) -> set[str]:
        args = self.method.args
        return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}

    def release(self, d_shape: bool) -> str:
        """Which upstream release (or the fork) the surroundings of the gates come from: the
        producer branch around the G1 loop and the G1 loop's own skip."""
        if d_shape:
            return "D (0.30.0-0.31.0)"
        g1, _ = locate(self, G1)
        if g1 is None:
            return "block-count gates of A-C, in surroundings of no known release"
        tests: set[str] = set()
        node: ast.AST = g1.loop
        while id(node) in self.parents:
            node = self.parents[id(node)]
            if isinstance(node, ast.If):
                tests.add(normalised_dump(node.test))
        nested = expr_dump(_WRITE_MODE) in tests and expr_dump(_PRODUCER) in tests
        combined = expr_dump(_PRODUCER_BRANCH) in tests
        skips = any(
            isinstance(n, ast.If)
            and normalised_dump(n.test) == expr_dump(_NOT_PENDING_SKIP)
            and len(n.body) == 1
            and isinstance(n.body[0], ast.Continue)
            for n in ast.walk(g1.loop)
        )
        if nested and not skips:
            return "A (0.14.1-0.23.0)"
        if combined and not skips:
            return "B (0.24.0-0.27.1)"
        if combined and skips:
            return "the fork (shape C gates)" if _is_fork(self.cls) else "C (0.28.0-0.29.0)"
        return "block-count gates of A-C, in surroundings of no known release"


def locate(context: Context, site: str) -> tuple[Gate | None, str]:
    """The one gate of a site, or None and why."""
    attribute = "scheduled_cached_reqs" if site == G1 else "_reqs_need_save"
    where = "scheduler_output.scheduled_cached_reqs" if site == G1 else "self._reqs_need_save"
    what = f"a loop over {where} that holds a final-chunk gate"
    found = [loop for loop in loops(context.method, attribute) if _gates_in(loop, site)]
    if len(found) != 1:
        return None, f"expected one {what} in {METHOD}, found {len(found)}"
    gates = _gates_in(found[0], site)
    if len(gates) != 1:
        return None, (
            f"expected one final-chunk gate (an `if` on num_prompt_tokens) in {what}, "
            f"found {len(gates)}"
        )
    return gates[0], ""


def _is_fork(cls: ast.ClassDef) -> bool:
    """Whether the scheduler carries the fork's mamba-blockids edit (SITES.md 1): __init__
    starts `self._reqs_save_mamba` empty and update_state_after_alloc files a saved request's
    mamba block ids under it."""
    init = find_method(cls, "__init__")
    alloc = find_method(cls, "update_state_after_alloc")
    if init is None or alloc is None:
        return False
    starts_empty = any(
        match(p, n) is not None
        for n in ast.walk(init)
        if isinstance(n, ast.Assign | ast.AnnAssign)
        for p in _FORK_STARTS_EMPTY
    )
    files_blocks = any(
        (b := match(_FORK_FILES_BLOCKS, n)) is not None
        and "request_id" in mentioned_names(b["HOLE_key"])
        for n in ast.walk(alloc)
        if isinstance(n, ast.Assign)
    )
    return starts_empty and files_blocks


def site_result(
    site: str,
    verdict: Verdict,
    detail: str,
    shape: str = "",
    line: int | None = None,
    found: str = "",
) -> SiteResult:
    drifted = verdict is Verdict.DRIFTED and line is not None
    return SiteResult(
        patch_id="moriio-chunk-gate",
        site=site,
        file=FILE,
        verdict=verdict,
        shape=shape,
        detail=detail,
        line=line,
        found=found if drifted else "",
        expected=expected(site) if drifted else (),
    )


def expected(site: str) -> tuple[str, ...]:
    shapes = [f"{s.name} ({s.verdict.value})" for s in SHAPES[site]]
    return (
        *shapes,
        f"{SATISFIED_UPSTREAM} (satisfied)",
        f"{SATISFIED_INLINE} (satisfied)",
        f"{LEGACY_PENDING} (pending)",
        f"{LEGACY_APPLIED} (applied)",
    )


def classify_gate(src: SourceFile, context: Context, gate: Gate) -> SiteResult:
    def result(verdict: Verdict, shape: str, detail: str) -> SiteResult:
        return site_result(gate.site, verdict, detail, shape, gate.node.lineno, gate.found())

    for shape in SHAPES[gate.site]:
        if shape.match(gate.loop.body) is None:
            continue
        problems = _preconditions(src, context, gate, shape)
        if problems:
            return result(Verdict.DRIFTED, "", f"{shape.name} gate, but " + "; ".join(problems))
        if shape.verdict is Verdict.PENDING:
            release = context.release(shape in (G1_BLOCK_COUNT_D, G2_BLOCK_COUNT_D))
            return result(Verdict.PENDING, release, shape.origin)
        return result(shape.verdict, shape.name, shape.origin)
    return _classify_fixed(context, gate, result)


def _classify_fixed(
    context: Context, gate: Gate, result: Callable[[Verdict, str, str], SiteResult]
) -> SiteResult:
    """The fixed forms nobody but upstream writes: a progress gate, inline or through
    upstream's helper, that decides exactly what its body needs."""

    def drift(detail: str) -> SiteResult:
        return result(Verdict.DRIFTED, "", detail)

    test = gate.node.test
    wanted = needed_meaning(gate.node)
    env = _env(gate.temps)
    core, times = negated(test)
    upstream = calls(core, UPSTREAM_HELPER)
    meaning = flip(FINAL, times) if upstream else progress_meaning(test, env)
    if meaning is None:
        return drift("the gate is in no shape k3patch knows; nothing will be written")
    if upstream and not _helper_is_progress(context):
        return drift(
            f"the gate calls self.{UPSTREAM_HELPER}, whose body is no progress comparison "
            "(num_computed_tokens + num_scheduled_tokens >= num_prompt_tokens)"
        )
    if meaning != wanted:
        return drift(_wrong_progress(meaning, wanted))
    if any("new_block_ids" in mentioned_names(getattr(c, "test", c)) for c in gate.conditions):
        return drift(
            "a progress gate, but still only evaluated when the step allocated a new "
            "block: a final chunk without a new block would never send"
        )
    guard = expr_dump("req_id in self._reqs_need_pending_save")
    if any(normalised_dump(getattr(c, "test", c)) == guard for c in gate.conditions):
        return drift("k3patch's gate, edited since k3patch wrote it")
    if gate.conditions:
        # Upstream's gates sit directly in their loops; a progress gate that only runs
        # under some other condition is a form nobody has described.
        return drift("a progress gate nested under a condition k3patch does not know")
    name = SATISFIED_UPSTREAM if upstream else SATISFIED_INLINE
    return result(Verdict.SATISFIED, name, "gates on compute progress")


FINAL = "final"
NOT_FINAL = "not final"
WRONG = "wrong"


def needed_meaning(gate: ast.If) -> str:
    """What a gate's test must mean: "final" where its body sends the request, "not final"
    where the body defers or skips it (upstream's `if not final: continue`)."""
    sends = any(
        isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "add_new_req"
        for stmt in gate.body
        for n in ast.walk(stmt)
    )
    return FINAL if sends else NOT_FINAL


def _wrong_progress(meaning: str, wanted: str) -> str:
    if meaning == WRONG:
        return (
            "a comparison of progress with the prompt, but not `progress >= num_prompt_tokens` "
            "(final) or `progress < num_prompt_tokens` (not yet): an inverted, off-by-one or "
            "slack gate; nothing will be written"
        )
    return (
        f"a progress gate whose test means {meaning!r} where its body needs {wanted!r} "
        "(inverted); nothing will be written"
    )


def negated(expr: ast.expr) -> tuple[ast.expr, int]:
    """`expr` without its leading `not`s, and how many there were."""
    count = 0
    while isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        expr, count = expr.operand, count + 1
    return expr, count


def flip(meaning: str, times: int) -> str:
    if meaning == WRONG or times % 2 == 0:
        return meaning
    return NOT_FINAL if meaning == FINAL else FINAL


def calls(expr: ast.expr, name: str) -> bool:
    if not isinstance(expr, ast.Call):
        return False
    func = expr.func
    return (isinstance(func, ast.Name) and func.id == name) or (
        isinstance(func, ast.Attribute)
        and func.attr == name
        and isinstance(func.value, ast.Name)
        and func.value.id == "self"
    )


def _env(assigns: Sequence[ast.stmt]) -> dict[str, ast.expr]:
    """The named temporaries among `assigns`: name -> value."""
    return {
        s.targets[0].id: s.value
        for s in assigns
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name)
    }


def _resolve(expr: ast.expr, env: dict[str, ast.expr], depth: int = 0) -> ast.expr:
    """`expr` with each name bound in `env` (the named temporaries) replaced by its value."""
    if isinstance(expr, ast.Name) and expr.id in env and depth < 4:
        return _resolve(env[expr.id], env, depth + 1)
    return expr


def _is_attr(expr: ast.expr, attr: str) -> str | None:
    """The name `x` of an `x.<attr>` expression, else None."""
    if isinstance(expr, ast.Attribute) and expr.attr == attr and isinstance(expr.value, ast.Name):
        return expr.value.id
    return None


# This step's scheduled tokens of a request, as vLLM and the older scripts read them.
_SCHEDULED = (
    "HOLE_out.num_scheduled_tokens[HOLE_key]",
    "HOLE_out.num_scheduled_tokens.get(HOLE_key)",
    "HOLE_out.num_scheduled_tokens.get(HOLE_key, 0)",
)


def _progress_of(expr: ast.expr, env: dict[str, ast.expr]) -> str | None:
    """The request name `r` of `r.num_computed_tokens + <this step's scheduled tokens>`."""
    expr = _resolve(expr, env)
    if not (isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add)):
        return None
    for computed, scheduled in ((expr.left, expr.right), (expr.right, expr.left)):
        req = _is_attr(_resolve(computed, env), "num_computed_tokens")
        if req is not None and any(
            match(p, _resolve(scheduled, env)) is not None for p in _SCHEDULED
        ):
            return req
    return None


_MIRROR: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.Gt,
    ast.Gt: ast.Lt,
    ast.LtE: ast.GtE,
    ast.GtE: ast.LtE,
    ast.Eq: ast.Eq,
    ast.NotEq: ast.NotEq,
}


def progress_meaning(expr: ast.expr, env: dict[str, ast.expr]) -> str | None:
    """What a test decides about compute progress: "final" for `progress >= prompt`, "not
    final" for `progress < prompt` (mirrored forms and `not` included), "wrong" for any other
    comparison of progress with the prompt, None when the test is no such comparison."""
    core, times = negated(expr)
    core = _resolve(core, env)
    if not isinstance(core, ast.Compare):
        return None
    resolved = {w for node in ast.walk(core) for w in _resolved_words_of(node, env)}
    about_progress = {"num_computed_tokens", "num_prompt_tokens"} <= resolved
    if len(core.ops) != 1:
        return WRONG if about_progress else None
    left, right, op = core.left, core.comparators[0], type(core.ops[0])
    req = _progress_of(left, env)
    prompt = _is_attr(_resolve(right, env), "num_prompt_tokens")
    if req is None or prompt is None:
        req = _progress_of(right, env)
        prompt = _is_attr(_resolve(left, env), "num_prompt_tokens")
        op = _MIRROR.get(op, op)
    if req is None or prompt is None or req != prompt:
        return WRONG if about_progress else None
    if op is ast.GtE:
        return flip(FINAL, times)
    if op is ast.Lt:
        return flip(NOT_FINAL, times)
    return WRONG


def _resolved_words_of(node: ast.AST, env: dict[str, ast.expr]) -> set[str]:
    words = mentioned_names(node)
    if isinstance(node, ast.Name) and node.id in env:
        words |= mentioned_names(_resolve(node, env))
    return words


def _helper_is_progress(context: Context) -> bool:
    helper = find_method(context.cls, UPSTREAM_HELPER)
    if helper is None:
        return False
    env = _env(list(helper.body))
    returns = [n for n in ast.walk(helper) if isinstance(n, ast.Return)]
    return bool(returns) and all(
        n.value is not None and progress_meaning(n.value, env) == FINAL for n in returns
    )


def _preconditions(src: SourceFile, context: Context, gate: Gate, shape: Shape) -> list[str]:
    """Why a gate in a known shape still cannot take (or does not hold) the post-image."""
    problems = []
    if shape.verdict is Verdict.PENDING and not _header_editable(src.text, gate):
        problems.append("its header shares lines with other code")
    if shape.verdict is Verdict.PENDING and "scheduler_output" not in context.params():
        problems.append(f"{METHOD} has no parameter named scheduler_output")
    bound = stored_names([gate.loop.target])
    needs = {"req_id"} if gate.site == G1 else {"req_id", "req"}
    if not needs <= bound:
        problems.append(f"the loop does not bind {', '.join(sorted(needs - bound))}")
    for temp in gate.temps if shape.verdict is Verdict.PENDING else ():
        name = temp.targets[0].id  # type: ignore[attr-defined]
        if name in loaded_names(gate.loop.body, skip=[*gate.temps, gate.node.test]):
            problems.append(f"{name} is read outside the gate test; it cannot be dropped")
        if any(s is not temp and s.lineno == temp.lineno for s in gate.block):
            problems.append(f"{name} shares its line with another statement")
    if gate.site == G1:
        if shape.verdict is Verdict.PENDING and gate.index == len(gate.temps):
            # The branch keeps the statements before the gate; with none it would be empty.
            problems.append("it is all that `if new_block_ids is not None:` holds")
        problems.extend(_g1_body_problems(gate, shape))
    return problems


def _g1_body_problems(gate: Gate, shape: Shape) -> list[str]:
    """G1's body runs outside `if new_block_ids is not None:` after the rewrite, so it must not
    read what only that branch binds (`req` is rebound by the post-image)."""
    if shape.verdict is Verdict.PENDING:
        branch = gate.conditions[0]
        assert isinstance(branch, ast.If)
        before = gate.block[: gate.index]
        local = (stored_names(before) | loaded_names([branch.test])) - {"req"}
    else:
        index = gate.loop.body.index(gate.conditions[0] if gate.conditions else gate.node)
        siblings = [
            s
            for s in gate.loop.body[:index]
            if isinstance(s, ast.If) and "new_block_ids" in mentioned_names(s.test)
        ]
        local = stored_names([s for sibling in siblings for s in sibling.body]) - {"req"}
    read = loaded_names(gate.node.body + gate.node.orelse) & local
    if read:
        return [
            "its body reads " + ", ".join(sorted(read)) + ", bound only when the step "
            "allocated a block"
        ]
    return []


def _header_editable(text: str, gate: Gate) -> bool:
    """Whether the gate (and G1's branch) start their lines and the header's `:` can be found:
    the rewrite replaces whole header lines and leaves the gate's body as it is."""
    src = SourceText(text)
    try:
        for stmt in [gate.node, *gate.temps, *gate.conditions[:1]]:
            src.indent_of(stmt)
        header_end(src, gate.node)
    except EditError:
        return False
    return True
