"""The one way a patch changes a file: `Edit`s over one line model, applied in one pass.

Lines are counted exactly as Python's tokenizer (and so `ast`) counts them: only `\\n`, `\\r\\n`
and `\\r` end a line. A form feed, `\\x1c`-`\\x1e`, `\\x85`, `\\u2028` or `\\u2029` inside a
string or a comment is an ordinary character here, as it is to Python (`str.splitlines` would
cut the line there and every later position would be off). `ast` columns count UTF-8 bytes;
`SourceText.offset` turns them into string offsets. Inserted blocks use the file's own newline
(a CRLF file stays CRLF) and the indentation of the statement they sit beside (tabs stay tabs).

Every patch builds a list of `Edit`s from these helpers and the engine's caller applies them with
`apply_edits`, which refuses overlapping edits in one place. Standard library only: rewrites run
in the engine, classification never needs this module, but it must stay importable anywhere.
"""

from __future__ import annotations

import ast
import itertools
import re
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_LINE_END = re.compile(r"\r\n|\r|\n")

# The nodes whose positions an edit is computed from (a statement, an expression, a keyword
# argument, a parameter). ast.AST itself carries no position.
Located = ast.stmt | ast.expr | ast.keyword | ast.arg


class EditError(ValueError):
    """An edit cannot be made safely (a statement shares its line, edits overlap, ...)."""


@dataclass(frozen=True)
class Edit:
    """Replace text[start:end] (string offsets) by `text`; an insertion has start == end."""

    start: int
    end: int
    text: str


class SourceText:
    """A file's text with the tokenizer's line starts, newline style and offsets."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.starts = [0] + [m.end() for m in _LINE_END.finditer(text)]
        first = _LINE_END.search(text)
        self.newline = first.group() if first else "\n"

    def line(self, lineno: int) -> str:
        """Line `lineno` (1-based) with its line ending."""
        return self.text[self.starts[lineno - 1] : self.after_line(lineno)]

    def after_line(self, lineno: int) -> int:
        """The offset just past line `lineno` and its ending."""
        return self.starts[lineno] if lineno < len(self.starts) else len(self.text)

    def offset(self, lineno: int, col: int) -> int:
        """The string offset of an ast position (`col` counts UTF-8 bytes)."""
        line = self.line(lineno)
        return self.starts[lineno - 1] + len(line.encode("utf-8")[:col].decode("utf-8"))

    def indent_of(self, node: Located) -> str:
        """The whitespace before `node` on its first line; the node must start that line."""
        line = self.line(node.lineno)
        prefix = line[: len(line.encode("utf-8")[: node.col_offset].decode("utf-8"))]
        if prefix.strip(" \t\f"):
            raise EditError(f"line {node.lineno}: the statement does not start its line")
        return prefix

    def ends_line(self, node: Located) -> bool:
        """Whether nothing but a comment follows `node` on its last line."""
        assert node.end_lineno is not None and node.end_col_offset is not None
        rest = self.text[
            self.offset(node.end_lineno, node.end_col_offset) : self.after_line(node.end_lineno)
        ]
        rest = rest.strip(" \t\f\r\n")
        return not rest or rest.startswith("#")

    def segment(self, node: Located) -> str:
        """The exact source text of a node."""
        assert node.end_lineno is not None and node.end_col_offset is not None
        return self.text[
            self.offset(node.lineno, node.col_offset) : self.offset(
                node.end_lineno, node.end_col_offset
            )
        ]

    def block(self, source: str, indent: str) -> str:
        """`source` (any indentation, `\\n` lines) re-indented under `indent`, in this file's
        newline style; blank lines stay empty."""
        lines = textwrap.dedent(source.strip("\n")).split("\n")
        nl = self.newline
        return "".join(f"{indent}{ln}{nl}" if ln.strip() else nl for ln in lines)

    def indent_unit(self, parent: ast.stmt) -> str:
        """One level of this file's indentation, read off `parent`'s first body statement
        (a tab in a tab-indented file); four spaces when it cannot be told."""
        body = getattr(parent, "body", None)
        if body:
            inner, outer = self.indent_of(body[0]), self.indent_of(parent)
            if inner.startswith(outer) and len(inner) > len(outer):
                return inner[len(outer) :]
        return "\t" if self.indent_of(parent).startswith("\t") else "    "


def _last_line_of(src: SourceText, stmt: ast.stmt) -> int:
    if not src.ends_line(stmt):
        raise EditError(f"line {stmt.end_lineno}: another statement follows on the same line")
    assert stmt.end_lineno is not None
    return stmt.end_lineno


def insert_after(src: SourceText, stmt: ast.stmt, source: str) -> Edit:
    """Insert `source` as statements right after `stmt`, at its indentation."""
    at = src.after_line(_last_line_of(src, stmt))
    block = src.block(source, src.indent_of(stmt))
    if at == len(src.text) and not src.text.endswith(("\n", "\r")):
        block = src.newline + block
    return Edit(at, at, block)


def insert_before(src: SourceText, stmt: ast.stmt, source: str) -> Edit:
    """Insert `source` as statements right before `stmt` (decorators included), at its
    indentation."""
    first = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", []))])
    at = src.starts[first - 1]
    return Edit(at, at, src.block(source, src.indent_of(stmt)))


def replace(src: SourceText, stmts: Sequence[ast.stmt], source: str) -> Edit:
    """Replace the consecutive statements `stmts` (whole lines) by `source`."""
    first = min([stmts[0].lineno, *(d.lineno for d in getattr(stmts[0], "decorator_list", []))])
    start = src.starts[first - 1]
    end = src.after_line(_last_line_of(src, stmts[-1]))
    return Edit(start, end, src.block(source, src.indent_of(stmts[0])))


def nest_under(src: SourceText, stmts: Sequence[ast.stmt], header: str) -> Edit:
    """Put the consecutive statements `stmts` under `header` (e.g. `if cond:`), one level
    deeper (a tab in a tab-indented file, else four spaces); each of their lines is kept byte
    for byte after the added indentation, continuation lines and strings included."""
    indent = src.indent_of(stmts[0])
    unit = "\t" if "\t" in indent else "    "
    start = src.starts[stmts[0].lineno - 1]
    end = src.after_line(_last_line_of(src, stmts[-1]))
    lines = _split_keep(src.text[start:end])
    deeper = "".join(unit + ln if ln.strip(" \t\f\r\n") else ln for ln in lines)
    return Edit(start, end, f"{indent}{header.strip()}{src.newline}{deeper}")


def _split_keep(text: str) -> list[str]:
    """`text` cut after each line ending, as the tokenizer counts them."""
    out, at = [], 0
    for m in _LINE_END.finditer(text):
        out.append(text[at : m.end()])
        at = m.end()
    if at < len(text):
        out.append(text[at:])
    return out


def append_item(src: SourceText, opener: Located, first: Located, last: Located, item: str) -> Edit:
    """Add `item` after the final argument / parameter / dict entry of `opener`, whose items
    begin at `first` and end at `last`. One item per line stays one item per line."""
    assert last.end_lineno is not None and last.end_col_offset is not None
    at = src.offset(last.end_lineno, last.end_col_offset)
    line = src.line(first.lineno)
    before = line[: len(line.encode("utf-8")[: first.col_offset].decode("utf-8"))]
    if first.lineno > opener.lineno and not before.strip(" \t\f"):
        return Edit(at, at, f",{src.newline}{before}{item}")
    return Edit(at, at, f", {item}")


def binds(module: ast.Module, name: str) -> bool:
    """Whether the module binds `name` at top level (import, def, class or assignment)."""
    for stmt in module.body:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            if any((a.asname or a.name.split(".")[0]) == name for a in stmt.names):
                return True
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if stmt.name == name:
                return True
        elif isinstance(stmt, ast.Assign | ast.AnnAssign):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
                return True
    return False


def ensure_import(src: SourceText, module: ast.Module, name: str) -> Edit | None:
    """`import name` after the module's last top-level import (or its docstring, or at the
    top), unless the module already binds `name`. None when nothing is needed."""
    if binds(module, name):
        return None
    imports = [s for s in module.body if isinstance(s, ast.Import | ast.ImportFrom)]
    if imports:
        return insert_after(src, imports[-1], f"import {name}")
    body = module.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        return insert_after(src, body[0], f"import {name}")
    return Edit(0, 0, f"import {name}{src.newline}")


def apply_edits(text: str, edits: Iterable[Edit]) -> str:
    """All edits in one reverse pass. Two edits that overlap (or two insertions at one offset,
    whose order would be a guess) are refused: EditError, nothing applied."""
    ordered = sorted(edits, key=lambda e: (e.start, e.end))
    for earlier, later in itertools.pairwise(ordered):
        overlap = later.start < earlier.end
        same_point = later.start == earlier.start == later.end
        if overlap or same_point:
            raise EditError(
                f"overlapping edits at offsets {earlier.start}-{earlier.end} and "
                f"{later.start}-{later.end}"
            )
    for edit in reversed(ordered):
        text = text[: edit.start] + edit.text + text[edit.end :]
    return text
