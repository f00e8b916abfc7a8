"""moriio-group-routing's sites and their parts (private to this patch): each part sees one piece
of its site's class or function in the fork's shape (pending), k3patch's (applied), neither
(drifted) or has no opinion (None)."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from k3patch import astkit
from k3patch.fingerprints import dedent, site_fingerprint, source_fingerprint
from k3patch.shapes import match, matches_each, parse_pattern, search
from k3patch.sources import SourceFile
from k3patch.verdicts import SiteResult, Verdict

from . import forms
from .forms import FIELD_COMMENT, FIELD_NAME

if TYPE_CHECKING:
    from k3patch.codemod import Codemod

PENDING, APPLIED, DRIFTED = Verdict.PENDING, Verdict.APPLIED, Verdict.DRIFTED
Holds = Callable[[SourceFile, Any], bool]  # (the file, the site's function or None)


@dataclass(frozen=True)
class Look:
    verdict: Verdict | None  # None: no opinion
    line: int | None = None
    found: str = ""
    expected: tuple[str, ...] = ()
    why: str = ""  # the drift reason, or what is wrong with a pending form beyond the fork's bug
    shape: str = ""  # the form seen, when it is not the plain fork's


def drift(why: str, found: str = "", expected: tuple = (), line: int | None = None) -> Look:
    return Look(DRIFTED, line, found, expected, why)


class Part:
    evidence = False  # anchored on the fork's own statements: either shape makes it a fork tree

    def look(self, src: SourceFile, node: Any, scope: str) -> Look:
        """`node`: the site's class (a field site) or function, `scope` its path (for reports)."""
        raise NotImplementedError

    def rewrite(self, src: SourceFile, file: Codemod, node: Any) -> None:
        """Make this part k3patch's in `file`, the codemod of `src` (a note changes nothing)."""


@dataclass(frozen=True)
class Insert(Part):
    """Statements k3patch adds after the one statement `anchor` (patterns) picks out, else before
    the final `return`; with `fork` (the fork's exact assignment), any assignment to its target."""

    added: str
    marker: str  # a name of k3patch's text: used elsewhere in the function, it is drift
    anchor: tuple[str, ...] = ()
    fork: str | None = None
    evidence: bool = True  # False where the anchor is upstream's own statement

    @property
    def anchors(self) -> tuple[str, ...]:
        return self.anchor if self.fork is None else (self.fork.split(" = ")[0] + " = HOLE_value",)

    def _find(self, fn: ast.FunctionDef) -> list[tuple[list[ast.stmt], int]]:
        if not self.anchors:
            return [(fn.body, len(fn.body) - 1)]
        return [(block, i) for pattern in self.anchors for block, i, _ in search(pattern, fn)]

    def look(self, src: SourceFile, node: ast.FunctionDef, scope: str) -> Look:
        hits = self._find(node)
        describe = f"`{self.anchors[-1].replace('HOLE_value', '...')}`" if self.anchors else ""
        if self.anchors and len(hits) != 1:
            why = f"{scope}: expected one {describe}, found {len(hits)}"
            return drift(why, clip_lines(src.segment(node)), (describe,), node.lineno)
        body, i = hits[0]
        at = body[i]
        if not self.anchors and not isinstance(at, ast.Return):
            return drift(f"{scope} does not end in a return", src.segment(at), line=at.lineno)
        if self.fork is not None and match(self.fork, at) is None:
            why = f"{scope}: {describe} is not in the fork's shape"
            return drift(why, src.segment(at), (self.fork,), at.lineno)
        count = len(parse_pattern(self.added))
        # A script the recipe re-runs at each container start (xfer_probe inserts its dump after
        # the anchor again) may push k3patch's statements down the block: they still count.
        starts = range(i + 1, len(body) - count + 1) if self.anchors else [i - count]
        for j in starts:
            if j >= 0 and match(self.added, body[j : j + count]) is not None:
                return Look(APPLIED, body[j].lineno)
        if self.marker in src.text and self.marker in astkit.mentioned_names(node, everything=True):
            why = f"{scope}: `{self.marker}` is used, but not in k3patch's shape"
            return drift(why, clip_lines(src.segment(node)), (dedent(self.added),), node.lineno)
        return Look(PENDING, at.lineno)

    def rewrite(self, src: SourceFile, file: Codemod, node: ast.FunctionDef) -> None:
        body, i = self._find(node)[0]
        if self.anchors:
            file.insert_after(body[i], self.added)
            return
        import libcst as cst  # only when there is something to rewrite: status never loads it

        from k3patch.codemod import with_leading_lines

        # k3patch's statements stand apart from the final return, as a paragraph of their own.
        file.insert_before(body[i], self.added)
        file.change(body[i], lambda n: with_leading_lines(n, [cst.EmptyLine(indent=False)]))


@dataclass(frozen=True)
class Item(Part):
    """One item k3patch appends in the one holder with the fork's item: a dataclass "field", a
    "param", a "keyword" argument to `callee` or a dict literal's "key", each written as the code
    has it; a `fork` without a value only has to be there."""

    kind: str
    fork: str
    added: str
    callee: str = ""
    evidence = True

    def _parse(self, text: str) -> tuple[str, list[str]]:
        """An item as written: its name, and the sources its parts match (none: only its name)."""
        if self.kind == "field":
            return text.split(":")[0].strip(), [text]
        name, _, value = text.partition({"param": ":", "keyword": "=", "key": ": "}[self.kind])
        if self.kind == "key":
            name = ast.literal_eval(name)
        if self.kind == "param" and value:
            return name.strip(), value.rsplit("=", 1)
        return name.strip(), [value] if value else []

    def _items(self, holder: Any) -> dict[str, tuple[Any, int, list[Any]]]:
        """name -> (the item's node, the line a report names, the nodes its parts are)."""
        items: dict[str, tuple[Any, Any]] = named_items(holder)
        if self.kind == "field":
            return {k: (node, node.lineno, [node]) for k, (node, _) in items.items()}
        if self.kind == "param":
            return {k: (n, holder.lineno, [n.annotation, v]) for k, (n, v) in items.items()}
        key = self.kind == "key"
        return {k: (v if key else n, holder.lineno, [v]) for k, (n, v) in items.items()}

    def _holders(self, node: Any) -> list[Any]:
        if self.kind in ("field", "param"):
            return [node]
        kind, name = ast.Call if self.kind == "keyword" else ast.Dict, self._parse(self.fork)[0]
        found = [n for n in ast.walk(node) if isinstance(n, kind) and name in named_items(n)]
        return [n for n in found if isinstance(n, ast.Dict) or astkit.callee_name(n) == self.callee]

    def look(self, src: SourceFile, node: Any, scope: str) -> Look:
        if self.kind == "param" and (node.args.vararg or node.args.kwarg or node.args.kwonlyargs):
            why = f"{scope}: unexpected *args/**kwargs/keyword-only parameters"
            return drift(why, src.segment(node.args), line=node.lineno)
        holders = self._holders(node)
        if len(holders) != 1:
            return self._missing(src, node, scope, len(holders))
        items = self._items(holders[0])
        fork, fork_parts = self._parse(self.fork)
        name, parts = self._parse(self.added)
        # The fork's keyword picks the call, so it must be the fork's whatever else is there.
        if self.kind == "keyword" and not matches_each(fork_parts, items[fork][2]):
            why = f"{scope}: {fork}= is not passed in the fork's shape"
            return drift(why, src.segment(holders[0]), line=holders[0].lineno)
        if name in items:
            mine, line, mine_parts = items[name]
            if matches_each(parts, mine_parts):
                return Look(APPLIED, line)
            why = f"{scope}: {self.kind} {name} is not k3patch's"
            return drift(why, src.segment(mine), (self.added,), line)
        if fork not in items or not matches_each(fork_parts, items[fork][2]):
            return self._missing(src, node, scope, 0)
        return Look(PENDING, items[fork][1])

    def _missing(self, src: SourceFile, node: Any, scope: str, found: int) -> Look:
        where = {"field": "dataclass", "param": "signature", "key": "dict literal"}
        what = where.get(self.kind, f"{self.callee}(...) call")
        why = f"{scope}: expected one {what} with the fork's `{self.fork}`, found {found}"
        return drift(why, clip_lines(src.segment(node)), (self.fork,), node.lineno)

    def rewrite(self, src: SourceFile, file: Codemod, node: Any) -> None:
        holder = self._holders(node)[0]
        if self.kind in ("field", "param"):
            added = f"{FIELD_COMMENT}\n{self.added}" if self.kind == "field" else self.added
            file.append_to(holder, added)
            return
        # The codemod edits the innermost statement that holds the call or dict literal: the
        # statements holding it form one chain, which ast.walk visits outermost first.
        holding = [s for s in ast.walk(node) if isinstance(s, ast.stmt) and holder in ast.walk(s)]
        file.append_to(holder, self.added, within=holding[-1])


def keyword(callee: str, added: str) -> Item:
    """k3patch's keyword argument `added` beside the fork's (forms.FORK_KEYWORDS) to `callee`."""
    return Item("keyword", forms.FORK_KEYWORDS[callee], added, callee)


def takes(name: str) -> Holds:
    """A site's precondition: its function has a positional parameter `name`."""
    return lambda src, fn: fn is not None and name in astkit.parameter_names(fn, positional=True)


@dataclass(frozen=True)
class Function(Part):
    """A module-level function k3patch appends to the module."""

    name: str
    source: str

    def look(self, src: SourceFile, node: ast.AST, scope: str) -> Look:
        fn = astkit.find_function(src.tree, self.name)
        if fn is None:
            return Look(PENDING)
        # A fingerprint, not a shape: the function's docstring is not part of what it does.
        if site_fingerprint(fn) == source_fingerprint(self.source):
            return Look(APPLIED, fn.lineno)
        why = f"{self.name} is not k3patch's function"
        return drift(why, clip_lines(src.segment(fn)), (dedent(self.source),), fn.lineno)

    def rewrite(self, src: SourceFile, file: Codemod, node: ast.AST) -> None:
        file.append_definition(self.source)


def _is_debug_block(imp: ast.stmt, gate: ast.stmt) -> bool:
    """`import os as X` + `if X.environ.get('K3_MAMBA_BC', '0') == '1': ...` that only logs:
    no else branch, and nothing bound that the offsets call or the cache store reads."""
    alias = imp.names[0] if isinstance(imp, ast.Import) and len(imp.names) == 1 else None
    if alias is None or alias.name != "os" or not alias.asname:
        return False
    if not isinstance(gate, ast.If) or gate.orelse:
        return False
    bound = astkit.stored_names([gate]) | astkit.imported_names(gate)
    read_later = {"offsets", "geometry_key", "_k3_local", "_k3_remote", "task", "request_info"}
    test = forms.DEBUG_TEST.format(alias=alias.asname)
    return match(test, gate.test) is not None and not bound & read_later


def _regions(fn: ast.FunctionDef) -> list[tuple[str, list[ast.stmt], bool]]:
    """Each known region: (its form "k3patch"/"fork"/"legacy", its statements, has K3_MAMBA_BC)."""
    found = []
    ours = {("k3patch", False): forms.K3PATCH_PLAN, ("per-layer", False): forms.PER_LAYER_PLAN}
    for (kind, debug), pattern in {**ours, **forms.PLANS}.items():
        for block, i, holes in search(pattern, fn):
            if not debug or _is_debug_block(holes["HOLE_debug_import"], holes["HOLE_debug_gate"]):
                found.append((kind, block[i : i + len(parse_pattern(pattern))], debug))
    return found


@dataclass(frozen=True)
class Plan(Part):
    """The per-layer choice of block ids and the offsets cache in the transfer plan."""

    evidence = True

    def look(self, src: SourceFile, node: ast.FunctionDef, scope: str) -> Look:
        found = _regions(node)
        if len(found) != 1:
            why = f"{scope}: the per-layer block-id choice is in no known shape"
            expected = (
                f"fork: {forms.PLANS['fork', True]}",
                f"older k3-group-routing fix: {forms.PLANS['legacy', True]}",
                f"k3patch: {dedent(forms.K3PATCH_PLAN)}",
            )
            why += f" ({len(found)} candidate regions)" if found else ""
            return drift(why, clip_lines(src.segment(node), 60), expected, node.lineno)
        kind, stmts, debug = found[0]
        goes = f"; {forms.DEBUG_GOES}" if debug else ""
        if kind in ("k3patch", "per-layer"):
            return Look(APPLIED, stmts[0].lineno, why=forms.PER_LAYER_NOTE * (kind == "per-layer"))
        if kind == "fork":
            return Look(PENDING, stmts[0].lineno, why=forms.FORK_DEFECT + goes)
        why = f"the older k3-group-routing fix: {forms.GEOMETRY_DEFECT}; {forms.LEGACY_CAVEATS}"
        why += f"; {forms.LEGACY_DEBUG_DEFECT}{goes}" if debug else ""
        return Look(PENDING, stmts[0].lineno, why=why, shape=forms.LEGACY_SHAPE)

    def rewrite(self, src: SourceFile, file: Codemod, node: ast.FunctionDef) -> None:
        file.replace(_regions(node)[0][1], forms.K3PATCH_PLAN)


@dataclass(frozen=True)
class LegacyGrowth(Part):
    """No opinion; a note on the older fix's capture (in `capture_in`) and its chunked growth."""

    capture_in: str

    def look(self, src: SourceFile, node: ast.FunctionDef, scope: str) -> Look:
        capture = astkit.find_def(src.tree, self.capture_in)
        if capture is None or not search(forms.LEGACY_CAPTURE, capture):
            return Look(None)
        if search(forms.CHUNKED_ALLGRP, node):
            why = "the older fix's chunked companion grows its all-group lists per chunk"
            return Look(None, why=why, shape=forms.LEGACY_CHUNKED_SHAPE)
        why = f"older k3-group-routing fix: {forms.FIRST_CHUNK_DEFECT}"
        return Look(None, why=why, shape=forms.LEGACY_SHAPE)


class Site:
    """One hop the block ids take (`what` it makes right): its parts look at one class (a field
    site) or method; `needs`: a precondition of k3patch's text (its words, a test)."""

    def __init__(
        self, name: str, what: str, *parts: Part, file: str, needs: tuple[str, Holds] | None = None
    ) -> None:
        self.name, self.file, self.what, self.parts, self.needs = name, file, what, parts, needs
        self.scope = name.split(" ")[0].removesuffix(f".{FIELD_NAME}")

    def node(self, src: SourceFile) -> ast.ClassDef | ast.FunctionDef | None:
        if "." in self.scope:
            return astkit.find_def(src.tree, self.scope)
        return astkit.find_class(src.tree, self.scope)

    def look(self, src: SourceFile) -> tuple[Look, bool]:
        """The site's verdict, shape and detail as one Look, and whether it is evidence."""
        node, scope = self.node(src), self.scope
        looks = [] if node is None else [(p, p.look(src, node, scope)) for p in self.parts]
        evidence = any(p.evidence and k.verdict in (PENDING, APPLIED) for p, k in looks)
        if self.needs and not self.needs[1](src, node):  # a better reason than any part's
            return drift(f"k3patch's text needs {self.needs[0]}", expected=self.needs[:1]), evidence
        if node is None:
            what = scope if "." in scope else f"class {scope}"
            return drift(f"{what} is absent", expected=(what,)), False
        verdict = combined_verdict(k.verdict for _, k in looks if k.verdict)
        line = next((look.line for _, look in looks if look.line), None)
        if verdict is DRIFTED:
            return next(look for _, look in looks if look.verdict is DRIFTED), evidence
        # An applied site's notes are its applied parts' (a note on the older fix is moot).
        notes = [k.why for _, k in looks if k.why and (verdict is PENDING or k.verdict is APPLIED)]
        why = "; ".join((self.what, *notes))
        if verdict is APPLIED:
            return Look(APPLIED, line, why=why, shape="k3patch"), evidence
        if verdict is PENDING:
            shape = next((look.shape for _, look in looks if look.shape), forms.FORK_SHAPE)
            return Look(PENDING, line, why=why, shape=shape), evidence
        why = "partly in k3patch's shape, partly in the fork's: edited by hand?"
        return drift(why, line=line), evidence

    def result(self, patch_id: str, src: SourceFile) -> tuple[SiteResult, bool]:
        look, evidence = self.look(src)
        verdict = look.verdict or DRIFTED  # a site's look always has one
        fields = (verdict, look.shape, look.why, look.line, look.found, look.expected)
        return SiteResult(patch_id, self.name, self.file, *fields), evidence

    def rewrite(self, src: SourceFile, file: Codemod) -> None:
        node = self.node(src)
        for part in self.parts:
            part.rewrite(src, file, node)


def combined_verdict(verdicts: Iterable[Verdict]) -> Verdict | None:
    """One verdict for a whole (a site's parts, a change's files): any drifted part makes it
    drifted, parts that all agree give theirs; None for a mixture (half done, perhaps by hand)
    and for no parts at all."""
    seen = set(verdicts)
    if Verdict.DRIFTED in seen:
        return Verdict.DRIFTED
    return seen.pop() if len(seen) == 1 else None


def clip_lines(text: str, limit: int = 40) -> str:
    """`text`, or (over `limit` lines) its first `limit` lines and how many more there are."""
    lines = text.splitlines()
    if len(lines) <= limit:
        return text
    return "\n".join([*lines[:limit], f"... ({len(lines) - limit} more lines)"])


def named_items(holder: ast.AST) -> dict[str, tuple[ast.AST, ast.expr | None]]:
    """name -> (the node naming the item, its value or None): a class's annotated fields, a
    function's positional parameters (their defaults), a call's keyword arguments (not `**x`),
    a dict literal's string keys; a name written twice is its last item; other nodes have none."""
    if isinstance(holder, ast.ClassDef):
        return {
            s.target.id: (s, s.value)
            for s in holder.body
            if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
        }
    if isinstance(holder, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
        params = [*holder.args.posonlyargs, *holder.args.args]
        defaults: list[ast.expr | None] = [None] * (len(params) - len(holder.args.defaults))
        pairs = zip(params, [*defaults, *holder.args.defaults], strict=True)
        return {p.arg: (p, d) for p, d in pairs}
    if isinstance(holder, ast.Call):
        return {k.arg: (k, k.value) for k in holder.keywords if k.arg}
    if isinstance(holder, ast.Dict):
        return {
            k.value: (k, v)
            for k, v in zip(holder.keys, holder.values, strict=True)
            if isinstance(k, ast.Constant) and isinstance(k.value, str)
        }
    return {}
