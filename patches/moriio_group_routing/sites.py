"""The parts a moriio-group-routing site is made of, over the engine's primitives (scope lookup:
k3patch.model; shapes and statement search: k3patch.shapes; edits: k3patch.edits).

A part looks at one piece of its site's class or function and says: the fork's shape (pending),
k3patch's (applied) or neither (drifted); a precondition that holds has no opinion (None). A site
is pending only when all its parts are the fork's, applied only when all are k3patch's; any
mixture is drift. A part whose anchor is one of the fork's own statements is `evidence`: only
such a part seeing the fork's shape (or k3patch's) makes the package a fork package at all.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from k3patch.edits import Edit, Located, SourceText, append_item, insert_after, insert_before
from k3patch.edits import replace as replace_stmts
from k3patch.model import (
    SiteResult,
    SourceFile,
    Verdict,
    find_function,
    find_scope,
    mentioned_names,
    site_fingerprint,
    source_fingerprint,
    stored_names,
)
from k3patch.shapes import match, parse_pattern, search

from . import forms
from .forms import FIELD, FIELD_COMMENT, FIELD_NAME, dedent, indented

PENDING, APPLIED, DRIFTED = Verdict.PENDING, Verdict.APPLIED, Verdict.DRIFTED


@dataclass(frozen=True)
class Look:
    verdict: Verdict | None  # None: a precondition that holds, no opinion
    line: int | None = None
    found: str = ""
    expected: tuple[str, ...] = ()
    why: str = ""  # the drift reason, or what is wrong with a pending form beyond the fork's bug
    shape: str = ""  # the form seen, when it is not the plain fork's


def drift(
    why: str, found: str = "", expected: tuple[str, ...] = (), line: int | None = None
) -> Look:
    return Look(DRIFTED, line, found, expected, why)


def function(src: SourceFile, scope: str) -> ast.FunctionDef | None:
    node = find_scope(src.tree, scope)
    return node if isinstance(node, ast.FunctionDef) else None


def short(text: str, lines: int = 40) -> str:
    parts = text.splitlines()
    if len(parts) <= lines:
        return text
    return "\n".join([*parts[:lines], f"... ({len(parts) - lines} more lines)"])


class Part:
    evidence = False

    def look(self, src: SourceFile, node: Any, scope: str) -> Look:
        """`node`: the site's class (for a Field) or function, `scope` its path (for reports)."""
        raise NotImplementedError

    def edits(self, src: SourceFile, text: SourceText, node: Any) -> list[Edit]:
        return []


@dataclass(frozen=True)
class Field(Part):
    """A dataclass field: the fork's `fork` field is there; k3patch adds FIELD after the last."""

    fork: str  # e.g. "mamba_block_ids: list[int] | None = None"
    evidence = True

    @staticmethod
    def _fields(cls: ast.ClassDef) -> dict[str, ast.AnnAssign]:
        return {
            s.target.id: s
            for s in cls.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        }

    def look(self, src: SourceFile, node: ast.ClassDef, scope: str) -> Look:
        fields = self._fields(node)
        mine = fields.get(FIELD_NAME)
        if mine is None:
            candidate = fields.get(self.fork.split(":")[0].strip())
            if candidate is not None and match(self.fork, candidate) is not None:
                return Look(PENDING, candidate.lineno)
            return drift(
                f"{scope} has no `{self.fork}` field (the fork's mamba block ids)",
                short(src.segment(node)),
                (f"{scope}.{self.fork} (fork)", f"{scope}.{FIELD} (k3patch)"),
                node.lineno,
            )
        if match(FIELD, mine) is not None:
            return Look(APPLIED, mine.lineno)
        why = f"{scope}.{FIELD_NAME} is not k3patch's field"
        return drift(why, src.segment(mine), (FIELD,), mine.lineno)

    def edits(self, src: SourceFile, text: SourceText, node: ast.ClassDef) -> list[Edit]:
        last = max(self._fields(node).values(), key=lambda s: s.lineno)
        return [insert_after(text, last, f"{FIELD_COMMENT}\n{FIELD}\n")]


@dataclass(frozen=True)
class Insert(Part):
    """Statements k3patch adds right after the one statement of the function that `anchor`
    (shape patterns) picks out, or with no anchor right before its final `return`. Where the
    anchor has holes, `fork` is the exact form the fork has there."""

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

    def look(self, src: SourceFile, node: ast.FunctionDef, scope: str) -> Look:
        hits = self._find(node)
        if self.anchor and len(hits) != 1:
            return drift(
                f"{scope}: expected one {self.describe}, found {len(hits)}",
                short(src.segment(node)),
                (self.describe,),
                node.lineno,
            )
        body, i = hits[0]
        at = body[i]
        if not self.anchor and not isinstance(at, ast.Return):
            return drift(f"{scope} does not end in a return", src.segment(at), line=at.lineno)
        if self.fork is not None and match(self.fork, at) is None:
            why = f"{scope}: {self.describe} is not in the fork's shape"
            return drift(why, src.segment(at), (self.describe,), at.lineno)
        count = len(parse_pattern(self.added))
        # k3patch puts its statements right after the anchor, but a script that runs again
        # later (the recipe re-runs its scripts at every container start; xfer_probe then
        # inserts its dump after `self.layer_to_spec = ...` once more) may push them down the
        # same block: they still follow the anchor, so they still count.
        starts = range(i + 1, len(body) - count + 1) if self.anchor else [i - count]
        for j in starts:
            if j >= 0 and match(self.added, body[j : j + count]) is not None:
                return Look(APPLIED, body[j].lineno)
        if self.marker in src.text and self.marker in mentioned_names(node, everything=True):
            return drift(
                f"{scope}: `{self.marker}` is used, but not in k3patch's shape",
                short(src.segment(node)),
                (dedent(self.added),),
                node.lineno,
            )
        return Look(PENDING, at.lineno)

    def edits(self, src: SourceFile, text: SourceText, node: ast.FunctionDef) -> list[Edit]:
        body, i = self._find(node)[0]
        if self.anchor:
            return [insert_after(text, body[i], self.added)]
        edit = insert_before(text, body[i], self.added)
        return [Edit(edit.start, edit.end, edit.text + text.newline)]


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


@dataclass(frozen=True)
class Keyword(Part):
    """`added` ("name=value"), which k3patch passes to the one call of `callee` in the function
    that passes the fork's `anchor` ("name=value" too) keyword."""

    callee: str
    anchor: str
    added: str
    evidence = True

    def _calls(self, fn: ast.FunctionDef) -> list[ast.Call]:
        name = self.anchor.split("=")[0]
        return [
            c
            for c in ast.walk(fn)
            if isinstance(c, ast.Call)
            and _callee(c) == self.callee
            and any(k.arg == name for k in c.keywords)
        ]

    def look(self, src: SourceFile, node: ast.FunctionDef, scope: str) -> Look:
        calls = self._calls(node)
        (anchor, fork), (name, value) = self.anchor.split("=", 1), self.added.split("=", 1)
        if len(calls) != 1:
            return drift(
                f"{scope}: expected one {self.callee}(..., {anchor}=...) call, found {len(calls)}",
                short(src.segment(node)),
                (f"{self.callee}(..., {anchor}=...)",),
                node.lineno,
            )
        call = calls[0]
        if match(fork, next(k.value for k in call.keywords if k.arg == anchor)) is None:
            why = f"{scope}: {anchor}= is not passed in the fork's shape"
            return drift(why, src.segment(call), line=call.lineno)
        mine = next((k for k in call.keywords if k.arg == name), None)
        if mine is None or match(value, mine.value) is not None:
            return Look(PENDING if mine is None else APPLIED, call.lineno)
        why = f"{scope}: {name}= is passed, but not as k3patch passes it"
        return drift(why, src.segment(call), (self.added,), call.lineno)

    def edits(self, src: SourceFile, text: SourceText, node: ast.FunctionDef) -> list[Edit]:
        call = self._calls(node)[0]
        items: list[Located] = [*call.args, *call.keywords]
        last = max(items, key=lambda n: (n.end_lineno or 0, n.end_col_offset or 0))
        return [append_item(text, call, last, last, self.added)]


@dataclass(frozen=True)
class Param(Part):
    """A parameter (`added`: "name: annotation = default") k3patch appends to the function, which
    takes the fork's `anchor` parameter."""

    anchor: str
    added: str
    evidence = True

    def look(self, src: SourceFile, node: ast.FunctionDef, scope: str) -> Look:
        args = node.args
        if args.vararg or args.kwarg or args.kwonlyargs:
            why = f"{scope}: unexpected *args/**kwargs/keyword-only parameters"
            return drift(why, src.segment(args), line=node.lineno)
        params = [*args.posonlyargs, *args.args]
        by_name = {a.arg: a for a in params}
        name, rest = self.added.split(":", 1)
        mine = by_name.get(name.strip())
        if mine is None:
            if self.anchor in by_name:
                return Look(PENDING, node.lineno)
            return drift(
                f"{scope} takes no `{self.anchor}` (the fork's mamba block ids)",
                short(src.segment(node), 12),
                (f"{scope}(..., {self.anchor}=...)",),
                node.lineno,
            )
        index = params.index(mine) - (len(params) - len(args.defaults))
        default = args.defaults[index] if index >= 0 else None
        annotation, value = rest.rsplit("=", 1)
        if (
            mine.annotation is not None
            and match(annotation, mine.annotation) is not None
            and default is not None
            and match(value, default) is not None
        ):
            return Look(APPLIED, node.lineno)
        why = f"{scope}: parameter {name.strip()} is not k3patch's"
        return drift(why, src.segment(mine), (self.added,), node.lineno)

    def edits(self, src: SourceFile, text: SourceText, node: ast.FunctionDef) -> list[Edit]:
        args = node.args
        last_arg = [*args.posonlyargs, *args.args][-1]
        last: Located = last_arg
        if args.defaults and args.args and args.args[-1] is last_arg:
            last = args.defaults[-1]
        return [append_item(text, node, last_arg, last, self.added)]


@dataclass(frozen=True)
class DictKey(Part):
    """A key k3patch adds to the one dict literal in the function that has the fork's `anchor`."""

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

    def look(self, src: SourceFile, node: ast.FunctionDef, scope: str) -> Look:
        found = self._dicts(node)
        if len(found) != 1:
            return drift(
                f"{scope}: expected one message dict with {self.anchor!r}, found {len(found)}",
                short(src.segment(node)),
                line=node.lineno,
            )
        message = found[0]
        entries = {
            k.value: v
            for k, v in zip(message.keys, message.values, strict=True)
            if isinstance(k, ast.Constant)
        }
        mine = entries.get(self.key)
        if mine is None or match(self.value, mine) is not None:
            return Look(PENDING if mine is None else APPLIED, message.lineno)
        return drift(
            f"{scope}: message key {self.key!r} is not k3patch's",
            src.segment(message),
            (f'"{self.key}": {self.value}',),
            message.lineno,
        )

    def edits(self, src: SourceFile, text: SourceText, node: ast.FunctionDef) -> list[Edit]:
        message = self._dicts(node)[0]
        key = message.keys[-1] or message.values[-1]  # None: a `**mapping` entry
        item = f'"{self.key}": {self.value}'
        return [append_item(text, message, key, message.values[-1], item)]


@dataclass(frozen=True)
class Function(Part):
    """A module-level function k3patch appends to the module."""

    name: str
    source: str

    def look(self, src: SourceFile, node: ast.AST, scope: str) -> Look:
        fn = find_function(src.tree, self.name)
        if fn is None:
            return Look(PENDING)
        # A fingerprint, not a shape: the function's docstring is not part of what it does.
        if site_fingerprint(fn) == source_fingerprint(self.source):
            return Look(APPLIED, fn.lineno)
        why = f"{self.name} is not k3patch's function"
        return drift(why, short(src.segment(fn)), (dedent(self.source),), fn.lineno)

    def edits(self, src: SourceFile, text: SourceText, node: ast.AST) -> list[Edit]:
        end, nl = len(text.text), text.newline
        lead = nl * 2 if text.text.endswith(("\n", "\r")) else nl * 3
        return [Edit(end, end, lead + dedent(self.source).replace("\n", nl))]


@dataclass(frozen=True)
class Requires(Part):
    """A precondition of k3patch's text (a name it uses must exist); no opinion when it holds."""

    what: str
    holds: Callable[[SourceFile, ast.FunctionDef | None], bool]

    def look(self, src: SourceFile, node: ast.FunctionDef | None, scope: str) -> Look:
        if self.holds(src, node):
            return Look(None)
        return drift(f"k3patch's text needs {self.what}", expected=(self.what,))


def takes(name: str) -> Callable[[SourceFile, ast.FunctionDef | None], bool]:
    """A Requires test: the site's function has a positional parameter `name`."""
    return lambda src, fn: (
        fn is not None and name in {a.arg for a in [*fn.args.posonlyargs, *fn.args.args]}
    )


# --------------------------------------------------------------------------------------------
# The transfer plan (MoRIIOWriter._prepare_transfer_plan): the per-layer choice of block ids
# and the offsets cache; and the older fix's first-chunk defect in build_connector_meta.


def _is_debug_block(imp: ast.stmt, gate: ast.stmt) -> bool:
    """`import os as X` + `if X.environ.get('K3_MAMBA_BC', '0') == '1': ...` that only logs:
    no else branch, and nothing bound that the offsets call or the cache store reads."""
    if not (
        isinstance(imp, ast.Import)
        and len(imp.names) == 1
        and imp.names[0].name == "os"
        and imp.names[0].asname
        and isinstance(gate, ast.If)
        and not gate.orelse
    ):
        return False
    imports = [n for n in ast.walk(gate) if isinstance(n, ast.Import | ast.ImportFrom)]
    bound = stored_names([gate]) | {
        (a.asname or a.name).split(".")[0] for n in imports for a in n.names
    }
    read_later = {"offsets", "geometry_key", "_k3_local", "_k3_remote", "task", "request_info"}
    test = forms.DEBUG_TEST.format(alias=imp.names[0].asname)
    return match(test, gate.test) is not None and not bound & read_later


def _regions(fn: ast.FunctionDef) -> list[tuple[str, list[ast.stmt], bool]]:
    """(kind, the statements `apply` replaces, whether the K3_MAMBA_BC block is among them) of
    every region in a known form: "k3patch", "fork" or "legacy" (the older fix)."""
    size = len(parse_pattern(forms.K3PATCH_PLAN))
    found = [("k3patch", b[i : i + size], False) for b, i, _ in search(forms.K3PATCH_PLAN, fn)]
    for (kind, debug), pattern in forms.PLANS.items():
        for block, i, holes in search(pattern, fn):
            if not debug or _is_debug_block(holes["HOLE_debug_import"], holes["HOLE_debug_gate"]):
                found.append((kind, block[i : i + 3], debug))
    return found


@dataclass(frozen=True)
class Plan(Part):
    """The per-layer choice of block ids and the offsets cache in the transfer plan."""

    evidence = True

    def look(self, src: SourceFile, node: ast.FunctionDef, scope: str) -> Look:
        found = _regions(node)
        if len(found) != 1:
            return drift(
                f"{scope}: the per-layer block-id choice is in no known shape"
                + (f" ({len(found)} candidate regions)" if found else ""),
                short(src.segment(node), 60),
                (
                    f"fork: {dedent(forms.PLAN_HEAD)}if {forms.PLAN_MISS}:\n"
                    f"{indented(forms.FORK_CHOICE)}    [K3_MAMBA_BC debug block]\n"
                    f"{indented(forms.PLAN_TAIL)}",
                    f"older k3-group-routing fix: the same with\n{indented(forms.LEGACY_CHOICE)}",
                    f"k3patch: {dedent(forms.K3PATCH_PLAN)}",
                ),
                node.lineno,
            )
        kind, stmts, debug = found[0]
        goes = f"; {forms.DEBUG_GOES}" if debug else ""
        if kind == "k3patch":
            return Look(APPLIED, stmts[0].lineno)
        if kind == "fork":
            return Look(PENDING, stmts[0].lineno, why=forms.FORK_DEFECT + goes)
        why = f"the older k3-group-routing fix: {forms.GEOMETRY_DEFECT}; {forms.LEGACY_CAVEATS}"
        if debug:
            why += f"; {forms.LEGACY_DEBUG_DEFECT}"
        return Look(PENDING, stmts[0].lineno, why=why + goes, shape=forms.LEGACY_SHAPE)

    def edits(self, src: SourceFile, text: SourceText, node: ast.FunctionDef) -> list[Edit]:
        return [replace_stmts(text, _regions(node)[0][1], forms.K3PATCH_PLAN)]


@dataclass(frozen=True)
class LegacyGrowth(Part):
    """No opinion on the site's state; names the older fix's first-chunk defect where its
    capture (in `capture_in`) is there and its chunked companion (in the site's function) is
    not."""

    capture_in: str

    def look(self, src: SourceFile, node: ast.FunctionDef, scope: str) -> Look:
        capture = function(src, self.capture_in)
        if capture is None or not search(forms.LEGACY_CAPTURE, capture):
            return Look(None)
        if search(forms.CHUNKED_ALLGRP, node):
            why = "the older fix's chunked companion grows its all-group lists per chunk"
            return Look(None, why=why, shape=forms.LEGACY_CHUNKED_SHAPE)
        why = f"older k3-group-routing fix: {forms.FIRST_CHUNK_DEFECT}"
        return Look(None, why=why, shape=forms.LEGACY_SHAPE)


# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Site:
    """One hop the block ids take: its parts look at one class (a field site) or method."""

    name: str
    file: str
    what: str  # what k3patch does here, for reports
    parts: tuple[Part, ...]

    @property
    def scope(self) -> str:
        return self.name.split(" ")[0].removesuffix(f".{FIELD_NAME}")

    def node(self, src: SourceFile) -> ast.ClassDef | ast.FunctionDef | None:
        node = find_scope(src.tree, self.scope)
        return (
            node
            if isinstance(node, ast.FunctionDef if "." in self.scope else ast.ClassDef)
            else None
        )

    def look(self, src: SourceFile) -> tuple[Look, bool]:
        """The site's verdict, shape and detail as one Look, and whether it is evidence."""
        node, scope = self.node(src), self.scope
        if node is None:
            # A precondition (always a site's first parts) that fails is the better reason.
            needs = [p.look(src, None, scope) for p in self.parts if isinstance(p, Requires)]
            what = scope if "." in scope else f"class {scope}"
            absent = drift(f"{what} is absent", expected=(what,))
            return next((look for look in needs if look.verdict), absent), False
        looks = [(part, part.look(src, node, scope)) for part in self.parts]
        evidence = any(p.evidence and k.verdict in (PENDING, APPLIED) for p, k in looks)
        states = [look for _, look in looks if look.verdict is not None]
        drifted = next((look for look in states if look.verdict is DRIFTED), None)
        if drifted is not None:
            return drifted, evidence
        kinds = {look.verdict for look in states}
        line = next((look.line for look in states if look.line), None)
        if kinds == {APPLIED}:
            return Look(APPLIED, line, why=self.what, shape="k3patch"), evidence
        if kinds == {PENDING}:
            notes = [look.why for _, look in looks if look.why]
            shape = next((look.shape for _, look in looks if look.shape), forms.FORK_SHAPE)
            return Look(PENDING, line, why="; ".join((self.what, *notes)), shape=shape), evidence
        why = "partly in k3patch's shape, partly in the fork's: edited by hand?"
        return drift(why, line=line), evidence

    def result(self, patch_id: str, src: SourceFile) -> tuple[SiteResult, bool]:
        look, evidence = self.look(src)
        verdict = look.verdict or DRIFTED  # a site's look always has one
        where = (look.line, look.found, look.expected)
        return SiteResult(
            patch_id, self.name, self.file, verdict, look.shape, look.why, *where
        ), evidence

    def edits(self, src: SourceFile, text: SourceText) -> list[Edit]:
        node = self.node(src)
        return [edit for part in self.parts for edit in part.edits(src, text, node)]
