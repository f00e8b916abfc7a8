"""A site's known shapes and their fingerprints: the AST with positions, comments and docstrings
removed, so two pieces of code have the same fingerprint exactly when Python reads them as the
same statements; and a located site classified against a table of shapes."""

from __future__ import annotations

import ast
import copy
import hashlib
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache

from k3patch.shapes import Bindings, VersionRange, is_docstring, match, parse_pattern
from k3patch.sources import SourceFile
from k3patch.verdicts import SiteResult, Verdict


@dataclass(frozen=True)
class Shape:
    """One known shape of a site, declared as source: compared by fingerprint (formatting,
    comments, quotes and docstrings do not matter), or with `match` when it has holes
    (k3patch.shapes). `versions`: the vLLM versions it was seen in."""

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


def normalised_dump(node: ast.AST | list[ast.stmt]) -> str:
    """A formatting-insensitive text of a node (or a list of statements)."""
    if isinstance(node, list):
        node = ast.Module(body=node, type_ignores=[])
    node = copy.deepcopy(node)
    for child in ast.walk(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Module):
            if child.body and is_docstring(child.body[0]):
                child.body = child.body[1:] or [ast.Pass()]
    return ast.dump(node, annotate_fields=True, include_attributes=False)


def site_fingerprint(node: ast.AST | list[ast.stmt]) -> str:
    """The fingerprint of a site: 16 hex digits of sha256 over its normalised AST."""
    return hashlib.sha256(normalised_dump(node).encode()).hexdigest()[:16]


@cache
def source_fingerprint(source: str) -> str:
    """The fingerprint of a snippet (a definition or a run of statements); cached, as a declared
    shape's is asked for at every site it is held against."""
    body = parse_pattern(source)
    return site_fingerprint(body[0] if len(body) == 1 else list(body))


def dedent(source: str) -> str:
    """A snippet written indented in a triple-quoted string, as the text of a module."""
    return textwrap.dedent(source).strip("\n") + "\n"


def shape_detail(shape: Shape, source: SourceFile) -> str:
    """A matched shape's origin, and a note when the tree's vLLM is outside the versions the
    shape was seen in (the shape is still known; the tree is unusual)."""
    parts = [shape.origin]
    if shape.versions is not None and shape.versions.contains(source.version) is False:
        parts.append(f"a known shape, but seen in vLLM {shape.versions}, not {source.version}")
    return "; ".join(part for part in parts if part)


def match_shapes(
    patch_id: str, site: str, source: SourceFile, node: ast.AST, shapes: Iterable[Shape]
) -> SiteResult:
    """Classify a located node against a table of known shapes; anything else is drift."""
    shapes = tuple(shapes)
    found = site_fingerprint(node)
    line = getattr(node, "lineno", None)
    for shape in shapes:
        if shape.fingerprint == found:
            detail = shape_detail(shape, source)
            return SiteResult(patch_id, site, source.rel, shape.verdict, shape.name, detail, line)
    why = "the site is in no shape k3patch knows; nothing will be written"
    expected = (f"{s.name} ({s.verdict.value})" for s in shapes)
    return SiteResult.drift(patch_id, site, source.rel, why, line, source.segment(node), expected)
