"""The sources a patch reads: a read-only view over the target files of one tree (standard
library only: the verify child and the patches import it)."""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import cached_property

BOM = b"\xef\xbb\xbf"


class SourceError(Exception):
    """A target file exists but cannot be read as Python source (binary junk, syntax error)."""


@dataclass
class SourceFile:
    """One target file as bytes, with its text and AST computed on first use."""

    rel: str
    data: bytes | None
    # The vLLM version of the tree the file belongs to (None: unknown), for version notes.
    version: str | None = None

    @property
    def exists(self) -> bool:
        return self.data is not None

    @property
    def bom(self) -> bool:
        """A UTF-8 byte-order mark (Python accepts it): `text` leaves it out, `encode` puts it
        back."""
        return self.data is not None and self.data.startswith(BOM)

    def encode(self, text: str) -> bytes:
        return (BOM if self.bom else b"") + text.encode("utf-8")

    @cached_property
    def text(self) -> str:
        if self.data is None:
            raise SourceError(f"{self.rel}: file is absent")
        try:
            text = self.data[len(BOM) if self.bom else 0 :].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise SourceError(
                f"{self.rel}: not UTF-8 text (byte {exc.start}); restore it from the wheel"
            ) from None
        if "\x00" in text:
            raise SourceError(f"{self.rel}: contains NUL bytes; restore it from the wheel")
        return text

    @cached_property
    def tree(self) -> ast.Module:
        try:
            return ast.parse(self.text, filename=self.rel)
        except SyntaxError as exc:
            raise SourceError(
                f"{self.rel}: does not parse ({exc.msg}, line {exc.lineno}); "
                "restore it from the wheel"
            ) from None
        except (RecursionError, MemoryError):
            # The parser's own limits (3.11: deep operator chains raise RecursionError,
            # thousands of unary operators MemoryError): no vLLM file comes near them.
            raise SourceError(
                f"{self.rel}: code nested too deeply to parse (a generated or hostile "
                "file?); restore it from the wheel"
            ) from None

    def depth(self) -> int:
        """How many nodes deep the syntax tree goes (0 when absent or unparsable), walked
        without recursion: which file is too deep to analyse."""
        try:
            todo: list[tuple[ast.AST, int]] = [(self.tree, 1)]
        except SourceError:
            return 0
        deepest = 0
        while todo:
            node, level = todo.pop()
            deepest = max(deepest, level)
            todo.extend((child, level + 1) for child in ast.iter_child_nodes(node))
        return deepest

    def segment(self, node: ast.AST) -> str:
        """The exact source text of a node, for reports: its first line padded to its column
        and the whole dedented, so a method's body stays one level under its `def`."""
        text = ast.get_source_segment(self.text, node, padded=True)
        return textwrap.dedent(text) if text else ast.unparse(node)


class Sources:
    """The target files of a tree, read once and shared by every patch in one run."""

    def __init__(self, reader: Callable[[str], bytes | None], version: str | None = None) -> None:
        self._reader = reader
        self.version = version
        self._files: dict[str, SourceFile] = {}

    def __getitem__(self, rel: str) -> SourceFile:
        if rel not in self._files:
            self._files[rel] = SourceFile(rel, self._reader(rel), version=self.version)
        return self._files[rel]

    def with_changes(self, changes: Mapping[str, str]) -> Sources:
        """A view of the same tree with some files replaced by new text (nothing is written).
        The files read so far are shared with this view, parsed trees included."""
        view = Sources(self._reader, self.version)
        view._files = dict(self._files)
        for rel, text in changes.items():
            view._files[rel] = SourceFile(rel, self[rel].encode(text), self.version)
        return view
