"""aiter-mla-gfx942's codemod: the method, found by its qualified name (decorators included),
becomes the post-image; the blank lines and comments above it stay."""

from __future__ import annotations

import libcst as cst

from k3patch.codemod import ScopedTransformer, statements


class ExcludeGfx942(ScopedTransformer):
    def __init__(self, scope: str, post_image: str, newline: str) -> None:
        super().__init__()
        self.scope = scope
        self.new = statements(post_image, newline)[0]

    def leave_scope(self, node: cst.CSTNode) -> cst.CSTNode:
        if not isinstance(node, cst.FunctionDef):
            raise TypeError(f"{self.scope} is not a function")
        return self.new.with_changes(leading_lines=node.leading_lines)
