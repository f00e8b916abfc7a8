"""Rewrites shared by the patches, done on the site alone.

Parsing a whole vLLM module with libcst costs 0.1-0.3 s (MEASURED.md), so a rewrite never does:
the site is located with `ast` (already parsed for the verdict), its own lines are cut out,
transformed, and spliced back. Every byte outside the site's lines is left as it was.
libcst is imported only when a site is transformed, never on the status or no-op path.
"""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import libcst as cst


class SpliceError(ValueError):
    """The site's lines cannot be cut out cleanly (it shares a line with other code)."""


def statement_lines(text: str, node: ast.stmt) -> tuple[int, int]:
    """The 0-based [start, end) line range of a statement, decorators included."""
    first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
    end = node.end_lineno
    if end is None:
        raise SpliceError("the statement has no end position")
    lines = text.splitlines(keepends=True)
    indent = " " * node.col_offset
    if not lines[first - 1].startswith(indent) or lines[first - 1][: node.col_offset].strip():
        raise SpliceError(f"line {first} does not start with the statement")
    tail = lines[end - 1][node.end_col_offset or 0 :]
    if tail.strip() and not tail.strip().startswith("#"):
        raise SpliceError(f"line {end} holds more than the statement")
    return first - 1, end


def splice(text: str, start: int, end: int, new_lines: str) -> str:
    lines = text.splitlines(keepends=True)
    if not new_lines.endswith("\n"):
        new_lines += "\n"
    return "".join([*lines[:start], new_lines, *lines[end:]])


def indent_block(source: str, col: int) -> str:
    body = textwrap.dedent(source).strip("\n") + "\n"
    return textwrap.indent(body, " " * col, lambda line: bool(line.strip()))


def replace_statement(text: str, node: ast.stmt, new_source: str) -> str:
    """`text` with the statement `node` replaced by `new_source` at the node's indentation."""
    start, end = statement_lines(text, node)
    return splice(text, start, end, indent_block(new_source, node.col_offset))


@dataclass(frozen=True)
class Cut:
    """One statement's own lines cut out of a file, its indentation removed exactly: `col`
    spaces off every line with code on it; whitespace-only lines (also inside strings) are kept
    byte for byte. `put` splices a new version back at the same indentation."""

    text: str
    start: int  # 0-based line range [start, end) in `text`
    end: int
    col: int
    segment: str

    @property
    def first_line(self) -> int:
        """The 1-based line in the file of the segment's first line."""
        return self.start + 1

    def put(self, new_segment: str) -> str:
        prefix = " " * self.col
        lines = new_segment.splitlines(keepends=True)
        return splice(
            self.text,
            self.start,
            self.end,
            "".join(prefix + ln if ln.strip() else ln for ln in lines),
        )


def cut(text: str, node: ast.stmt) -> Cut:
    start, end = statement_lines(text, node)
    prefix = " " * node.col_offset
    lines = text.splitlines(keepends=True)[start:end]
    for line in lines:
        if line.strip() and not line.startswith(prefix):
            raise SpliceError("the statement's lines are not uniformly indented")
    segment = "".join(line[node.col_offset :] if line.strip() else line for line in lines)
    return Cut(text, start, end, node.col_offset, segment)


def transform_statement(text: str, node: ast.stmt, transformer: cst.CSTTransformer) -> str:
    """Run a libcst transformer over one statement's own lines and splice the result back."""
    import libcst

    piece = cut(text, node)
    return piece.put(libcst.parse_module(piece.segment).visit(transformer).code)


def find_method_node(text: str, class_name: str, method_name: str) -> ast.FunctionDef:
    module = ast.parse(text)
    for node in module.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            found = [
                n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == method_name
            ]
            if len(found) == 1:
                return found[0]
    raise SpliceError(f"expected exactly one {class_name}.{method_name}")


def replace_method(text: str, class_name: str, method_name: str, new_def_source: str) -> str:
    """`text` with `class_name.method_name` (decorators included) replaced by `new_def_source`."""
    return replace_statement(text, find_method_node(text, class_name, method_name), new_def_source)
