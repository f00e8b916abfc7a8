"""Shapes with holes: a site's known forms declared as Python source, matched against the real
statements structurally (standard library only: classification must not import libcst).

A pattern is ordinary source with two wildcards. A *named hole* (`HOLE_message`) matches any
expression, or alone on a line any one statement; used twice, it must match equal code both
times, and `match` returns what each hole matched. An *elision* (a statement that is just `...`)
matches any run of statements, none included. Everything else must be the same syntax tree;
positions, comments, formatting and docstrings are ignored. And the vLLM versions a shape was
seen in, as a `VersionRange`.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from packaging.version import InvalidVersion, Version

from k3patch.astkit import blocks

HOLE_PREFIX = "HOLE_"
_IGNORED = frozenset({"ctx", "kind", "type_comment"})  # positions are attributes, not fields

Bindings = dict[str, Any]  # hole name -> the ast.expr (or ast.stmt) it matched


@cache
def parse_pattern(source: str) -> tuple[ast.stmt, ...]:
    """The statements of a pattern (parsed once per distinct source)."""
    return tuple(ast.parse(textwrap.dedent(source).strip("\n")).body)


def _hole(node: Any) -> str | None:
    return node.id if isinstance(node, ast.Name) and node.id.startswith(HOLE_PREFIX) else None


def _statement_hole(stmt: ast.stmt) -> str | None:
    return _hole(stmt.value) if isinstance(stmt, ast.Expr) else None


def _constant(stmt: ast.stmt) -> object:
    """The value of a statement that is one constant (`...`, a docstring); None otherwise."""
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
        return stmt.value.value
    return None


def _is_elision(stmt: ast.stmt) -> bool:
    return _constant(stmt) is Ellipsis


def is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(_constant(stmt), str)


def _dump(node: ast.AST) -> str:
    # A name read and the same name stored are the same code for a repeated hole.
    return re.sub(r", ctx=\w+\(\)", "", ast.dump(node, include_attributes=False))


def _bind(name: str, value: ast.AST, bindings: Bindings) -> bool:
    if name in bindings:
        return _dump(bindings[name]) == _dump(value)
    bindings[name] = value
    return True


def _match_node(pattern: Any, target: Any, bindings: Bindings) -> bool:
    hole = _hole(pattern)
    if hole is not None:
        return isinstance(target, ast.expr) and _bind(hole, target, bindings)
    if isinstance(pattern, list):
        if not isinstance(target, list):
            return False
        if pattern and all(isinstance(p, ast.stmt) for p in pattern):
            return _match_body(pattern, target, bindings)
        return len(pattern) == len(target) and all(
            _match_node(p, t, bindings) for p, t in zip(pattern, target, strict=True)
        )
    if isinstance(pattern, ast.AST):
        return type(pattern) is type(target) and all(
            _match_node(getattr(pattern, f, None), getattr(target, f, None), bindings)
            for f in pattern._fields
            if f not in _IGNORED
        )
    return bool(pattern == target) and type(pattern) is type(target)


def _match_body(
    pattern: Sequence[ast.stmt], target: Sequence[ast.stmt], bindings: Bindings
) -> bool:
    """Statement lists: elisions match any run, statement holes one statement; docstrings of
    the target are skipped where the pattern has none."""
    target = list(target)
    if target and is_docstring(target[0]) and not (pattern and is_docstring(pattern[0])):
        target = target[1:]

    def go(i: int, j: int, bound: Bindings) -> Bindings | None:
        if i == len(pattern):
            return bound if j == len(target) else None
        head = pattern[i]
        if _is_elision(head):
            for k in range(j, len(target) + 1):
                found = go(i + 1, k, dict(bound))
                if found is not None:
                    return found
            return None
        if j == len(target):
            return None
        trial = dict(bound)
        hole = _statement_hole(head)
        ok = _bind(hole, target[j], trial) if hole else _match_node(head, target[j], trial)
        return go(i + 1, j + 1, trial) if ok else None

    result = go(0, 0, dict(bindings))  # what `bindings` held, and more
    bindings.update(result or {})
    return result is not None


def match(pattern: str, target: ast.AST | Sequence[ast.stmt]) -> Bindings | None:
    """What each hole of `pattern` matched in `target` (statements, or one node), or None
    when `target` is not in that shape."""
    stmts = parse_pattern(pattern)
    bindings: Bindings = {}
    if isinstance(target, ast.AST) and not isinstance(target, ast.Module):
        if len(stmts) == 1 and isinstance(stmts[0], ast.Expr) and isinstance(target, ast.expr):
            return bindings if _match_node(stmts[0].value, target, bindings) else None
        target = [target] if isinstance(target, ast.stmt) else []
    elif isinstance(target, ast.Module):
        target = target.body
    return bindings if _match_body(list(stmts), list(target), bindings) else None


def matches_each(patterns: Sequence[str], targets: Sequence[ast.AST | None]) -> bool:
    """Whether every pattern matches the target at its position (a None target matches none);
    no patterns constrain nothing, whatever the targets. Otherwise both have one length."""
    return not patterns or all(
        t is not None and match(p, t) is not None for p, t in zip(patterns, targets, strict=True)
    )


def search(pattern: str, node: ast.AST) -> list[tuple[list[ast.stmt], int, Bindings]]:
    """Every run of consecutive statements in a block under `node` (`astkit.blocks`) that
    `pattern` matches, as (block, index of the run's first statement, bindings). The run is as
    long as the pattern (which therefore has no elision at its top level)."""
    stmts = parse_pattern(pattern)
    if any(_is_elision(s) for s in stmts):
        raise ValueError("search: an elision at the top level of a pattern has no length")
    n = len(stmts)
    # A run can only start where the pattern's first statement has the same kind (a statement
    # hole excepted): a cheap test that spares most full matches.
    kind = None if _statement_hole(stmts[0]) else type(stmts[0])
    hits = []
    for block in blocks(node):
        for i in range(len(block) - n + 1):
            if kind is not None and type(block[i]) is not kind:
                continue
            bindings: Bindings = {}
            if _match_body(stmts, block[i : i + n], bindings):
                hits.append((block, i, bindings))
    return hits


def find_expressions(pattern: str, node: ast.AST) -> Iterator[ast.expr]:
    """Every expression under `node` (itself included), in ast.walk order, that `pattern` (one
    expression, holes allowed) matches. Lazily, so `any(...)` stops at the first; the pattern is
    checked at the call."""
    stmts = parse_pattern(pattern)
    if len(stmts) != 1 or not isinstance(stmts[0], ast.Expr):
        raise ValueError(f"find_expressions: {pattern!r} is not one expression")
    kind = ast.expr if _hole(stmts[0].value) else type(stmts[0].value)
    return (n for n in ast.walk(node) if isinstance(n, kind) and match(pattern, n) is not None)


# Version ranges


def version_key(version: str) -> tuple[int, int, int] | None:
    """(major, minor, micro) of a vLLM version string as PEP 440 reads it ("0.28.0",
    "0.29.0+k3fork", "0.28.1.dev3", "0.31.0rc1": a build, dev or pre-release of a release is that
    release's code); None when it is not a version."""
    try:
        release = Version(version.strip()).release
    except InvalidVersion:
        return None
    major, minor, micro = (*release, 0, 0)[:3]
    return major, minor, micro


@dataclass(frozen=True)
class VersionRange:
    """The vLLM versions a shape was seen in (inclusive; None: open)."""

    first: str | None = None
    last: str | None = None

    def contains(self, version: str | None) -> bool | None:
        """None when the version cannot be read."""
        key = version_key(version) if version else None
        if key is None:
            return None
        low = version_key(self.first) if self.first else None
        high = version_key(self.last) if self.last else None
        return (low is None or key >= low) and (high is None or key <= high)

    def __str__(self) -> str:
        if self.first and self.last:
            return self.first if self.first == self.last else f"{self.first}-{self.last}"
        if self.first:
            return f"{self.first} and later"
        return f"up to {self.last}" if self.last else "any version"


def holes(bindings: Mapping[str, Any]) -> dict[str, str]:
    """The bindings as source text (for reports and tests)."""
    return {name: ast.unparse(node) for name, node in bindings.items()}
