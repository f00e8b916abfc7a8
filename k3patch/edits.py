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
import io
import itertools
import re
import sys
import textwrap
import tokenize
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from k3patch.model import dedent, module_binds
from k3patch.shapes import is_docstring

_LINE_END = re.compile(r"\r\n|\r|\n")
# The rest of an item's line when a trailing comma (and perhaps a comment) ends it.
_COMMA_ENDS_LINE = re.compile(r"[ \t\f]*,[ \t\f]*(?:#[^\r\n]*)?(?:\r\n|\r|\n)")

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


def header_end(src: SourceText, stmt: ast.If | ast.While | ast.For | ast.With) -> int:
    """The offset just past the `:` that ends a compound statement's header (after any closing
    parentheses, line breaks and comments that follow its last header expression)."""
    if isinstance(stmt, ast.With):
        item = stmt.items[-1]
        last: ast.expr = item.optional_vars or item.context_expr
    else:
        last = stmt.iter if isinstance(stmt, ast.For) else stmt.test
    assert last.end_lineno is not None and last.end_col_offset is not None
    at, text = src.offset(last.end_lineno, last.end_col_offset), src.text
    while at < len(text) and text[at] != ":":
        if text[at] == "#":
            found = _LINE_END.search(text, at)
            at = found.start() if found else len(text)
        elif text[at] in " \t\f\r\n\\)":
            at += 1
        else:
            break
    if at >= len(text) or text[at] != ":":
        raise EditError(f"line {stmt.lineno}: no `:` ends the header")
    return at + 1


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
    deeper (the step the first statement's own body uses, else a tab in a tab-indented file,
    else four spaces); each of their lines is kept byte for byte after the added indentation.
    A line that begins inside a multi-line string is string content, not indentation: it is
    left exactly as it was, so the string's value does not change."""
    indent = src.indent_of(stmts[0])
    try:
        unit = src.indent_unit(stmts[0])
    except EditError:  # a one-line body (`if x: y`) tells no step
        unit = "\t" if "\t" in indent else "    "
    start = src.starts[stmts[0].lineno - 1]
    end = src.after_line(_last_line_of(src, stmts[-1]))
    lines = _split_keep(src.text[start:end])
    in_string = _rows_inside_strings(src.text[start:end])
    deeper = "".join(
        unit + ln if ln.strip(" \t\f\r\n") and row not in in_string else ln
        for row, ln in enumerate(lines)
    )
    return Edit(start, end, f"{indent}{header.strip()}{src.newline}{deeper}")


def _rows_inside_strings(segment: str) -> set[int]:
    """0-based rows of `segment` (whole statements) that begin inside a string token."""
    # newline=None: the reader ends lines where the tokenizer does (\n, \r\n, \r), no others.
    readline = io.StringIO(segment, newline=None).readline
    try:
        return {
            row - 1
            for token in tokenize.generate_tokens(readline)
            if token.type != tokenize.NEWLINE and token.type != tokenize.NL
            for row in range(token.start[0] + 1, token.end[0] + 1)
        }
    except (tokenize.TokenError, SyntaxError) as exc:
        raise EditError(f"the statements do not tokenize on their own: {exc}") from None


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
    begin at `first` and end at `last`. One item per line stays one item per line; after a
    trailing comma the new item gets the next line, so a comment after that comma (a marker
    an older script's re-run looks for) stays with the item it was written for."""
    assert last.end_lineno is not None and last.end_col_offset is not None
    at = src.offset(last.end_lineno, last.end_col_offset)
    line = src.line(first.lineno)
    before = line[: len(line.encode("utf-8")[: first.col_offset].decode("utf-8"))]
    if first.lineno > opener.lineno and not before.strip(" \t\f"):
        below = src.after_line(last.end_lineno)
        if _COMMA_ENDS_LINE.fullmatch(src.text[at:below]):
            return Edit(below, below, f"{before}{item},{src.newline}")
        return Edit(at, at, f",{src.newline}{before}{item}")
    return Edit(at, at, f", {item}")


def append_to(
    src: SourceText, holder: ast.ClassDef | ast.FunctionDef | ast.Call | ast.Dict, item: str
) -> Edit:
    """`item` after the last of a class's annotated fields (as statements, `insert_after`), of
    a function's positional parameters (its default included), of a call's arguments or of a
    dict literal's entries (`append_item`); the holder has one."""
    if isinstance(holder, ast.ClassDef):
        fields = [s for s in holder.body if isinstance(s, ast.AnnAssign)]
        return insert_after(src, fields[-1], item)
    if isinstance(holder, ast.Call):
        items: list[Located] = [*holder.args, *holder.keywords]
        first = last = max(items, key=lambda n: (n.end_lineno or 0, n.end_col_offset or 0))
    elif isinstance(holder, ast.Dict):
        first, last = holder.keys[-1] or holder.values[-1], holder.values[-1]  # None: `**x`
    else:
        first = [*holder.args.posonlyargs, *holder.args.args][-1]
        last = holder.args.defaults[-1] if holder.args.defaults and holder.args.args else first
    return append_item(src, holder, first, last, item)


def append_definition(src: SourceText, source: str) -> Edit:
    """`source` (a top-level def or class, any indentation) at the end of the file after two
    blank lines (a missing final newline added first), in the file's newline style."""
    end, nl = len(src.text), src.newline
    lead = nl * 2 if src.text.endswith(("\n", "\r")) else nl * 3
    return Edit(end, end, lead + dedent(source).replace("\n", nl))


def _is_stdlib_import(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Import) and all(
        a.name.split(".")[0] in sys.stdlib_module_names for a in stmt.names
    )


def ensure_import(src: SourceText, module: ast.Module, name: str) -> Edit | None:
    """`import name` unless the module already binds `name` (None: nothing to do).

    A standard-library module goes where isort puts it: first in the import block, right
    after the docstring and `from __future__` imports, with a blank line before the next
    statement unless that is a standard-library import too. Any other module goes after the
    module's last top-level import (or its docstring, or at the top)."""
    if module_binds(module, name):
        return None
    body = module.body
    if name.split(".")[0] in sys.stdlib_module_names:
        head = 1 if body and is_docstring(body[0]) else 0
        while (
            head < len(body)
            and isinstance(body[head], ast.ImportFrom)
            and body[head].module == "__future__"  # type: ignore[attr-defined]
        ):
            head += 1
        if head == len(body):
            return _append(src, f"import {name}")
        edit = insert_before(src, body[head], f"import {name}")
        gap = "" if _is_stdlib_import(body[head]) else src.newline
        return Edit(edit.start, edit.end, edit.text + gap)
    imports = [s for s in module.body if isinstance(s, ast.Import | ast.ImportFrom)]
    if imports:
        return insert_after(src, imports[-1], f"import {name}")
    if body and is_docstring(body[0]):
        return insert_after(src, body[0], f"import {name}")
    return Edit(0, 0, f"import {name}{src.newline}")


def _append(src: SourceText, line: str) -> Edit:
    """`line` at the very end of the file (a missing final newline added first)."""
    end = len(src.text)
    lead = "" if not src.text or src.text.endswith(("\n", "\r")) else src.newline
    return Edit(end, end, f"{lead}{line}{src.newline}")


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
