"""libcst rewrites shared by the patches. Imported only when a site is pending (libcst is slow
to import and to parse: see MEASURED.md), never on the status or no-op path."""

from __future__ import annotations

import textwrap

import libcst as cst


class _ReplaceMethod(cst.CSTTransformer):
    """Replace one method of one top-level class with a new definition, touching nothing else."""

    def __init__(self, class_name: str, method_name: str, new_def: cst.FunctionDef) -> None:
        self.class_name = class_name
        self.method_name = method_name
        self.new_def = new_def
        self.replaced = 0
        self._depth = 0
        self._in_target = False

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self._depth += 1
        if self._depth == 1 and node.name.value == self.class_name:
            self._in_target = True
            return True
        return False

    def leave_ClassDef(self, original: cst.ClassDef, updated: cst.ClassDef) -> cst.ClassDef:
        self._depth -= 1
        if self._depth == 0:
            self._in_target = False
        return updated

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        # Nested functions are never sites; skipping them keeps the pass cheap.
        return False

    def leave_FunctionDef(
        self, original: cst.FunctionDef, updated: cst.FunctionDef
    ) -> cst.FunctionDef:
        if self._in_target and self._depth == 1 and original.name.value == self.method_name:
            self.replaced += 1
            # Keep the blank lines and comments that stood above the original definition.
            return self.new_def.with_changes(leading_lines=original.leading_lines)
        return updated


def parse_definition(source: str) -> cst.FunctionDef:
    module = cst.parse_module(textwrap.dedent(source).strip("\n") + "\n")
    node = module.body[0]
    if not isinstance(node, cst.FunctionDef):
        raise ValueError("expected a single function definition")
    return node


def replace_method(text: str, class_name: str, method_name: str, new_def_source: str) -> str:
    """`text` with `class_name.method_name` replaced by `new_def_source` (exactly one match)."""
    module = cst.parse_module(text)
    transformer = _ReplaceMethod(class_name, method_name, parse_definition(new_def_source))
    new_module = module.visit(transformer)
    if transformer.replaced != 1:
        raise ValueError(
            f"expected one {class_name}.{method_name}, replaced {transformer.replaced}"
        )
    return new_module.code
