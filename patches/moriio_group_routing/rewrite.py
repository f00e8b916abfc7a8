"""moriio-group-routing's libcst nodes: imported by the rewrite only (status never loads libcst)."""

from __future__ import annotations

import libcst as cst

from k3patch.codemod import Statement


def blank_line_above(node: Statement) -> Statement:
    """`node` with one empty line (no indentation) above the lines already there."""
    return node.with_changes(leading_lines=[cst.EmptyLine(indent=False), *node.leading_lines])
