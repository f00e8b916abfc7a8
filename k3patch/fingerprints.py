"""A site's known shapes and their fingerprints: the AST with positions, comments and docstrings
removed, so two pieces of code have the same fingerprint exactly when Python reads them as the
same statements; and a located site classified against a table of shapes."""

from __future__ import annotations

import ast
import functools
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from k3patch.shapes import Bindings, VersionRange, match, outside_range
from k3patch.sources import SourceFile
from k3patch.verdicts import SiteResult, Verdict


@dataclass(frozen=True)
class Shape:
    """One known shape of a site: the code as it appears in some tree, declared as source text.

    `source` is compared by `site_fingerprint`, so formatting, comments, quote style and
    docstrings do not matter; names, operators and structure do. A source with holes
    (`HOLE_x`, `...`; see k3patch.shapes) is compared with `match` instead. `versions` are the
    vLLM versions the shape was seen in, as data (`shapes.outside_range` words a report).
    """

    name: str
    verdict: Verdict
    source: str
    origin: str = ""
    versions: VersionRange | None = None

    @property
    def fingerprint(self) -> str:
        return source_fingerprint(self.source)

    def match(self, target: ast.AST | Sequence[ast.stmt]) -> Bindings | None:
        """What each hole of this shape matched in `target`; None when `target` is not in it."""
        return match(self.source, target)


def _strip_docstrings(node: ast.AST) -> ast.AST:
    for child in ast.walk(node):
        body = getattr(child, "body", None)
        if (
            isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module)
            and isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            child.body = body[1:] or [ast.Pass()]
    return node


def normalised_dump(node: ast.AST | list[ast.stmt]) -> str:
    """A formatting-insensitive text of a node (or a list of statements)."""
    import copy

    if isinstance(node, list):
        node = ast.Module(body=node, type_ignores=[])
    node = _strip_docstrings(copy.deepcopy(node))
    return ast.dump(node, annotate_fields=True, include_attributes=False)


def site_fingerprint(node: ast.AST | list[ast.stmt]) -> str:
    """The fingerprint of a site: 16 hex digits of sha256 over its normalised AST."""
    return hashlib.sha256(normalised_dump(node).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=512)
def source_fingerprint(source: str) -> str:
    """The fingerprint of a code snippet (a whole definition or a run of statements). Cached:
    a declared shape's fingerprint is asked for at every site it is held against."""
    module = ast.parse(dedent(source))
    body: list[ast.stmt] = module.body
    return site_fingerprint(body[0] if len(body) == 1 else body)


def dedent(source: str) -> str:
    """A snippet written indented in a triple-quoted string, as the text of a module."""
    import textwrap

    return textwrap.dedent(source).strip("\n") + "\n"


def shape_detail(shape: Shape, source: SourceFile) -> str:
    """A matched shape's detail for a report: its origin, and a note when the tree's vLLM is
    outside the versions the shape was seen in (the shape is still known; the tree is unusual)."""
    note = outside_range(shape.versions, source.version)
    return "; ".join(part for part in (shape.origin, note) if part)


def match_shapes(
    patch_id: str,
    site: str,
    source: SourceFile,
    node: ast.AST,
    shapes: Iterable[Shape],
) -> SiteResult:
    """Classify a located node against a table of known shapes; anything else is drift."""
    shapes = tuple(shapes)
    found = site_fingerprint(node)
    for shape in shapes:
        if shape.fingerprint == found:
            return SiteResult(
                patch_id=patch_id,
                site=site,
                file=source.rel,
                verdict=shape.verdict,
                shape=shape.name,
                detail=shape_detail(shape, source),
                line=getattr(node, "lineno", None),
            )
    return SiteResult(
        patch_id=patch_id,
        site=site,
        file=source.rel,
        verdict=Verdict.DRIFTED,
        detail="the site is in no shape k3patch knows; nothing will be written",
        line=getattr(node, "lineno", None),
        found=source.segment(node),
        expected=tuple(f"{s.name} ({s.verdict.value})" for s in shapes),
    )
