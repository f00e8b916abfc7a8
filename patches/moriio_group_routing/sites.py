"""The kinds of site part moriio-group-routing declares, over the engine's primitives (scope
lookup: k3patch.model; shapes and statement search: k3patch.shapes; edits: k3patch.edits).

A part looks at one piece of a site and says: the fork's shape (to be routed per group),
k3patch's shape, or neither (drift). A site is pending only when all its parts are the fork's,
applied only when all are k3patch's; any mixture is drift. A part whose anchor is one of the
fork's own statements is `evidence`: only such a part seeing the fork's shape (or k3patch's)
makes the package a fork package at all.
"""

from __future__ import annotations

import ast
import enum
from collections.abc import Callable
from dataclasses import dataclass

from k3patch.edits import Edit, Located, SourceText, append_item, insert_after, insert_before
from k3patch.model import (
    SourceFile,
    Verdict,
    find_class,
    find_function,
    find_scope,
    site_fingerprint,
    source_fingerprint,
)
from k3patch.model import mentioned_names as _mentioned
from k3patch.shapes import match, parse_pattern, search

from .forms import FIELD, FIELD_COMMENT, FIELD_NAME, dedent


class State(enum.Enum):
    FORK = "fork"
    APPLIED = "applied"
    DRIFT = "drift"


@dataclass(frozen=True)
class Look:
    state: State | None  # None: a precondition that holds, no opinion
    line: int | None = None
    found: str = ""
    expected: tuple[str, ...] = ()
    why: str = ""  # the drift reason, or for a pending form what is wrong with it
    shape: str = ""  # the form seen, when it is not the plain fork's


def drift(
    why: str, found: str = "", expected: tuple[str, ...] = (), line: int | None = None
) -> Look:
    return Look(State.DRIFT, line, found, expected, why)


def short(text: str, lines: int = 40) -> str:
    parts = text.splitlines()
    if len(parts) <= lines:
        return text
    return "\n".join([*parts[:lines], f"... ({len(parts) - lines} more lines)"])


def function(src: SourceFile, scope: str) -> ast.FunctionDef | None:
    node = find_scope(src.tree, scope)
    return node if isinstance(node, ast.FunctionDef) else None


def names(node: ast.AST) -> set[str]:
    """Identifiers, attribute names, keywords, parameters and string constants under `node`."""
    return _mentioned(node, everything=True)


def _count(source: str) -> int:
    return len(parse_pattern(source))


class Part:
    evidence = False

    def look(self, src: SourceFile) -> Look:
        raise NotImplementedError

    def edits(self, src: SourceFile, text: SourceText) -> list[Edit]:
        return []


def _absent(scope: str) -> Look:
    return drift(f"{scope} is absent", expected=(scope,))


@dataclass(frozen=True)
class Field(Part):
    """A dataclass field: the fork's `fork` field is there; k3patch adds FIELD after the last."""

    cls: str
    fork: str  # the fork's field statement, e.g. "mamba_block_ids: list[int] | None = None"
    evidence = True

    def _fields(self, src: SourceFile) -> tuple[ast.ClassDef | None, dict[str, ast.AnnAssign]]:
        cls = find_class(src.tree, self.cls)
        body = cls.body if cls is not None else []
        fields = {
            s.target.id: s
            for s in body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        }
        return cls, fields

    def look(self, src: SourceFile) -> Look:
        cls, fields = self._fields(src)
        if cls is None:
            return drift(f"class {self.cls} is absent", expected=(f"class {self.cls}",))
        mine = fields.get(FIELD_NAME)
        if mine is not None:
            if match(FIELD, mine) is not None:
                return Look(State.APPLIED, mine.lineno)
            why = f"{self.cls}.{FIELD_NAME} is not k3patch's field"
            return drift(why, src.segment(mine), (FIELD,), mine.lineno)
        candidate = fields.get(self.fork.split(":")[0].strip())
        if candidate is not None and match(self.fork, candidate) is not None:
            return Look(State.FORK, candidate.lineno)
        return drift(
            f"{self.cls} has no `{self.fork}` field (the fork's mamba block ids)",
            short(src.segment(cls)),
            (f"{self.cls}.{self.fork} (fork)", f"{self.cls}.{FIELD} (k3patch)"),
            cls.lineno,
        )

    def edits(self, src: SourceFile, text: SourceText) -> list[Edit]:
        last = max(self._fields(src)[1].values(), key=lambda s: s.lineno)
        return [insert_after(text, last, f"{FIELD_COMMENT}\n{FIELD}\n")]


@dataclass(frozen=True)
class Insert(Part):
    """Statements k3patch adds right after the one statement of `scope` that `anchor` (shape
    patterns) picks out, or with no anchor right before the function's final `return`. Where
    the anchor has holes, `fork` is the exact form the fork has there."""

    scope: str
    added: str
    marker: str  # a name of k3patch's text: used elsewhere in the function, it is drift
    anchor: tuple[str, ...] = ()
    describe: str = ""
    fork: str | None = None
    evidence: bool = True  # False where the anchor is upstream's own statement

    def _find(self, fn: ast.FunctionDef) -> list[tuple[list[ast.stmt], int]]:
        if not self.anchor:
            return [(fn.body, len(fn.body) - 1)]
        return [(block, i) for pattern in self.anchor for block, i, _ in search(pattern, fn)]

    def look(self, src: SourceFile) -> Look:
        fn = function(src, self.scope)
        if fn is None:
            return _absent(self.scope)
        hits = self._find(fn)
        if self.anchor and len(hits) != 1:
            return drift(
                f"{self.scope}: expected one {self.describe}, found {len(hits)}",
                short(src.segment(fn)),
                (self.describe,),
                fn.lineno,
            )
        body, i = hits[0]
        at = body[i]
        if not self.anchor and not isinstance(at, ast.Return):
            return drift(f"{self.scope} does not end in a return", src.segment(at), line=at.lineno)
        if self.fork is not None and match(self.fork, at) is None:
            return drift(
                f"{self.scope}: {self.describe} is not in the fork's shape",
                src.segment(at),
                (self.describe,),
                at.lineno,
            )
        count = _count(self.added)
        # k3patch puts its statements right after the anchor, but a script that runs again
        # later (the recipe re-runs its scripts at every container start; xfer_probe then
        # inserts its dump after `self.layer_to_spec = ...` once more) may push them down the
        # same block: they still follow the anchor, so they still count.
        starts = range(i + 1, len(body) - count + 1) if self.anchor else [i - count]
        for j in starts:
            if j >= 0 and match(self.added, body[j : j + count]) is not None:
                return Look(State.APPLIED, body[j].lineno)
        if self.marker in src.text and self.marker in names(fn):
            return drift(
                f"{self.scope}: `{self.marker}` is used, but not in k3patch's shape",
                short(src.segment(fn)),
                (dedent(self.added),),
                fn.lineno,
            )
        return Look(State.FORK, at.lineno)

    def edits(self, src: SourceFile, text: SourceText) -> list[Edit]:
        fn = function(src, self.scope)
        assert fn is not None
        body, i = self._find(fn)[0]
        if self.anchor:
            return [insert_after(text, body[i], self.added)]
        edit = insert_before(text, body[i], self.added)
        return [Edit(edit.start, edit.end, edit.text + text.newline)]


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


@dataclass(frozen=True)
class Keyword(Part):
    """`added` ("name=value"), which k3patch passes to the one call of `callee` in `scope` that
    passes the fork's `anchor` keyword, there as `fork` (an expression)."""

    scope: str
    callee: str
    anchor: str
    fork: str
    added: str
    evidence = True

    def _calls(self, fn: ast.FunctionDef) -> list[ast.Call]:
        return [
            c
            for c in ast.walk(fn)
            if isinstance(c, ast.Call)
            and _callee(c) == self.callee
            and any(k.arg == self.anchor for k in c.keywords)
        ]

    def look(self, src: SourceFile) -> Look:
        fn = function(src, self.scope)
        if fn is None:
            return _absent(self.scope)
        calls = self._calls(fn)
        if len(calls) != 1:
            return drift(
                f"{self.scope}: expected one {self.callee}(..., {self.anchor}=...) call, "
                f"found {len(calls)}",
                short(src.segment(fn)),
                (f"{self.callee}(..., {self.anchor}=...)",),
                fn.lineno,
            )
        call = calls[0]
        passed = next(k.value for k in call.keywords if k.arg == self.anchor)
        if match(self.fork, passed) is None:
            why = f"{self.scope}: {self.anchor}= is not passed in the fork's shape"
            return drift(why, src.segment(call), line=call.lineno)
        name, value = self.added.split("=", 1)
        mine = next((k for k in call.keywords if k.arg == name), None)
        if mine is None:
            return Look(State.FORK, call.lineno)
        if match(value, mine.value) is not None:
            return Look(State.APPLIED, call.lineno)
        return drift(
            f"{self.scope}: {name}= is passed, but not as k3patch passes it",
            src.segment(call),
            (self.added,),
            call.lineno,
        )

    def edits(self, src: SourceFile, text: SourceText) -> list[Edit]:
        fn = function(src, self.scope)
        assert fn is not None
        call = self._calls(fn)[0]
        items: list[Located] = [*call.args, *call.keywords]
        last = max(items, key=lambda n: (n.end_lineno or 0, n.end_col_offset or 0))
        return [append_item(text, call, last, last, self.added)]


@dataclass(frozen=True)
class Param(Part):
    """A parameter (`added`: "name: annotation = default") k3patch appends to the function at
    `scope`, which takes the fork's `anchor` parameter."""

    scope: str
    anchor: str
    added: str
    evidence = True

    def look(self, src: SourceFile) -> Look:
        fn = function(src, self.scope)
        if fn is None:
            return _absent(self.scope)
        args = fn.args
        if args.vararg or args.kwarg or args.kwonlyargs:
            return drift(
                f"{self.scope}: unexpected *args/**kwargs/keyword-only parameters",
                src.segment(fn.args),
                line=fn.lineno,
            )
        params = [*args.posonlyargs, *args.args]
        by_name = {a.arg: a for a in params}
        name = self.added.split(":")[0].strip()
        mine = by_name.get(name)
        if mine is not None:
            index = params.index(mine) - (len(params) - len(args.defaults))
            default = args.defaults[index] if index >= 0 else None
            annotation, value = self.added.split(":", 1)[1].rsplit("=", 1)
            if (
                mine.annotation is not None
                and match(annotation, mine.annotation) is not None
                and default is not None
                and match(value, default) is not None
            ):
                return Look(State.APPLIED, fn.lineno)
            why = f"{self.scope}: parameter {name} is not k3patch's"
            return drift(why, src.segment(mine), (self.added,), fn.lineno)
        if self.anchor in by_name:
            return Look(State.FORK, fn.lineno)
        return drift(
            f"{self.scope} takes no `{self.anchor}` (the fork's mamba block ids)",
            short(src.segment(fn), 12),
            (f"{self.scope}(..., {self.anchor}=...)",),
            fn.lineno,
        )

    def edits(self, src: SourceFile, text: SourceText) -> list[Edit]:
        fn = function(src, self.scope)
        assert fn is not None
        args = fn.args
        last_arg = [*args.posonlyargs, *args.args][-1]
        last: Located = last_arg
        if args.defaults and args.args and args.args[-1] is last_arg:
            last = args.defaults[-1]
        return [append_item(text, fn, last_arg, last, self.added)]


@dataclass(frozen=True)
class DictKey(Part):
    """A key k3patch adds to the one dict literal in `scope` that carries the fork's `anchor`."""

    scope: str
    anchor: str
    key: str
    value: str
    evidence = True

    def _dicts(self, fn: ast.FunctionDef) -> list[ast.Dict]:
        return [
            d
            for d in ast.walk(fn)
            if isinstance(d, ast.Dict)
            and any(isinstance(k, ast.Constant) and k.value == self.anchor for k in d.keys)
        ]

    def look(self, src: SourceFile) -> Look:
        fn = function(src, self.scope)
        if fn is None:
            return _absent(self.scope)
        found = self._dicts(fn)
        if len(found) != 1:
            return drift(
                f"{self.scope}: expected one message dict with {self.anchor!r}, found {len(found)}",
                short(src.segment(fn)),
                line=fn.lineno,
            )
        message = found[0]
        entries = {
            k.value: v
            for k, v in zip(message.keys, message.values, strict=True)
            if isinstance(k, ast.Constant)
        }
        if self.key not in entries:
            return Look(State.FORK, message.lineno)
        if match(self.value, entries[self.key]) is not None:
            return Look(State.APPLIED, message.lineno)
        return drift(
            f"{self.scope}: message key {self.key!r} is not k3patch's",
            src.segment(message),
            (f'"{self.key}": {self.value}',),
            message.lineno,
        )

    def edits(self, src: SourceFile, text: SourceText) -> list[Edit]:
        fn = function(src, self.scope)
        assert fn is not None
        message = self._dicts(fn)[0]
        key = message.keys[-1] or message.values[-1]  # None: a `**mapping` entry
        item = f'"{self.key}": {self.value}'
        return [append_item(text, message, key, message.values[-1], item)]


@dataclass(frozen=True)
class Function(Part):
    """A module-level function k3patch appends to the module."""

    name: str
    source: str

    def look(self, src: SourceFile) -> Look:
        fn = find_function(src.tree, self.name)
        if fn is None:
            return Look(State.FORK)
        # A fingerprint, not a shape: the function's docstring is not part of what it does.
        if site_fingerprint(fn) == source_fingerprint(self.source):
            return Look(State.APPLIED, fn.lineno)
        why = f"{self.name} is not k3patch's function"
        return drift(why, short(src.segment(fn)), (dedent(self.source),), fn.lineno)

    def edits(self, src: SourceFile, text: SourceText) -> list[Edit]:
        end = len(text.text)
        nl = text.newline
        lead = nl * 2 if text.text.endswith(("\n", "\r")) else nl * 3
        return [Edit(end, end, lead + dedent(self.source).replace("\n", nl))]


@dataclass(frozen=True)
class Requires(Part):
    """A precondition of k3patch's text (a name it uses must exist); no opinion when it holds."""

    what: str
    holds: Callable[[SourceFile], bool]

    def look(self, src: SourceFile) -> Look:
        return (
            Look(None)
            if self.holds(src)
            else drift(f"k3patch's text needs {self.what}", expected=(self.what,))
        )


def has_param(scope: str, name: str) -> Callable[[SourceFile], bool]:
    def holds(src: SourceFile) -> bool:
        fn = function(src, scope)
        return fn is not None and name in {a.arg for a in [*fn.args.posonlyargs, *fn.args.args]}

    return holds


@dataclass(frozen=True)
class SiteLook:
    verdict: Verdict
    look: Look
    notes: tuple[str, ...]  # what is wrong with a pending form, beyond the fork's bug
    shape: str  # the form seen when it is not the plain fork's
    evidence: bool  # an anchored part saw the fork's shape or k3patch's


@dataclass(frozen=True)
class Site:
    name: str
    file: str
    parts: tuple[Part, ...]
    what: str  # what k3patch does here, for reports

    def look(self, src: SourceFile) -> SiteLook:
        looks = [(part, part.look(src)) for part in self.parts]
        evidence = any(
            part.evidence and look.state in (State.FORK, State.APPLIED) for part, look in looks
        )
        notes = tuple(look.why for _, look in looks if look.state is not State.DRIFT and look.why)
        shape = next((look.shape for _, look in looks if look.shape), "")
        states = [look for _, look in looks if look.state is not None]
        for look in states:
            if look.state is State.DRIFT:
                return SiteLook(Verdict.DRIFTED, look, (), "", evidence)
        kinds = {look.state for look in states}
        line = next((look.line for look in states if look.line), None)
        if kinds == {State.APPLIED}:
            return SiteLook(Verdict.APPLIED, Look(State.APPLIED, line), (), "", evidence)
        if kinds == {State.FORK}:
            return SiteLook(Verdict.PENDING, Look(State.FORK, line), notes, shape, evidence)
        why = "partly in k3patch's shape, partly in the fork's: edited by hand?"
        return SiteLook(Verdict.DRIFTED, drift(why, line=line), (), "", evidence)
