"""moriio-chunk-gate: the MoRIIO WRITE producer sends a request's KV after its final prefill chunk.

Symptom: with Kimi-K3 behind a MoRIIO WRITE-mode prefill/decode pair, the decode node answers as
if the prompt ended after 2,048 tokens (recall dies at exactly max_num_batched_tokens), and a
request whose final chunk allocates no new KV block is never sent at all and hangs.
Cause: `MoRIIOConnectorScheduler.build_connector_meta` decides "this is the final prefill chunk,
send now" by block count (`blocks * block_size >= num_prompt_tokens`), in two gates: G1 in the
loop over `scheduled_cached_reqs`, G2 in the loop over `_reqs_need_save`. K3's attention pages are
padded to the mamba page (about 5,760 tokens a block), so one block covers a whole prompt after
its first 2,048-token chunk and the KV of the later chunks never crosses. G1 also sits under
`if new_block_ids is not None:`, so a final chunk that needs no new block never reaches it.
Fix: both gates decide on compute progress, `req.num_computed_tokens +
scheduler_output.num_scheduled_tokens.get(req_id, 0) >= req.num_prompt_tokens` (bCM runs before
the scheduler advances `num_computed_tokens`, so this step's chunk is added; no slack), and G1 is
evaluated for every pending request, also when the step allocated no block. Only the two gate
statements change; the accumulated block lists are built exactly as before. vLLM 0.32.0 and later
carry the same fix (`_is_final_prefill_chunk`); the older k3-chunk-gate script's form is accepted.
Check: `k3patch verify` drives the real `build_connector_meta` of the tree with synthetic
scheduler steps (no GPU, no cluster): a 2,611-token prompt in one 5,760-token block, chunks of
2,048 and 563, must emit its save once, with the second chunk; so must a 3-chunk prompt at its
third chunk, and a prompt whose last chunk is 2 tokens.
"""

from __future__ import annotations

import ast
import builtins
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from k3patch.model import (
    Patch,
    ProbeOutcome,
    Shape,
    SiteResult,
    SourceFile,
    Sources,
    Verdict,
    find_class,
    find_method,
    mentioned_names,
    normalised_dump,
    site_fingerprint,
)

FILE = "distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"
MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.moriio.moriio_connector"
CLASS = "MoRIIOConnectorScheduler"
METHOD = "build_connector_meta"
G1 = f"{METHOD} G1 (cached requests)"
G2 = f"{METHOD} G2 (_reqs_need_save)"

# --------------------------------------------------------------------------------------------
# The shapes. A site is a gate `if` in its loop, reduced to a skeleton: the gate's test, the
# named temporaries that feed it, and the conditions it is nested under between the loop and
# the gate; `...` stands for statements the patch neither reads nor writes (the gate's body,
# the block accumulation around it). The skeletons are compared by AST fingerprint, so
# formatting, parentheses and comments do not matter.

G1_BLOCK_COUNT = Shape(
    "A-C / fork",
    Verdict.PENDING,
    """
    ...
    if new_block_ids is not None:
        ...
        if len(self._reqs_need_pending_save[req_id][1]) * self.block_size >= req.num_prompt_tokens:
            ...
    """,
    origin="block count, evaluated only when the step allocated a new block",
)
G1_BLOCK_COUNT_D = Shape(
    "D (0.30.0-0.31.0)",
    Verdict.PENDING,
    """
    ...
    if new_block_ids is not None:
        ...
        saved_tokens = len(updated_blocks[self._full_attn_group_idx]) * self._full_attn_block_size
        if saved_tokens >= req.num_prompt_tokens:
            ...
    """,
    origin="block count of the full-attention group, evaluated only when a block was allocated",
)
G1_APPLIED = Shape(
    "k3patch",
    Verdict.APPLIED,
    """
    ...
    if req_id in self._reqs_need_pending_save:
        req = self._reqs_need_pending_save[req_id][0]
        if (
            req.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            >= req.num_prompt_tokens
        ):
            ...
    """,
    origin="compute progress, for every pending request",
)
G2_BLOCK_COUNT = Shape(
    "A-C / fork",
    Verdict.PENDING,
    """
    ...
    if req.num_prompt_tokens > len(block_ids) * self.block_size:
        ...
    ...
    """,
    origin="block count",
)
G2_BLOCK_COUNT_D = Shape(
    "D (0.30.0-0.31.0)",
    Verdict.PENDING,
    """
    ...
    tokens_covered = len(block_ids[self._full_attn_group_idx]) * self._full_attn_block_size
    if req.num_prompt_tokens > tokens_covered:
        ...
    ...
    """,
    origin="block count of the full-attention group",
)
G2_APPLIED = Shape(
    "k3patch",
    Verdict.APPLIED,
    """
    ...
    if (
        req.num_computed_tokens + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        < req.num_prompt_tokens
    ):
        ...
    ...
    """,
    origin="compute progress",
)
SHAPES: dict[str, tuple[Shape, ...]] = {
    G1: (G1_BLOCK_COUNT, G1_BLOCK_COUNT_D, G1_APPLIED),
    G2: (G2_BLOCK_COUNT, G2_BLOCK_COUNT_D, G2_APPLIED),
}

# Fixed forms recognised by predicate rather than by one skeleton (SITES.md 2): any comparison
# of `num_computed_tokens + ...num_scheduled_tokens...` against `num_prompt_tokens`, directly or
# through upstream's `_is_final_prefill_chunk`, and the older anchor script's helper.
UPSTREAM_HELPER = "_is_final_prefill_chunk"
LEGACY_HELPER = "_k3_prefill_done"
LEGACY_MAP = "_k3_prog"
SATISFIED_UPSTREAM = "upstream fix (_is_final_prefill_chunk, 0.32.0 and later)"
SATISFIED_INLINE = "upstream-style progress gate (inline)"
SATISFIED_LEGACY = "older anchor script's fixed form (k3-chunk-gate)"
LEGACY_CAVEAT = (
    "its K3_CHUNK_GATE_SLACK (default 2) can send up to 2 tokens before the prompt is complete; "
    "set K3_CHUNK_GATE_SLACK=0, or reinstall vLLM and apply k3patch"
)
# Names whose appearance in an `if` test makes it a final-chunk gate.
GATE_WORDS = frozenset({"num_prompt_tokens", UPSTREAM_HELPER, LEGACY_HELPER})

# The surroundings of the gates name the upstream release they come from (the gates of A, B, C
# and the fork are the same statements).
_WRITE_MODE = "self.mode == MoRIIOMode.WRITE"
_PRODUCER = "get_role() == ROLE.PRODUCER"
_PRODUCER_BRANCH = f"{_WRITE_MODE} and {_PRODUCER}"
_NOT_PENDING_SKIP = "req_id not in self._reqs_need_pending_save"
_FORK_NAMES = frozenset({"_reqs_save_mamba", "mamba_local_block_ids"})

# --------------------------------------------------------------------------------------------
# The post-image. Only the gate headers are new; each gate keeps its original body.

MARKER_G1 = (
    "# k3patch moriio-chunk-gate: the prompt is complete when this step's",
    "# chunk reaches its end (compute progress, no slack), checked for every",
    "# pending request, also when the chunk allocated no new block. A block",
    "# count fires after chunk 1 once a block outgrows a chunk (K3: ~5,760).",
)
MARKER_G2 = (
    "# k3patch moriio-chunk-gate: not the final chunk until compute progress",
    "# reaches the prompt; a block count fires early once a block outgrows a",
    "# chunk (K3's ~5,760-token blocks).",
)
G1_TEMPLATE = """
if req_id in self._reqs_need_pending_save:
    req = self._reqs_need_pending_save[req_id][0]
    if (
        req.num_computed_tokens
        + scheduler_output.num_scheduled_tokens.get(req_id, 0)
        >= req.num_prompt_tokens
    ):
        pass
"""
G2_TEMPLATE = """
if (
    req.num_computed_tokens
    + scheduler_output.num_scheduled_tokens.get(req_id, 0)
    < req.num_prompt_tokens
):
    pass
"""


class MoriioChunkGate(Patch):
    id = "moriio-chunk-gate"
    title = "MoRIIO WRITE producer sends the KV after the final prefill chunk (compute progress)"
    files = (FILE,)
    modules = (MODULE,)
    caveat = (
        "MoRIIO WRITE-mode producers only; the older k3-chunk-gate form is accepted as is "
        "(its default slack of 2 tokens can send early)"
    )

    def classify(self, sources: Sources) -> list[SiteResult]:
        src = sources[FILE]
        if not src.exists:
            why = "no MoRIIO connector in this vLLM (it first ships in 0.14.1)"
            return [self.result(s, FILE, Verdict.NOT_APPLICABLE, why) for s in (G1, G2)]
        method = _method(src.tree)
        if method is None:
            why = f"moriio_connector.py has no {CLASS}.{METHOD}; the connector was restructured"
            return [self.result(s, FILE, Verdict.DRIFTED, why) for s in (G1, G2)]
        context = _Context.of(src.tree, method)
        return [_classify_site(src, context, site) for site in (G1, G2)]

    def rewrite(self, sources: Sources, pending: list[SiteResult]) -> dict[str, str]:
        src = sources[FILE]
        method = _method(src.tree)
        if method is None:
            raise ValueError(f"{CLASS}.{METHOD} is gone")
        context = _Context.of(src.tree, method)
        edits: dict[str, _Gate] = {}
        for result in pending:
            gate, verdict = _locate_and_judge(src, context, result.site)
            if gate is None or verdict is not Verdict.PENDING:
                raise ValueError(f"{result.site} is no longer pending")
            edits[result.site] = gate
        return {FILE: _rewrite_gates(src.text, edits.get(G1), edits.get(G2))}

    def probe(self) -> ProbeOutcome:
        return probe_build_connector_meta()


PATCH = MoriioChunkGate()


# --------------------------------------------------------------------------------------------
# Locating the gates (stdlib ast only: classification must stay fast).


def _method(module: ast.Module) -> ast.FunctionDef | None:
    cls = find_class(module, CLASS)
    return find_method(cls, METHOD) if cls else None


def _expr_dump(source: str) -> str:
    return normalised_dump(ast.parse(source, mode="eval").body)


def _words(node: ast.AST) -> set[str]:
    """Every name and attribute name a node mentions."""
    return mentioned_names(node)


def _loads(nodes: Sequence[ast.AST]) -> set[str]:
    return {
        sub.id
        for node in nodes
        for sub in ast.walk(node)
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load)
    }


def _stores(nodes: Sequence[ast.AST]) -> set[str]:
    return {
        sub.id
        for node in nodes
        for sub in ast.walk(node)
        if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store)
    }


def _loads_outside(roots: list[ast.stmt], skip: list[ast.AST]) -> set[str]:
    """Names read under `roots`, not counting the subtrees in `skip`."""
    skipped = {id(node) for node in skip}
    out: set[str] = set()
    stack: list[ast.AST] = list(roots)
    while stack:
        node = stack.pop()
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            out.add(node.id)
        stack.extend(ast.iter_child_nodes(node))
    return out


def _blocks(stmt: ast.stmt) -> Iterator[tuple[str, list[ast.stmt]]]:
    if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return
    for name in ("body", "orelse", "finalbody"):
        block = getattr(stmt, name, None)
        if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
            yield name, block
    for i, handler in enumerate(getattr(stmt, "handlers", None) or ()):
        yield f"handler{i}", handler.body


@dataclass
class _Level:
    """One step of the way from a loop down to its gate: `block` is `owner`'s `field`."""

    owner: ast.stmt
    field: str
    block: list[ast.stmt]
    index: int


@dataclass
class _Gate:
    site: str
    loop: ast.For
    path: list[_Level]  # path[0].owner is the loop; path[-1].block holds the gate
    temps: list[ast.Assign]  # named temporaries right before the gate that feed its test
    node: ast.If

    @property
    def block(self) -> list[ast.stmt]:
        return self.path[-1].block

    @property
    def conditions(self) -> list[ast.stmt]:
        """The compound statements the gate is nested in, below the loop."""
        return [level.owner for level in self.path[1:]]

    def skeleton(self) -> list[ast.stmt]:
        gate = ast.If(test=self.node.test, body=[_ellipsis()], orelse=[])
        if self.node.orelse:
            gate.orelse = [_ellipsis()]
        first = self.path[-1].index - len(self.temps)
        stmts = _framed(self.block, first, self.path[-1].index, [*self.temps, gate])
        for upper, level in zip(reversed(self.path[:-1]), reversed(self.path[1:]), strict=True):
            wrapped = _wrap(level.owner, level.field, stmts)
            stmts = _framed(upper.block, upper.index, upper.index, [wrapped])
        return stmts

    def fingerprint(self) -> str:
        stmts = self.skeleton()
        return site_fingerprint(stmts[0] if len(stmts) == 1 else stmts)

    def found(self) -> str:
        return ast.unparse(ast.Module(body=self.skeleton(), type_ignores=[]))


def _ellipsis() -> ast.stmt:
    return ast.parse("...").body[0]


def _framed(block: list[ast.stmt], first: int, last: int, inner: list[ast.stmt]) -> list[ast.stmt]:
    """`inner` standing for block[first:last + 1], with `...` for what comes before and after."""
    return [
        *([_ellipsis()] if first > 0 else []),
        *inner,
        *([_ellipsis()] if last < len(block) - 1 else []),
    ]


def _wrap(owner: ast.stmt, field_name: str, stmts: list[ast.stmt]) -> ast.stmt:
    if isinstance(owner, ast.If):
        body = stmts if field_name == "body" else [_ellipsis()]
        orelse = stmts if field_name == "orelse" else ([_ellipsis()] if owner.orelse else [])
        return ast.If(test=owner.test, body=body, orelse=orelse)
    # Any other statement between loop and gate (a nested loop, try, with) is in no known
    # shape; it keeps its kind in the skeleton so it can never match one.
    marker = ast.parse(f"__{type(owner).__name__}_{field_name}__", mode="eval").body
    return ast.If(test=marker, body=stmts, orelse=[])


def _temps_before(block: list[ast.stmt], index: int, test: ast.expr) -> list[ast.Assign]:
    """The run of `name = ...` statements right before block[index] that feed its test."""
    wanted = _loads([test])
    temps: list[ast.Assign] = []
    j = index - 1
    while j >= 0:
        stmt = block[j]
        if not (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
            and stmt.targets[0].id in wanted
        ):
            break
        temps.insert(0, stmt)
        wanted |= _loads([stmt.value])
        j -= 1
    return temps


def _is_gate_test(test: ast.expr, temps: list[ast.Assign]) -> bool:
    return bool(GATE_WORDS & (_words(test) | set().union(*(_words(t.value) for t in temps))))


def _gates_in(loop: ast.For, site: str) -> list[_Gate]:
    found: list[_Gate] = []

    def walk(owner: ast.stmt, name: str, block: list[ast.stmt], path: list[_Level]) -> None:
        for index, stmt in enumerate(block):
            here = [*path, _Level(owner, name, block, index)]
            if isinstance(stmt, ast.If):
                temps = _temps_before(block, index, stmt.test)
                if _is_gate_test(stmt.test, temps):
                    found.append(_Gate(site, loop, here, temps, stmt))
            for sub_name, sub in _blocks(stmt):
                walk(stmt, sub_name, sub, here)

    walk(loop, "body", loop.body, [])
    return found


def _loops(method: ast.FunctionDef, attribute: str) -> list[ast.For]:
    return [
        node
        for node in ast.walk(method)
        if isinstance(node, ast.For) and attribute in _words(node.iter)
    ]


# --------------------------------------------------------------------------------------------
# What the surroundings say (names only, and the preconditions of the rewrite).


@dataclass
class _Context:
    module: ast.Module
    method: ast.FunctionDef
    cls: ast.ClassDef
    parents: dict[int, ast.AST] = field(default_factory=dict)

    @classmethod
    def of(cls, module: ast.Module, method: ast.FunctionDef) -> _Context:
        klass = find_class(module, CLASS)
        assert klass is not None
        context = cls(module, method, klass)
        for node in ast.walk(method):
            for child in ast.iter_child_nodes(node):
                context.parents[id(child)] = node
        return context

    def ancestors(self, node: ast.AST) -> list[ast.AST]:
        out = []
        while id(node) in self.parents:
            node = self.parents[id(node)]
            out.append(node)
        return out

    def params(self) -> set[str]:
        args = self.method.args
        return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}

    def release(self, d_shape: bool) -> str:
        """Which upstream release (or the fork) the surroundings of the gates come from: the
        producer branch around the G1 loop and the G1 loop's own skip."""
        if d_shape:
            return "D (0.30.0-0.31.0)"
        g1, _ = _locate(self, G1)
        if g1 is None:
            return "block-count gates of A-C, in surroundings of no known release"
        loop = g1.loop
        tests = {normalised_dump(a.test) for a in self.ancestors(loop) if isinstance(a, ast.If)}
        nested = _expr_dump(_WRITE_MODE) in tests and _expr_dump(_PRODUCER) in tests
        combined = _expr_dump(_PRODUCER_BRANCH) in tests
        skips = any(
            isinstance(n, ast.If)
            and normalised_dump(n.test) == _expr_dump(_NOT_PENDING_SKIP)
            and len(n.body) == 1
            and isinstance(n.body[0], ast.Continue)
            for n in ast.walk(loop)
        )
        if nested and not skips:
            return "A (0.14.1-0.23.0)"
        if combined and not skips:
            return "B (0.24.0-0.27.1)"
        if combined and skips:
            if _FORK_NAMES & _words(self.cls):
                return "the fork (shape C gates)"
            return "C (0.28.0-0.29.0)"
        return "block-count gates of A-C, in surroundings of no known release"

    def method_named(self, name: str) -> ast.FunctionDef | None:
        return find_method(self.cls, name)


def _locate(context: _Context, site: str) -> tuple[_Gate | None, str]:
    """The one gate of a site, or None and why."""
    method = context.method
    if site == G1:
        loops = [loop for loop in _loops(method, "scheduled_cached_reqs") if _gates_in(loop, site)]
        what = "a loop over scheduler_output.scheduled_cached_reqs that holds a final-chunk gate"
    else:
        loops = [loop for loop in _loops(method, "_reqs_need_save") if _gates_in(loop, site)]
        what = "a loop over self._reqs_need_save that holds a final-chunk gate"
    if len(loops) != 1:
        return None, f"expected one {what} in {METHOD}, found {len(loops)}"
    gates = _gates_in(loops[0], site)
    if len(gates) != 1:
        return None, (
            f"expected one final-chunk gate (an `if` on num_prompt_tokens) in {what}, "
            f"found {len(gates)}"
        )
    return gates[0], ""


def _locate_and_judge(
    src: SourceFile, context: _Context, site: str
) -> tuple[_Gate | None, Verdict]:
    gate, _ = _locate(context, site)
    if gate is None:
        return None, Verdict.DRIFTED
    return gate, _classify_gate(src, context, gate).verdict


def _classify_site(src: SourceFile, context: _Context, site: str) -> SiteResult:
    gate, why = _locate(context, site)
    if gate is None:
        return SiteResult(
            patch_id=PATCH.id,
            site=site,
            file=FILE,
            verdict=Verdict.DRIFTED,
            detail=why,
            line=context.method.lineno,
            expected=_expected(site),
        )
    return _classify_gate(src, context, gate)


def _expected(site: str) -> tuple[str, ...]:
    shapes = [f"{s.name} ({s.verdict.value})" for s in SHAPES[site]]
    return (*shapes, f"{SATISFIED_UPSTREAM} (satisfied)", f"{SATISFIED_LEGACY} (satisfied)")


def _classify_gate(src: SourceFile, context: _Context, gate: _Gate) -> SiteResult:
    def result(verdict: Verdict, shape: str, detail: str) -> SiteResult:
        drifted = verdict is Verdict.DRIFTED
        return SiteResult(
            patch_id=PATCH.id,
            site=gate.site,
            file=FILE,
            verdict=verdict,
            shape=shape,
            detail=detail,
            line=gate.node.lineno,
            found=gate.found() if drifted else "",
            expected=_expected(gate.site) if drifted else (),
        )

    fingerprint = gate.fingerprint()
    for shape in SHAPES[gate.site]:
        if shape.fingerprint != fingerprint:
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
    context: _Context, gate: _Gate, result: Callable[[Verdict, str, str], SiteResult]
) -> SiteResult:
    """The fixed forms nobody but upstream or the older script writes."""
    test = gate.node.test
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test = test.operand
    block_gated = [c for c in gate.conditions if "new_block_ids" in _words(getattr(c, "test", c))]
    if _calls(test, LEGACY_HELPER):
        problems = _legacy_problems(context, gate, bool(block_gated))
        if problems:
            return result(Verdict.DRIFTED, "", f"{SATISFIED_LEGACY}, but " + "; ".join(problems))
        return result(Verdict.SATISFIED, SATISFIED_LEGACY, LEGACY_CAVEAT)
    upstream = _calls(test, UPSTREAM_HELPER)
    if upstream or _is_progress_compare(test, _env(gate.temps)):
        if upstream and not _helper_is_progress(context):
            return result(
                Verdict.DRIFTED,
                "",
                f"the gate calls self.{UPSTREAM_HELPER}, whose body compares no "
                "num_computed_tokens + num_scheduled_tokens against num_prompt_tokens",
            )
        if block_gated:
            return result(
                Verdict.DRIFTED,
                "",
                "a progress gate, but still only evaluated when the step allocated a new "
                "block: a final chunk without a new block would never send",
            )
        guard = _expr_dump("req_id in self._reqs_need_pending_save")
        if any(normalised_dump(getattr(c, "test", c)) == guard for c in gate.conditions):
            return result(Verdict.DRIFTED, "", "k3patch's gate, edited since k3patch wrote it")
        if gate.conditions:
            # Upstream's gates sit directly in their loops; a progress gate that only runs
            # under some other condition is a form nobody has described.
            return result(
                Verdict.DRIFTED,
                "",
                "a progress gate nested under a condition k3patch does not know",
            )
        name = SATISFIED_UPSTREAM if upstream else SATISFIED_INLINE
        return result(Verdict.SATISFIED, name, "gates on compute progress")
    return result(
        Verdict.DRIFTED, "", "the gate is in no shape k3patch knows; nothing will be written"
    )


def _calls(expr: ast.expr, name: str) -> bool:
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
    env: dict[str, ast.expr] = {}
    for stmt in assigns:
        if (
            isinstance(stmt, ast.Assign)
            and len(stmt.targets) == 1
            and isinstance(stmt.targets[0], ast.Name)
        ):
            env[stmt.targets[0].id] = stmt.value
    return env


def _resolved_words(expr: ast.expr, env: dict[str, ast.expr], depth: int = 0) -> set[str]:
    words = _words(expr)
    if depth < 4:
        for name in _loads([expr]) & set(env):
            words |= _resolved_words(env[name], env, depth + 1)
    return words


def _is_progress_compare(expr: ast.expr, env: dict[str, ast.expr]) -> bool:
    """`num_computed_tokens + ...num_scheduled_tokens...` compared with `num_prompt_tokens`."""
    if not (isinstance(expr, ast.Compare) and len(expr.ops) == 1):
        return False
    sides = (expr.left, expr.comparators[0])
    for progress, prompt in (sides, sides[::-1]):
        if (
            isinstance(progress, ast.BinOp)
            and isinstance(progress.op, ast.Add)
            and {"num_computed_tokens", "num_scheduled_tokens"} <= _resolved_words(progress, env)
            and "num_prompt_tokens" in _resolved_words(prompt, env)
        ):
            return True
    return False


def _helper_is_progress(context: _Context) -> bool:
    helper = context.method_named(UPSTREAM_HELPER)
    if helper is None:
        return False
    env = _env(list(helper.body))
    return any(
        isinstance(node, ast.Return)
        and node.value is not None
        and _is_progress_compare(node.value, env)
        for node in ast.walk(helper)
    )


def _legacy_problems(context: _Context, gate: _Gate, block_gated: bool) -> list[str]:
    """What would make the older script's form fail at run time (its known pitfalls)."""
    helper = next(
        (
            node
            for node in context.module.body
            if isinstance(node, ast.FunctionDef) and node.name == LEGACY_HELPER
        ),
        None,
    )
    if helper is None:
        return [f"the module defines no {LEGACY_HELPER}()"]
    problems = []
    missing = _free_names(helper) - _module_names(context.module) - set(dir(builtins))
    if missing:
        names = ", ".join(sorted(missing))
        problems.append(
            f"{LEGACY_HELPER}() uses {names}, which moriio_connector.py never binds "
            "(a NameError at the first chunked request); reinstall vLLM and apply k3patch"
        )
    if LEGACY_MAP in _words(helper) and not any(
        isinstance(node, ast.Attribute)
        and node.attr == LEGACY_MAP
        and isinstance(node.ctx, ast.Store)
        for node in ast.walk(context.method)
    ):
        problems.append(f"{METHOD} never sets self.{LEGACY_MAP}, which {LEGACY_HELPER}() reads")
    if block_gated and not any(
        isinstance(node, ast.For)
        and "_reqs_need_pending_save" in _words(node.iter)
        and any(_calls(c, LEGACY_HELPER) for c in ast.walk(node) if isinstance(c, ast.Call))
        for node in ast.walk(context.method)
    ):
        problems.append(
            "its G1 gate still waits for a new block and the post-loop sweep over "
            "_reqs_need_pending_save is missing (half applied)"
        )
    return problems


def _free_names(func: ast.FunctionDef) -> set[str]:
    args = func.args
    bound = {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]}
    bound |= {a.arg for a in (args.vararg, args.kwarg) if a is not None}
    bound |= _stores(list(func.body))
    for node in ast.walk(func):
        if isinstance(node, ast.Import | ast.ImportFrom):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
    return _loads(list(func.body)) - bound


def _module_names(module: ast.Module) -> set[str]:
    """Names bound at run time at module level (TYPE_CHECKING imports excluded)."""
    names: set[str] = set()

    def visit(block: list[ast.stmt]) -> None:
        for node in block:
            if isinstance(node, ast.Import | ast.ImportFrom):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
                names.update(_stores([node]))
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" not in _words(node.test):
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for handler in node.handlers:
                    visit(handler.body)
                visit(node.orelse)
                visit(node.finalbody)

    visit(module.body)
    return names


def _preconditions(src: SourceFile, context: _Context, gate: _Gate, shape: Shape) -> list[str]:
    """Why a gate in a known shape still cannot take (or does not hold) the post-image."""
    problems = []
    if shape.verdict is Verdict.PENDING and not _loop_lines_ok(src.text, gate.loop):
        problems.append("its loop shares lines with other code or is not uniformly indented")
    if shape.verdict is Verdict.PENDING and "scheduler_output" not in context.params():
        problems.append(f"{METHOD} has no parameter named scheduler_output")
    bound = _stores([gate.loop.target])
    needs = {"req_id"} if gate.site == G1 else {"req_id", "req"}
    if not needs <= bound:
        problems.append(f"the loop does not bind {', '.join(sorted(needs - bound))}")
    for temp in gate.temps if shape.verdict is Verdict.PENDING else ():
        name = temp.targets[0].id  # type: ignore[attr-defined]
        if name in _loads_outside(gate.loop.body, [*gate.temps, gate.node.test]):
            problems.append(f"{name} is read outside the gate test; it cannot be dropped")
        if any(s is not temp and s.lineno == temp.lineno for s in gate.block):
            problems.append(f"{name} shares its line with another statement")
    if gate.site == G1:
        problems.extend(_g1_body_problems(gate, shape))
    return problems


def _g1_body_problems(gate: _Gate, shape: Shape) -> list[str]:
    """G1's body runs outside `if new_block_ids is not None:` after the rewrite, so it must not
    read what only that branch binds (`req` is rebound by the post-image)."""
    if shape.verdict is Verdict.PENDING:
        branch = gate.conditions[0]
        assert isinstance(branch, ast.If)
        before = gate.block[: gate.path[-1].index]
        local = (_stores(before) | _loads([branch.test])) - {"req"}
    else:
        index = gate.path[0].index
        siblings = [
            s
            for s in gate.loop.body[:index]
            if isinstance(s, ast.If) and "new_block_ids" in _words(s.test)
        ]
        local = _stores([s for sibling in siblings for s in sibling.body]) - {"req"}
    read = _loads(gate.node.body + gate.node.orelse) & local
    if read:
        return [
            "its body reads " + ", ".join(sorted(read)) + ", bound only when the step "
            "allocated a block"
        ]
    return []


# --------------------------------------------------------------------------------------------
# The rewrite. Each gate's loop is cut out on its own lines, parsed alone with libcst, edited
# and spliced back (k3patch.codemod), so every byte outside the two loops stays as it was. In
# the loop only the gate headers change (and their named temporaries go); G1 also leaves
# `if new_block_ids is not None:` for a sibling right after it, keeping its body as it was.


def _loop_lines_ok(text: str, loop: ast.For) -> bool:
    """Whether the loop can be cut out on its own lines and dedented (what the splice needs)."""
    from k3patch.codemod import SpliceError, cut

    try:
        cut(text, loop)
    except SpliceError:
        return False
    return True


def _rewrite_gates(text: str, g1: _Gate | None, g2: _Gate | None) -> str:
    from k3patch.codemod import cut

    # Splice the later loop first so the earlier one's line numbers still hold.
    for gate in sorted((g for g in (g1, g2) if g), key=lambda g: -g.loop.lineno):
        piece = cut(text, gate.loop)
        text = piece.put(_rewrite_loop(piece.segment, gate, first_line=piece.first_line))
    return text


def _rewrite_loop(segment: str, gate: _Gate, first_line: int) -> str:
    """The loop's new source; `segment` is the loop alone, its first line at `first_line`."""
    import libcst as cst
    from libcst.metadata import MetadataWrapper, PositionProvider

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


# --------------------------------------------------------------------------------------------
# The behaviour probe: the real build_connector_meta of the tree, driven step by step the way
# the scheduler drives it, on an object built without a cluster (only the attributes that
# build_connector_meta and update_state_after_alloc read). No GPU, no network.


@dataclass(frozen=True)
class ProbeRequest:
    req_id: str
    prompt: int
    # One (tokens scheduled, blocks newly allocated) per step; 0 blocks: new_block_ids is None.
    steps: tuple[tuple[int, int], ...]
    # The one step (1-based) whose metadata must carry the save; None: never (not a PD request).
    expect_step: int | None
    disagg: bool = True


@dataclass(frozen=True)
class ProbeCase:
    title: str
    block_size: int
    requests: tuple[ProbeRequest, ...]


PROBE_CASES = (
    ProbeCase(
        "K3: 2,611-token prompt, one 5,760-token block, chunks 2,048 + 563 (no new block)",
        5760,
        (
            ProbeRequest("k3-2611", 2611, ((2048, 1), (563, 0)), expect_step=2),
            # A request without kv_transfer_params beside it is never sent and never fails.
            ProbeRequest("local", 100, ((100, 1), (1, 0)), expect_step=None, disagg=False),
        ),
    ),
    ProbeCase(
        "K3: 5,000-token prompt, chunks 2,048 + 2,048 + 904",
        5760,
        (ProbeRequest("k3-3chunk", 5000, ((2048, 1), (2048, 0), (904, 0)), expect_step=3),),
    ),
    ProbeCase(
        "last chunk of 2 tokens: no slack",
        5760,
        (ProbeRequest("k3-2050", 2050, ((2048, 1), (2, 0)), expect_step=2),),
    ),
    ProbeCase(
        "16-token blocks, a new block every chunk: the full block list is sent",
        16,
        (ProbeRequest("small", 5000, ((2048, 128), (2048, 128), (904, 57)), expect_step=3),),
    ),
    ProbeCase(
        "a prompt in one chunk",
        5760,
        (ProbeRequest("short", 1000, ((1000, 1),), expect_step=1),),
    ),
)


def _flat(block_ids: Any) -> list[int]:
    items = list(block_ids)
    if items and isinstance(items[0], list | tuple):
        return [b for group in items for b in group]
    return [int(b) for b in items]


def _scheduler(mc: types.ModuleType, block_size: int) -> Any:
    sched = object.__new__(mc.MoRIIOConnectorScheduler)
    attrs: dict[str, Any] = {
        "mode": mc.MoRIIOMode.WRITE,
        "block_size": block_size,  # 0.14.1-0.29.0 gate
        "_full_attn_group_idx": 0,  # 0.30.0-0.31.0 gate
        "_full_attn_block_size": block_size,
        "_has_mamba": False,  # 0.32.0+ (_clamp_to_prompt_blocks)
        "blocks_per_sw": [0],
        "_group_block_sizes": [block_size],
        "_reqs_need_recv": {},
        "_reqs_need_save": {},
        "_reqs_need_pending_save": {},
        "_reqs_need_send": {},
        "_req_kv_params": {},
        "_reqs_save_mamba": {},  # the fork's mamba block ids (SITES.md 1)
        "transfer_id_to_request_id": {},
        "request_id_to_transfer_id": {},
    }
    # A fork or another patch may keep more per-request maps (the group-routing patch adds
    # `_reqs_save_groups`); whatever __init__ starts as an empty dict starts empty here too.
    for name in _empty_maps_of_init(mc.MoRIIOConnectorScheduler):
        attrs.setdefault(name, {})
    for name, value in attrs.items():
        setattr(sched, name, value)
    return sched


def _empty_maps_of_init(cls: type[object]) -> list[str]:
    import inspect
    import textwrap

    try:
        source = textwrap.dedent(inspect.getsource(cls.__init__))
    except (OSError, TypeError):
        return []
    names = []
    for node in ast.walk(ast.parse(source)):
        target = value = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        if not (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id == "self"
        ):
            continue
        empty_dict = isinstance(value, ast.Dict) and not value.keys
        dict_call = (
            isinstance(value, ast.Call)
            and isinstance(value.func, ast.Name)
            and value.func.id == "dict"
            and not value.args
            and not value.keywords
        )
        if empty_dict or dict_call:
            names.append(target.attr)
    return names


def _kv_params(req_id: str) -> dict[str, Any]:
    return {
        "do_remote_decode": True,
        "transfer_id": f"t-{req_id}",
        "remote_engine_id": "decode-0",
        "remote_block_ids": [],
        "remote_host": "10.0.0.2",
        "remote_handshake_port": 6301,
        "remote_notify_port": 6401,
    }


@dataclass
class CaseRun:
    """What one case did: per request, the saves emitted as (step, flat block ids), and the
    block ids allocated to it step by step."""

    emitted: dict[str, list[tuple[int, list[int]]]]
    allocated: dict[str, list[list[int]]]


def run_case(mc: types.ModuleType, case: ProbeCase) -> CaseRun:
    """Drive the real build_connector_meta through one case, step by step."""
    sched = _scheduler(mc, case.block_size)
    requests = {
        r.req_id: types.SimpleNamespace(
            request_id=r.req_id,
            num_prompt_tokens=r.prompt,
            num_computed_tokens=0,
            kv_transfer_params=_kv_params(r.req_id) if r.disagg else None,
        )
        for r in case.requests
    }
    next_block = iter(range(1_000_000))
    run = CaseRun({r.req_id: [] for r in case.requests}, {r.req_id: [] for r in case.requests})
    for step in range(max(len(r.steps) for r in case.requests)):
        cached_ids: list[str] = []
        cached_blocks: list[Any] = []
        new_reqs: list[Any] = []
        scheduled: dict[str, int] = {}
        for spec in case.requests:
            if step >= len(spec.steps):
                continue
            tokens, n_blocks = spec.steps[step]
            ids = [next(next_block) for _ in range(n_blocks)]
            run.allocated[spec.req_id].append(ids)
            scheduled[spec.req_id] = tokens
            req = requests[spec.req_id]
            if step == 0:
                # A new request: the scheduler calls update_state_after_alloc first, which
                # records the blocks in the format this vLLM uses.
                blocks = types.SimpleNamespace(
                    get_block_ids=lambda allow_none=False, ids=ids: (ids,)
                )
                sched.update_state_after_alloc(req, blocks, 0)
                new_reqs.append(types.SimpleNamespace(req_id=spec.req_id))
            else:
                cached_ids.append(spec.req_id)
                cached_blocks.append((ids,) if ids else None)
        output = types.SimpleNamespace(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=types.SimpleNamespace(
                req_ids=cached_ids, new_block_ids=cached_blocks
            ),
            num_scheduled_tokens=scheduled,
            new_block_ids_to_zero=None,
            kv_connector_block_state=None,
        )
        meta = sched.build_connector_meta(output)
        for req_id, req_meta in meta.reqs_to_save.items():
            run.emitted[req_id].append((step + 1, _flat(req_meta.local_block_ids)))
        # After build_connector_meta the scheduler advances the computed tokens.
        for req_id, tokens in scheduled.items():
            requests[req_id].num_computed_tokens += tokens
    return run


def _saves(steps: list[int], chunks: int) -> str:
    if not steps:
        return f"no save in {chunks} chunks"
    return f"save at chunk {', '.join(map(str, steps))} of {chunks}"


def judge_case(case: ProbeCase, run: CaseRun) -> list[tuple[str, bool]]:
    """One (line, ok) per request of a case."""
    out = []
    for spec in case.requests:
        got = run.emitted[spec.req_id]
        steps = [step for step, _ in got]
        want = [] if spec.expect_step is None else [spec.expect_step]
        expected = f"chunk {want[0]} only" if want else "none"
        line = (
            f"{case.title} [{spec.req_id}]: {_saves(steps, len(spec.steps))}, expected {expected}"
        )
        ok = steps == want
        if ok and got:
            sent = got[0][1]
            blocks = [b for ids in run.allocated[spec.req_id][: spec.expect_step] for b in ids]
            if sent != blocks:
                ok = False
                line += f"; sent blocks {sent[:8]} ({len(sent)}), allocated {len(blocks)}"
        out.append((line, ok))
    return out


def probe_build_connector_meta() -> ProbeOutcome:
    import importlib

    mc = importlib.import_module(MODULE)
    saved_get_role = mc.get_role
    results: list[tuple[str, bool]] = []
    try:
        # The producer role is process-global state set at connector start; pin it here.
        # (mypy knows the vLLM module only as a bare ModuleType: vLLM is untyped here.)
        mc.get_role = lambda: mc.ROLE.PRODUCER  # type: ignore[attr-defined]
        for case in PROBE_CASES:
            results.extend(judge_case(case, run_case(mc, case)))
    finally:
        mc.get_role = saved_get_role  # type: ignore[attr-defined]
    checks = tuple(line for line, _ in results)
    failures = [line for line, ok in results if not ok]
    if failures:
        summary = f"wrong in {len(failures)} of {len(results)} requests: " + "; ".join(failures)
        return ProbeOutcome(False, summary, checks)
    return ProbeOutcome(
        True,
        f"the save is emitted once, with the final prefill chunk ({len(results)} requests)",
        checks,
    )
