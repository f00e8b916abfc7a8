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
carry the same fix (`_is_final_prefill_chunk`). A gate that compares progress with the prompt in
any other way (`<` where `>=` belongs, `==`, `!=`, `>`, sides swapped, a slack) is drift.
The older k3-chunk-gate script (apply_kimik3_chunk_gate_fix.py) decides through a helper with a
slack of K3_CHUNK_GATE_SLACK (default 2) tokens and falls back to the block count when its
per-step map lacks the request: pending, with both defects named; apply replaces its three
decisions (G1, its post-loop sweep, G2) in place by compute progress and drops the fallbacks,
without the pristine file (its helper and map stay, unused by the gates).
Verdicts on the real trees: upstream A (0.14.1-0.23.0), B (0.24.0-0.27.1), C (0.28.0-0.29.0),
D (0.30.0-0.31.0) pending; 0.32.0 and later satisfied (upstream). The operators' fork trees
(0.28.0 + the recipe's older scripts): a, b, c and the plan variants (no chunk-gate script, the
default K3_EXTRA_FIXES=0) pending, "the fork (shape C gates)"; d (K3_EXTRA_FIXES=1) pending,
"older k3-chunk-gate script (legacy, defective)"; after apply every one reads applied.
Check: `k3patch verify` drives the real `build_connector_meta` of the tree with synthetic
scheduler steps (a 2,611-token prompt in one 5,760-token block, chunks of 2,048 and 563, must
send once, with the second chunk; so must a 3-chunk prompt at its third chunk, and a prompt
whose last chunk is 2 tokens), then vLLM's own `Scheduler.schedule()` of the tree with the
MoRIIO scheduler side on CPU through the same prompts (about a second beside the imports). It
also shows that `req.num_computed_tokens` inside bCM is the count before the step's chunk, not
stale (the older script's docstring says it is).
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

# Fixed forms recognised by predicate rather than by one skeleton (SITES.md 2): a comparison of
# `num_computed_tokens + ...num_scheduled_tokens...` against `num_prompt_tokens` that decides
# exactly "final chunk" (`>=`) or "not yet" (`<`) where the gate needs it, directly or through
# upstream's `_is_final_prefill_chunk`. Any other comparison of progress with the prompt (`<`
# where `>=` belongs, `==`, `!=`, `>`, sides swapped, a slack) is drift.
UPSTREAM_HELPER = "_is_final_prefill_chunk"
SATISFIED_UPSTREAM = "upstream fix (_is_final_prefill_chunk, 0.32.0 and later)"
SATISFIED_INLINE = "upstream-style progress gate (inline)"

# The older k3-chunk-gate script (apply_kimik3_chunk_gate_fix.py), as it really writes it: a
# per-step map `self._k3_prog` filled at the top of the producer branch, a module-level helper,
# and at each gate a named decision `_k3done = _k3_prefill_done(...)`, an `if _k3done is None:`
# block-count fallback, a debug `if`, then the gate on the name; G1 also gets a sweep over the
# pending requests after its loop (a final chunk without a new block never reaches G1).
LEGACY_HELPER = "_k3_prefill_done"
LEGACY_MAP = "_k3_prog"
LEGACY_DEBUG = "K3_CHUNK_GATE_DEBUG"
LEGACY_HELPER_SHAPE = Shape(
    "k3-chunk-gate helper",
    Verdict.PENDING,
    """
    def _k3_prefill_done(self, req_id, req):
        import os as _os
        prog = getattr(self, '_k3_prog', None)
        if not prog or req_id not in prog:
            return None
        cb, st = prog[req_id]
        slack = int(_os.environ.get('K3_CHUNK_GATE_SLACK', '2'))
        return (cb + st) >= (int(req.num_prompt_tokens) - slack)
    """,
)
LEGACY_PENDING = "older k3-chunk-gate script (legacy, defective)"
LEGACY_DEFECTS = (
    "fires up to K3_CHUNK_GATE_SLACK (default 2) tokens early",
    "falls back to the block-count gate (the original bug) when its progress map lacks the request",
)
LEGACY_APPLIED = "k3patch (the older k3-chunk-gate form, repaired in place)"
# The block-count fallback each site's older form keeps, as the script writes it.
LEGACY_FALLBACK = {
    G1: "len(self._reqs_need_pending_save[req_id][1]) * self.block_size >= req.num_prompt_tokens",
    G2: "not (req.num_prompt_tokens > len(block_ids) * self.block_size)",
}
# k3patch's decision in the repaired form: progress of the request the chain decides about.
LEGACY_REPAIR = (
    "{req}.num_computed_tokens\n"
    "+ scheduler_output.num_scheduled_tokens.get({req_id}, 0)\n"
    ">= {req}.num_prompt_tokens"
)
MARKER_LEGACY = (
    "# k3patch moriio-chunk-gate: final when compute progress reaches",
    "# the prompt; no slack (it sent up to 2 tokens early) and no",
    "# block-count fallback (the original bug).",
)
# Names whose appearance in an `if` test makes it a final-chunk gate.
GATE_WORDS = frozenset({"num_prompt_tokens", UPSTREAM_HELPER, LEGACY_HELPER})

# The surroundings of the gates name the upstream release they come from (the gates of A, B, C
# and the fork are the same statements).
_WRITE_MODE = "self.mode == MoRIIOMode.WRITE"
_PRODUCER = "get_role() == ROLE.PRODUCER"
_PRODUCER_BRANCH = f"{_WRITE_MODE} and {_PRODUCER}"
_NOT_PENDING_SKIP = "req_id not in self._reqs_need_pending_save"
# The fork's mamba-blockids edit (SITES.md 1), as statements: `update_state_after_alloc` files
# each saved request's mamba block ids under `self._reqs_save_mamba[request.request_id]`, a map
# that `__init__` starts empty. A name alone decides nothing.
_FORK_MAP = "_reqs_save_mamba"

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
        "MoRIIO WRITE-mode producers only; the older k3-chunk-gate form is repaired in place "
        "(its helper and progress map stay, unused by the gates)"
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
        chains: list[_Chain] = []
        for result in pending:
            if _classify_site(src, context, result.site).verdict is not Verdict.PENDING:
                raise ValueError(f"{result.site} is no longer pending")
            legacy = _site_chains(context, result.site)
            if legacy is not None:
                chains.extend(legacy)
                continue
            gate, _ = _locate(context, result.site)
            assert gate is not None
            edits[result.site] = gate
        text = _repair_chains(src.text, chains)
        if edits:
            # The older form's repair never touches a loop the gate rewrite cuts out; only
            # line numbers move, so the gates are located again in the repaired text.
            if chains:
                module = ast.parse(text)
                method = _method(module)
                assert method is not None
                context = _Context.of(module, method)
                edits = {site: _relocate(context, site) for site in edits}
            text = _rewrite_gates(text, edits.get(G1), edits.get(G2))
        return {FILE: text}

    def probe(self) -> ProbeOutcome:
        return probe_chunk_gate()


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
            if _is_fork(self.cls):
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


def _relocate(context: _Context, site: str) -> _Gate:
    gate, why = _locate(context, site)
    if gate is None:
        raise ValueError(f"{site}: {why}")
    return gate


def _is_fork(cls: ast.ClassDef) -> bool:
    """Whether the scheduler carries the fork's mamba-blockids edit (SITES.md 1): __init__
    starts `self._reqs_save_mamba` empty and update_state_after_alloc files a saved request's
    mamba block ids under it."""
    init = find_method(cls, "__init__")
    alloc = find_method(cls, "update_state_after_alloc")
    if init is None or alloc is None:
        return False

    def own_map(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == _FORK_MAP
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        )

    def empty_dict(node: ast.expr | None) -> bool:
        return isinstance(node, ast.Dict) and not node.keys

    starts_empty = any(
        (
            isinstance(n, ast.Assign)
            and len(n.targets) == 1
            and own_map(n.targets[0])
            and empty_dict(n.value)
        )
        or (isinstance(n, ast.AnnAssign) and own_map(n.target) and empty_dict(n.value))
        for n in ast.walk(init)
    )
    files_blocks = any(
        isinstance(n, ast.Assign)
        and len(n.targets) == 1
        and isinstance(n.targets[0], ast.Subscript)
        and own_map(n.targets[0].value)
        and "request_id" in _words(n.targets[0].slice)
        for n in ast.walk(alloc)
    )
    return starts_empty and files_blocks


def _classify_site(src: SourceFile, context: _Context, site: str) -> SiteResult:
    chains = _site_chains(context, site)
    if chains is not None:
        return _classify_chains(context, site, chains)
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
    return (
        *shapes,
        f"{SATISFIED_UPSTREAM} (satisfied)",
        f"{SATISFIED_INLINE} (satisfied)",
        f"{LEGACY_PENDING} (pending)",
        f"{LEGACY_APPLIED} (applied)",
    )


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
    """The fixed forms nobody but upstream writes: a progress gate, inline or through
    upstream's helper, that decides exactly what its body needs."""
    test = gate.node.test
    wanted = _wanted(gate.node)
    env = _env(gate.temps)
    upstream = _calls(_unnegated(test), UPSTREAM_HELPER)
    meaning = _helper_call_meaning(test) if upstream else _progress_meaning(test, env)
    if meaning is None:
        return result(
            Verdict.DRIFTED, "", "the gate is in no shape k3patch knows; nothing will be written"
        )
    if upstream and not _helper_is_progress(context):
        return result(
            Verdict.DRIFTED,
            "",
            f"the gate calls self.{UPSTREAM_HELPER}, whose body is no progress comparison "
            "(num_computed_tokens + num_scheduled_tokens >= num_prompt_tokens)",
        )
    if meaning != wanted:
        return result(Verdict.DRIFTED, "", _wrong_progress(meaning, wanted))
    block_gated = [c for c in gate.conditions if "new_block_ids" in _words(getattr(c, "test", c))]
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


FINAL = "final"
NOT_FINAL = "not final"
WRONG = "wrong"


def _wanted(gate: ast.If) -> str:
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


def _unnegated(expr: ast.expr) -> ast.expr:
    while isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        expr = expr.operand
    return expr


def _negations(expr: ast.expr) -> int:
    count = 0
    while isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        expr = expr.operand
        count += 1
    return count


def _flip(meaning: str, times: int) -> str:
    if meaning == WRONG or times % 2 == 0:
        return meaning
    return NOT_FINAL if meaning == FINAL else FINAL


def _helper_call_meaning(test: ast.expr) -> str:
    return _flip(FINAL, _negations(test))


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


def _is_scheduled(expr: ast.expr) -> bool:
    """`<...>.num_scheduled_tokens[key]` or `<...>.num_scheduled_tokens.get(key[, 0])`."""
    if isinstance(expr, ast.Subscript):
        return isinstance(expr.value, ast.Attribute) and expr.value.attr == "num_scheduled_tokens"
    return (
        isinstance(expr, ast.Call)
        and isinstance(expr.func, ast.Attribute)
        and expr.func.attr == "get"
        and isinstance(expr.func.value, ast.Attribute)
        and expr.func.value.attr == "num_scheduled_tokens"
        and not expr.keywords
        and (
            len(expr.args) == 1
            or (
                len(expr.args) == 2
                and isinstance(expr.args[1], ast.Constant)
                and expr.args[1].value == 0
            )
        )
    )


def _progress_of(expr: ast.expr, env: dict[str, ast.expr]) -> str | None:
    """The request name `r` of `r.num_computed_tokens + <this step's scheduled tokens>`."""
    expr = _resolve(expr, env)
    if not (isinstance(expr, ast.BinOp) and isinstance(expr.op, ast.Add)):
        return None
    for computed, scheduled in ((expr.left, expr.right), (expr.right, expr.left)):
        req = _is_attr(_resolve(computed, env), "num_computed_tokens")
        if req is not None and _is_scheduled(_resolve(scheduled, env)):
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


def _progress_meaning(expr: ast.expr, env: dict[str, ast.expr]) -> str | None:
    """What a test decides about compute progress: "final" for `progress >= prompt`, "not
    final" for `progress < prompt` (mirrored forms and `not` included), "wrong" for any other
    comparison of progress with the prompt, None when the test is no such comparison."""
    times = _negations(expr)
    core = _resolve(_unnegated(expr), env)
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
        return _flip(FINAL, times)
    if op is ast.Lt:
        return _flip(NOT_FINAL, times)
    return WRONG


def _resolved_words_of(node: ast.AST, env: dict[str, ast.expr]) -> set[str]:
    words = _words(node)
    if isinstance(node, ast.Name) and node.id in env:
        words |= _words(_resolve(node, env))
    return words


def _helper_is_progress(context: _Context) -> bool:
    helper = context.method_named(UPSTREAM_HELPER)
    if helper is None:
        return False
    env = _env(list(helper.body))
    returns = [n for n in ast.walk(helper) if isinstance(n, ast.Return)]
    return bool(returns) and all(
        n.value is not None and _progress_meaning(n.value, env) == FINAL for n in returns
    )


# --------------------------------------------------------------------------------------------
# The older k3-chunk-gate script's form: decision chains. A chain is `NAME = <decision>`, an
# optional `if NAME is None: NAME = <fallback>`, the script's debug `if`s, and the gate
# `if NAME:` (it sends) or `if not NAME:` (it defers or skips). The decision is the script's
# helper call (pending: it carries the slack and the fallback) or k3patch's progress
# comparison (applied: the repair in place).


@dataclass
class _Chain:
    part: str  # "gate" or "sweep" (G1's post-loop pass over the pending requests)
    block: list[ast.stmt]
    index: int  # of the decision in block
    name: str
    decision: ast.Assign
    fallback: ast.If | None
    debug: list[ast.If]
    gate: ast.If

    @property
    def statements(self) -> list[ast.stmt]:
        last = self.block.index(self.gate)
        return self.block[self.index : last + 1]

    def kind(self) -> str:
        """ "legacy" (the script's helper), "progress" (k3patch's repair) or "other"."""
        value = self.decision.value
        if _calls(value, LEGACY_HELPER) and isinstance(value, ast.Call):
            if len(value.args) == 3 and all(isinstance(a, ast.Name) for a in value.args):
                return "legacy"
            return "other"
        if _progress_meaning(value, {}) == FINAL:
            return "progress"
        return "other"

    def request_names(self) -> tuple[str, str] | None:
        """(request, request id) the decision is about."""
        value = self.decision.value
        if isinstance(value, ast.Call) and len(value.args) == 3:
            req_id, req = value.args[1], value.args[2]
            if isinstance(req_id, ast.Name) and isinstance(req, ast.Name):
                return req.id, req_id.id
        return None

    def gate_meaning(self) -> str:
        """What the gate's test makes of the decision ("final" when it is the bare name)."""
        return _flip(FINAL, _negations(self.gate.test))

    def found(self) -> str:
        return ast.unparse(ast.Module(body=self.statements, type_ignores=[]))


def _is_name(expr: ast.expr, name: str) -> bool:
    return isinstance(expr, ast.Name) and expr.id == name


def _chains_in(root: ast.stmt, part: str) -> list[_Chain]:
    found: list[_Chain] = []

    def walk(block: list[ast.stmt]) -> None:
        for index, stmt in enumerate(block):
            chain = _chain_at(block, index, part)
            if chain is not None:
                found.append(chain)
            for _, sub in _blocks(stmt):
                walk(sub)

    for _, block in _blocks(root):
        walk(block)
    return found


def _chain_at(block: list[ast.stmt], index: int, part: str) -> _Chain | None:
    stmt = block[index]
    if not (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
    ):
        return None
    name = stmt.targets[0].id
    value_words = _words(stmt.value)
    if not (_calls(stmt.value, LEGACY_HELPER) or "num_prompt_tokens" in value_words):
        return None
    j = index + 1
    fallback = None
    if j < len(block) and isinstance(block[j], ast.If):
        test = block[j].test  # type: ignore[attr-defined]
        if (
            isinstance(test, ast.Compare)
            and _is_name(test.left, name)
            and len(test.ops) == 1
            and isinstance(test.ops[0], ast.Is)
            and isinstance(test.comparators[0], ast.Constant)
            and test.comparators[0].value is None
        ):
            fallback = block[j]
            j += 1
    debug: list[ast.If] = []
    while j < len(block):
        candidate = block[j]
        if not (isinstance(candidate, ast.If) and LEGACY_DEBUG in _constants(candidate.test)):
            break
        debug.append(candidate)
        j += 1
    if j >= len(block):
        return None
    gate = block[j]
    if not isinstance(gate, ast.If) or not _is_name(_unnegated(gate.test), name):
        return None
    assert fallback is None or isinstance(fallback, ast.If)
    return _Chain(part, block, index, name, stmt, fallback, debug, gate)


def _constants(node: ast.AST) -> set[str]:
    return {
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def _site_chains(context: _Context, site: str) -> list[_Chain] | None:
    """The site's decision chains (G1: its gate and its sweep; G2: its gate), or None when the
    site's loop holds none (the gate forms of upstream, the fork and k3patch)."""
    attribute = "scheduled_cached_reqs" if site == G1 else "_reqs_need_save"
    loops = _loops(context.method, attribute)
    gates = [c for loop in loops for c in _chains_in(loop, "gate")]
    if not gates:
        return None
    if site == G2:
        return gates
    sweeps = [
        c
        for loop in _loops(context.method, "_reqs_need_pending_save")
        if loop not in loops
        for c in _chains_in(loop, "sweep")
    ]
    return [*gates, *sweeps]


def _classify_chains(context: _Context, site: str, chains: list[_Chain]) -> SiteResult:
    gates = [c for c in chains if c.part == "gate"]
    sweeps = [c for c in chains if c.part == "sweep"]
    first = gates[0] if gates else chains[0]

    def result(verdict: Verdict, shape: str, detail: str) -> SiteResult:
        drifted = verdict is Verdict.DRIFTED
        return SiteResult(
            patch_id=PATCH.id,
            site=site,
            file=FILE,
            verdict=verdict,
            shape=shape,
            detail=detail,
            line=first.decision.lineno,
            found="\n".join(c.found() for c in chains) if drifted else "",
            expected=_expected(site) if drifted else (),
        )

    problems = _chain_problems(context, site, gates, sweeps)
    if problems:
        return result(
            Verdict.DRIFTED,
            "",
            "the older k3-chunk-gate form, but "
            + "; ".join(problems)
            + "; nothing will be written",
        )
    if {c.kind() for c in chains} == {"legacy"}:
        return result(Verdict.PENDING, LEGACY_PENDING, "; ".join(LEGACY_DEFECTS))
    return result(Verdict.APPLIED, LEGACY_APPLIED, "compute progress, no slack, no fallback")


def _chain_problems(
    context: _Context, site: str, gates: list[_Chain], sweeps: list[_Chain]
) -> list[str]:
    """Why a decision chain is in no form the script or k3patch's repair leaves."""
    if len(gates) != 1:
        return [f"{len(gates)} decision chains in the site's loop (the script writes one)"]
    if site == G1 and len(sweeps) != 1:
        return [
            f"{len(sweeps)} sweeps over _reqs_need_pending_save after the G1 loop (the script "
            "writes one; without it a final chunk that allocates no block is never sent)"
        ]
    chains = [*gates, *sweeps]
    kinds = {c.kind() for c in chains}
    if "other" in kinds:
        return [
            "a decision that is neither the script's helper call nor "
            f"`{LEGACY_REPAIR.format(req='req', req_id='req_id')}` (inverted, off-by-one or "
            "another slack)".replace("\n", " ")
        ]
    if len(kinds) != 1:
        return ["the gate and the sweep decide differently (partly repaired)"]
    problems = []
    for chain in chains:
        wanted = NOT_FINAL if chain.part == "sweep" else _wanted(chain.gate)
        if chain.gate_meaning() != wanted:
            problems.append(f"`{ast.unparse(chain.gate.test)}` is inverted for what its body does")
        if chain.part == "sweep" and not (
            len(chain.gate.body) == 1 and isinstance(chain.gate.body[0], ast.Continue)
        ):
            problems.append("the sweep's gate does not skip the request")
    legacy = kinds == {"legacy"}
    for chain in chains:
        fallback = chain.fallback
        if not legacy:
            if fallback is not None:
                problems.append(f"`if {chain.name} is None:` is left beside a progress decision")
            continue
        if chain.part == "sweep":
            if fallback is not None:
                problems.append("the sweep has a fallback the script never writes")
            continue
        expected = LEGACY_FALLBACK[site]
        if not (
            fallback is not None
            and len(fallback.body) == 1
            and not fallback.orelse
            and isinstance(fallback.body[0], ast.Assign)
            and _is_name(fallback.body[0].targets[0], chain.name)
            and normalised_dump(fallback.body[0].value) == _expr_dump(expected)
        ):
            problems.append(f"its fallback is not the block count `{expected}`")
    if legacy:
        problems.extend(_legacy_support_problems(context))
    problems.extend(_unbound_problems(context, chains))
    return problems


def _legacy_support_problems(context: _Context) -> list[str]:
    """The helper and the progress map the script's decisions rely on."""
    helpers = [
        node
        for node in context.module.body
        if isinstance(node, ast.FunctionDef) and node.name == LEGACY_HELPER
    ]
    problems = []
    if len(helpers) != 1 or site_fingerprint(helpers[0]) != LEGACY_HELPER_SHAPE.fingerprint:
        problems.append(
            f"the module's {LEGACY_HELPER}() is not the script's (missing, defined twice, or "
            "its comparison edited)"
        )
    if not any(
        isinstance(node, ast.Attribute)
        and node.attr == LEGACY_MAP
        and isinstance(node.ctx, ast.Store)
        for node in ast.walk(context.method)
    ):
        problems.append(f"{METHOD} never sets self.{LEGACY_MAP}, which {LEGACY_HELPER}() reads")
    return problems


def _unbound_problems(context: _Context, chains: list[_Chain]) -> list[str]:
    """Names the chains read that nothing binds: the script's debug `if` reads `os` at module
    level, its sweep reads maps that other older scripts add to the scheduler. Either raises
    when a chunked request comes (the sweep's inside its `try`: the request is never sent)."""
    problems = []
    bound = (
        _module_names(context.module)
        | set(dir(builtins))
        | _stores([context.method])
        | context.params()
        | {
            (alias.asname or alias.name).split(".")[0]
            for node in ast.walk(context.method)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
    )
    stmts = [s for c in chains for s in c.statements]
    free = _loads(stmts) - bound
    if free:
        problems.append(
            "it reads " + ", ".join(sorted(free)) + ", which moriio_connector.py never binds"
        )
    sweep_roots: list[ast.AST] = [
        loop
        for loop in _loops(context.method, "_reqs_need_pending_save")
        if any(c.part == "sweep" and c.decision in ast.walk(loop) for c in chains)
    ]
    attributes = {
        node.attr
        for root in sweep_roots
        for node in ast.walk(root)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
        and isinstance(node.ctx, ast.Load)
    }
    unset = sorted(attributes - _self_attributes(context.cls))
    if unset:
        problems.append(
            "its sweep reads self." + ", self.".join(unset) + f", which {CLASS} never sets "
            "(it raises inside the sweep's try and the request is never sent)"
        )
    return problems


def _self_attributes(cls: ast.ClassDef) -> set[str]:
    names = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    for node in ast.walk(cls):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        ):
            names.add(node.attr)
    return names


def _repair_chains(text: str, chains: list[_Chain]) -> str:
    """The older form's decisions replaced in place by compute progress; each `is None`
    fallback goes. Helper, map and debug lines stay: nothing reads them to decide any more."""
    from k3patch.edits import Edit, SourceText, apply_edits, replace

    src = SourceText(text)
    edits: list[Edit] = []
    for chain in chains:
        names = chain.request_names()
        if names is None:
            raise ValueError(f"{chain.name}: a decision chain without its request names")
        req, req_id = names
        progress = LEGACY_REPAIR.format(req=req, req_id=req_id).split("\n")
        source = "\n".join(
            [*MARKER_LEGACY, f"{chain.name} = (", *(f"    {line}" for line in progress), ")"]
        )
        stmts: list[ast.stmt] = [chain.decision]
        if chain.fallback is not None:
            stmts.append(chain.fallback)
        edits.append(replace(src, stmts, source))
    return apply_edits(text, edits)


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
        cached_computed: list[int] = []
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
                new_reqs.append(
                    types.SimpleNamespace(
                        req_id=spec.req_id, num_computed_tokens=req.num_computed_tokens
                    )
                )
            else:
                cached_ids.append(spec.req_id)
                cached_blocks.append((ids,) if ids else None)
                cached_computed.append(req.num_computed_tokens)
        output = types.SimpleNamespace(
            scheduled_new_reqs=new_reqs,
            # As the real SchedulerOutput carries them: each request's computed tokens
            # before this step (the older k3-chunk-gate script reads its progress from here).
            scheduled_cached_reqs=types.SimpleNamespace(
                req_ids=cached_ids, new_block_ids=cached_blocks, num_computed_tokens=cached_computed
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


def direct_results() -> list[tuple[str, bool]]:
    """The direct drive of build_connector_meta: one (line, ok) per request of every case."""
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
    return results


def _outcome(results: list[tuple[str, bool]], passed: str) -> ProbeOutcome:
    checks = tuple(line for line, _ in results)
    failures = [line for line, ok in results if not ok]
    if failures:
        summary = f"wrong in {len(failures)} of {len(results)} checks: " + "; ".join(failures)
        return ProbeOutcome(False, summary, checks)
    return ProbeOutcome(True, f"{passed} ({len(results)} checks)", checks)


# --------------------------------------------------------------------------------------------
# The second probe: vLLM's own `Scheduler.schedule()` of the tree drives the MoRIIO connector's
# scheduler side through chunked prefills, built on CPU the way vLLM's unit tests build one
# (a VllmConfig with a MoRIIO producer, one full-attention KV-cache group, a request with
# `do_remote_decode`), with a model config read from a config.json written here (no download,
# no tokenizer). The request's KV block is bigger than a chunk, as K3's padded pages are. It
# also records what `req.num_computed_tokens` holds inside build_connector_meta.

SCHEDULER_BLOCK = 5760
SCHEDULER_CHUNK = 2048


@dataclass(frozen=True)
class SchedulerCase:
    req_id: str
    prompt: int
    final_chunk: int  # the one chunk whose step must carry the save


SCHEDULER_CASES = (
    SchedulerCase("sched-2611", 2611, 2),  # 2,048 + 563 in one 5,760-token block
    SchedulerCase("sched-2050", 2050, 2),  # a last chunk of 2 tokens: no slack
    SchedulerCase("sched-5000", 5000, 3),  # 2,048 + 2,048 + 904
)

# A model vLLM knows, small; only its config is read (the scheduler runs no model).
_PROBE_MODEL_CONFIG = {
    "architectures": ["OPTForCausalLM"],
    "model_type": "opt",
    "hidden_size": 64,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "ffn_dim": 128,
    "vocab_size": 1000,
    "max_position_embeddings": 65536,
    "word_embed_proj_dim": 64,
}


def _accepted(func: Callable[..., Any], **kwargs: Any) -> dict[str, Any]:
    """The keyword arguments `func` takes (signatures differ between vLLM releases)."""
    import inspect

    params = inspect.signature(func).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _vllm_scheduler(model_dir: str) -> Any:
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    max_len = 16384
    model = ModelConfig(
        model=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=max_len
    )
    scheduler_config = SchedulerConfig(
        **_accepted(
            SchedulerConfig,
            max_num_seqs=4,
            max_num_batched_tokens=SCHEDULER_CHUNK,
            max_model_len=max_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        )
    )
    cache = CacheConfig(
        **_accepted(
            CacheConfig,
            block_size=SCHEDULER_BLOCK,
            gpu_memory_utilization=0.9,
            cache_dtype="auto",
            enable_prefix_caching=False,
        )
    )
    transfer = KVTransferConfig(
        kv_connector="MoRIIOConnector",
        kv_role="kv_producer",
        kv_connector_extra_config={
            "host_ip": "127.0.0.1",
            "handshake_port": 6301,
            "notify_port": 6401,
        },
    )
    config = VllmConfig(
        model_config=model,
        scheduler_config=scheduler_config,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    num_blocks = 64
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(
        **_accepted(
            FullAttentionSpec,
            block_size=SCHEDULER_BLOCK,
            num_kv_heads=1,
            head_size=1,
            dtype=torch.float32,
        )
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    return Scheduler(
        **_accepted(
            Scheduler.__init__,
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=SCHEDULER_BLOCK,
            log_stats=False,
        )
    )


@dataclass
class SchedulerRun:
    """Per chunk (1-based): whether the step's connector metadata carried the save, and
    `req.num_computed_tokens` inside build_connector_meta beside what scheduler_output says."""

    chunks: int = 0
    saves: list[int] = field(default_factory=list)
    seen: list[tuple[int, int | None]] = field(default_factory=list)
    # The prompt length the connector compares with (a fork's mamba_n1 truncates it by one).
    prompt: int = 0


def _seen_in_output(output: Any, req_id: str) -> int | None:
    for new in getattr(output, "scheduled_new_reqs", None) or ():
        if new.req_id == req_id:
            return int(new.num_computed_tokens)
    cached = output.scheduled_cached_reqs
    if req_id in cached.req_ids:
        return int(cached.num_computed_tokens[list(cached.req_ids).index(req_id)])
    return None


def drive_scheduler(scheduler: Any, case: SchedulerCase) -> SchedulerRun:
    """One request through vLLM's Scheduler until its prefill is done."""
    import dataclasses

    from vllm import SamplingParams
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    request = Request(
        **_accepted(
            Request.__init__,
            request_id=case.req_id,
            prompt_token_ids=[1] * case.prompt,
            sampling_params=SamplingParams(max_tokens=1),
            pooling_params=None,
        )
    )
    request.kv_transfer_params = {**_kv_params(case.req_id), "do_remote_prefill": False}
    run = SchedulerRun()
    connector = scheduler.connector.connector_scheduler
    build = connector.build_connector_meta

    def watched(scheduler_output: Any) -> Any:
        if case.req_id in scheduler_output.num_scheduled_tokens:
            live = scheduler.requests[case.req_id]
            run.seen.append(
                (int(live.num_computed_tokens), _seen_in_output(scheduler_output, case.req_id))
            )
            run.prompt = int(live.num_prompt_tokens)
        return build(scheduler_output)

    connector.build_connector_meta = watched
    try:
        scheduler.add_request(request)
        for _ in range(case.final_chunk + 3):
            output = scheduler.schedule()
            if case.req_id not in output.num_scheduled_tokens:
                break
            run.chunks += 1
            meta = output.kv_connector_metadata
            if case.req_id in getattr(meta, "reqs_to_save", {}):
                run.saves.append(run.chunks)
            ids = list(output.num_scheduled_tokens)
            done = {
                r: scheduler.requests[r].num_computed_tokens
                >= scheduler.requests[r].num_prompt_tokens
                for r in ids
            }
            fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
            values: dict[str, Any] = {
                "req_ids": ids,
                "req_id_to_index": {r: i for i, r in enumerate(ids)},
                "sampled_token_ids": [[7] if done[r] else [] for r in ids],
                "logprobs": None,
                "prompt_logprobs_dict": {},
                "pooler_output": [],
            }
            scheduler.update_from_output(
                output, ModelRunnerOutput(**{k: v for k, v in values.items() if k in fields})
            )
    finally:
        connector.build_connector_meta = build
    return run


def judge_scheduler(case: SchedulerCase, run: SchedulerRun) -> list[tuple[str, bool]]:
    want = [case.final_chunk]
    line = (
        f"Scheduler.schedule() [{case.req_id}]: {_saves(run.saves, run.chunks)}, "
        f"expected chunk {case.final_chunk} only"
    )
    out = [(line, run.saves == want and run.chunks == case.final_chunk)]
    live = [str(a) for a, _ in run.seen]
    told = [str(b) for _, b in run.seen]
    fresh = all(a == b for a, b in run.seen) and bool(run.seen)
    out.append(
        (
            f"Scheduler.schedule() [{case.req_id}]: inside build_connector_meta "
            f"(num_prompt_tokens {run.prompt}) "
            f"req.num_computed_tokens = {', '.join(live)} at chunks 1-{len(run.seen)}; "
            f"scheduler_output says {', '.join(told)}"
            + (" (the count before this step's chunk, not stale)" if fresh else " (STALE)"),
            fresh,
        )
    )
    return out


def probe_scheduler() -> list[tuple[str, bool]]:
    import importlib
    import json
    import logging
    import os
    import tempfile

    results: list[tuple[str, bool]] = []
    # The connector's scheduler side sets the process-wide MoRIIO role; later probes in this
    # process get back the role they had.
    mc = importlib.import_module(MODULE)
    role = mc.get_role()
    offline = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update({k: "1" for k in offline})
    logging.disable(logging.WARNING)
    try:
        with tempfile.TemporaryDirectory(prefix="k3patch-probe-model-") as model_dir:
            with open(os.path.join(model_dir, "config.json"), "w") as handle:
                json.dump(_PROBE_MODEL_CONFIG, handle)
            scheduler = _vllm_scheduler(model_dir)
            for case in SCHEDULER_CASES:
                results.extend(judge_scheduler(case, drive_scheduler(scheduler, case)))
    finally:
        mc.set_role(role)
        logging.disable(logging.NOTSET)
        for key, value in offline.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return results


def probe_chunk_gate() -> ProbeOutcome:
    """Both probes: the direct drive of build_connector_meta, then vLLM's own Scheduler."""
    return _outcome(
        [*direct_results(), *probe_scheduler()],
        "the save is emitted once, with the final prefill chunk, by build_connector_meta "
        "driven directly and under vLLM's Scheduler",
    )
