"""Declared sites for a patch whose change spans several classes and functions: a Site is one
class or function of one file, found by its dotted scope; each of its Parts sees one piece of it
in the pre-image's form (pending), k3patch's (applied), has no opinion (None), each a Look, or
neither (drifted: a SiteResult.drift), and rewrites that piece into the file's codemod. A Site
combines its parts' answers into one SiteResult."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from k3patch import astkit
from k3patch.fingerprints import dedent, site_fingerprint, source_fingerprint
from k3patch.shapes import match, matches_each, parse_pattern, search
from k3patch.sources import SourceFile
from k3patch.verdicts import SiteResult, Verdict

if TYPE_CHECKING:
    from k3patch.codemod import Codemod

PENDING, APPLIED = Verdict.PENDING, Verdict.APPLIED
Holds = Callable[[SourceFile, Any], bool]  # (the file, the site's function or None)


@dataclass(frozen=True)
class Look:
    """A part's answer short of drift (which is a SiteResult.drift)."""

    verdict: Verdict | None  # PENDING, APPLIED, or None: no opinion
    line: int | None = None
    why: str = ""  # what is wrong with a pending form beyond the patch's bug, or a note
    shape: str = ""  # the form seen, when it is not the site's pending shape


class Part:
    evidence = False  # anchored on the pre-image's own statements: either form makes it this tree

    def look(self, src: SourceFile, node: Any, site: Site) -> Look | SiteResult:
        """`node`: the site's class (a field site) or function; `site.scope` names it in reports."""
        raise NotImplementedError

    def rewrite(self, src: SourceFile, file: Codemod, node: Any) -> None:
        """Make this part k3patch's in `file`, the codemod of `src` (a note changes nothing)."""


@dataclass(frozen=True)
class Insert(Part):
    """Statements k3patch adds after the one statement `anchor` (patterns) picks out, else before
    the final `return`; with `pre` (the pre-image's exact assignment), any assignment to its
    target."""

    added: str
    marker: str  # a name of k3patch's text: used elsewhere in the function, it is drift
    anchor: tuple[str, ...] = ()
    pre: str | None = None
    evidence: bool = True  # False where the anchor is upstream's own statement

    @property
    def anchors(self) -> tuple[str, ...]:
        return self.anchor if self.pre is None else (self.pre.split(" = ")[0] + " = HOLE_value",)

    def _find(self, fn: ast.FunctionDef) -> list[tuple[list[ast.stmt], int]]:
        if not self.anchors:
            return [(fn.body, len(fn.body) - 1)]
        return [(block, i) for pattern in self.anchors for block, i, _ in search(pattern, fn)]

    def look(self, src: SourceFile, node: ast.FunctionDef, site: Site) -> Look | SiteResult:
        hits, scope, drift = self._find(node), site.scope, partial(SiteResult.drift, *site.key)
        describe = f"`{self.anchors[-1].replace('HOLE_value', '...')}`" if self.anchors else ""
        if self.anchors and len(hits) != 1:
            why = f"{scope}: expected one {describe}, found {len(hits)}"
            return drift(why, node.lineno, clip_lines(src.segment(node)), (describe,))
        body, i = hits[0]
        at = body[i]
        if not self.anchors and not isinstance(at, ast.Return):
            return drift(f"{scope} does not end in a return", at.lineno, src.segment(at))
        if self.pre is not None and match(self.pre, at) is None:
            why = f"{scope}: {describe} is not in the pre-image's shape"
            return drift(why, at.lineno, src.segment(at), (self.pre,))
        count = len(parse_pattern(self.added))
        # A script that runs again at each container start may insert its own lines after the
        # anchor once more, pushing k3patch's statements down the block: they still count.
        starts = range(i + 1, len(body) - count + 1) if self.anchors else [i - count]
        for j in starts:
            if j >= 0 and match(self.added, body[j : j + count]) is not None:
                return Look(APPLIED, body[j].lineno)
        if self.marker in src.text and self.marker in astkit.mentioned_names(node, everything=True):
            why = f"{scope}: `{self.marker}` is used, but not in k3patch's shape"
            return drift(why, node.lineno, clip_lines(src.segment(node)), (dedent(self.added),))
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
    """One item k3patch appends in the one holder with the pre-image's item `pre`: a dataclass
    "field" (under `comment`), a "param", a "keyword" argument to `callee` or a dict literal's
    "key", each written as the code has it; a `pre` without a value only has to be there."""

    kind: str
    pre: str
    added: str
    callee: str = ""
    comment: str = ""
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
        kind, name = ast.Call if self.kind == "keyword" else ast.Dict, self._parse(self.pre)[0]
        found = [n for n in ast.walk(node) if isinstance(n, kind) and name in named_items(n)]
        return [n for n in found if isinstance(n, ast.Dict) or astkit.callee_name(n) == self.callee]

    def look(self, src: SourceFile, node: Any, site: Site) -> Look | SiteResult:
        scope, drift = site.scope, partial(SiteResult.drift, *site.key)
        if self.kind == "param" and (node.args.vararg or node.args.kwarg or node.args.kwonlyargs):
            why = f"{scope}: unexpected *args/**kwargs/keyword-only parameters"
            return drift(why, node.lineno, src.segment(node.args))
        holders = self._holders(node)
        if len(holders) != 1:
            return self._missing(src, node, site, len(holders))
        items = self._items(holders[0])
        pre, pre_parts = self._parse(self.pre)
        name, parts = self._parse(self.added)
        # The pre-image's keyword picks the call, so it must be as written whatever else is there.
        if self.kind == "keyword" and not matches_each(pre_parts, items[pre][2]):
            why = f"{scope}: {pre}= is not passed in the pre-image's shape"
            return drift(why, holders[0].lineno, src.segment(holders[0]))
        if name in items:
            mine, line, mine_parts = items[name]
            if matches_each(parts, mine_parts):
                return Look(APPLIED, line)
            why = f"{scope}: {self.kind} {name} is not k3patch's"
            return drift(why, line, src.segment(mine), (self.added,))
        if pre not in items or not matches_each(pre_parts, items[pre][2]):
            return self._missing(src, node, site, 0)
        return Look(PENDING, items[pre][1])

    def _missing(self, src: SourceFile, node: Any, site: Site, found: int) -> SiteResult:
        where = {"field": "dataclass", "param": "signature", "key": "dict literal"}
        what = where.get(self.kind, f"{self.callee}(...) call")
        why = f"{site.scope}: expected one {what} with the pre-image's `{self.pre}`, found {found}"
        found_text = clip_lines(src.segment(node))
        return SiteResult.drift(*site.key, why, node.lineno, found_text, (self.pre,))

    def rewrite(self, src: SourceFile, file: Codemod, node: Any) -> None:
        holder = self._holders(node)[0]
        if self.kind in ("field", "param"):
            file.append_to(holder, f"{self.comment}\n{self.added}" if self.comment else self.added)
            return
        # The codemod edits the innermost statement that holds the call or dict literal: the
        # statements holding it form one chain, which ast.walk visits outermost first.
        holding = [s for s in ast.walk(node) if isinstance(s, ast.stmt) and holder in ast.walk(s)]
        file.append_to(holder, self.added, within=holding[-1])


def takes(name: str) -> Holds:
    """A site's precondition: its function has a positional parameter `name`."""
    return lambda src, fn: fn is not None and name in astkit.parameter_names(fn, positional=True)


@dataclass(frozen=True)
class Function(Part):
    """A module-level function k3patch appends to the module."""

    name: str
    source: str

    def look(self, src: SourceFile, node: ast.AST, site: Site) -> Look | SiteResult:
        fn = astkit.find_function(src.tree, self.name)
        if fn is None:
            return Look(PENDING)
        # A fingerprint, not a shape: the function's docstring is not part of what it does.
        if site_fingerprint(fn) == source_fingerprint(self.source):
            return Look(APPLIED, fn.lineno)
        why = f"{self.name} is not k3patch's function"
        found = clip_lines(src.segment(fn))
        return SiteResult.drift(*site.key, why, fn.lineno, found, (dedent(self.source),))

    def rewrite(self, src: SourceFile, file: Codemod, node: ast.AST) -> None:
        file.append_definition(self.source)


class Site:
    """One class or function of `file` (`scope`, a dotted path; default: the name's first word),
    a site of patch `patch`, and what its change makes right (`what`): its parts look at it;
    `needs`: a precondition of k3patch's text (its words, a test); `shape`: the name of its
    pending form."""

    def __init__(
        self,
        name: str,
        what: str,
        *parts: Part,
        patch: str,
        file: str,
        needs: tuple[str, Holds] | None = None,
        scope: str = "",
        shape: str = "",
    ) -> None:
        self.name, self.file, self.what, self.parts, self.needs = name, file, what, parts, needs
        self.scope, self.shape = scope or name.split(" ")[0], shape
        self.key = (patch, name, file)  # a SiteResult's first fields

    def node(self, src: SourceFile) -> ast.ClassDef | ast.FunctionDef | None:
        if "." in self.scope:
            return astkit.find_def(src.tree, self.scope)
        return astkit.find_class(src.tree, self.scope)

    def result(self, src: SourceFile) -> tuple[SiteResult, bool]:
        """The site's verdict, shape and detail, and whether it is evidence."""
        node, scope = self.node(src), self.scope
        looks = [] if node is None else [(p, p.look(src, node, self)) for p in self.parts]
        evidence = any(p.evidence and k.verdict in (PENDING, APPLIED) for p, k in looks)
        if self.needs and not self.needs[1](src, node):  # a better reason than any part's
            why = f"k3patch's text needs {self.needs[0]}"
            return SiteResult.drift(*self.key, why, expected=self.needs[:1]), evidence
        if node is None:
            what = scope if "." in scope else f"class {scope}"
            return SiteResult.drift(*self.key, f"{what} is absent", expected=(what,)), False
        seen = [k for _, k in looks if isinstance(k, Look)]
        if len(seen) < len(looks):  # the first drifted part's answer
            return next(k for _, k in looks if isinstance(k, SiteResult)), evidence
        verdict = combined_verdict(k.verdict for k in seen if k.verdict)
        line = next((look.line for look in seen if look.line), None)
        # An applied site's notes are its applied parts' (a note on a pending form is moot).
        notes = [k.why for k in seen if k.why and (verdict is PENDING or k.verdict is APPLIED)]
        why = "; ".join((self.what, *notes))
        if verdict is APPLIED:
            return SiteResult(*self.key, APPLIED, "k3patch", why, line), evidence
        if verdict is PENDING:
            shape = next((look.shape for look in seen if look.shape), self.shape)
            return SiteResult(*self.key, PENDING, shape, why, line), evidence
        why = "partly in k3patch's shape, partly in the pre-image's: edited by hand?"
        return SiteResult.drift(*self.key, why, line), evidence

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
