"""moriio-chunk-gate's libcst changes (imported only to rewrite): a gate's header becomes the
post-image's, its body and comments stay."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst

from k3patch.codemod import Change, CodemodError, Statement, statements


def _template(source: str) -> cst.If:
    node = statements(source)[0]
    assert isinstance(node, cst.If)  # G1_TEMPLATE and G2_TEMPLATE are `if`s
    return node


def _with_test(gate: cst.CSTNode, post: cst.If) -> cst.If:
    """`gate` with `post`'s test: from `if` to the `:` the post-image's, the rest the gate's."""
    assert isinstance(gate, cst.If)  # the libcst node of an ast.If
    return gate.with_changes(
        test=post.test,
        whitespace_before_test=post.whitespace_before_test,
        whitespace_after_test=post.whitespace_after_test,
    )


def new_header(template: str) -> Change:
    """G2's change: the template's header, its comments above it (under the gate's own)."""
    post = _template(template)

    def change(node: Statement) -> Statement:
        return _with_test(node, post).with_changes(leading_lines=post.leading_lines)

    return change


def under_guard(template: str) -> Change:
    """The change of `if new_block_ids is not None:`, which ends in G1's gate: the gate leaves it
    for the template's guard after it, with the template's header, at the branch's indentation
    (the gate and its body keep their columns)."""
    guard = _template(template)
    guard_block = guard.body
    *guard_lines, post = guard_block.body
    assert isinstance(guard_block, cst.IndentedBlock) and isinstance(post, cst.If)

    def change(node: Statement) -> Sequence[Statement]:
        block = getattr(node, "body", None)
        if not (isinstance(node, cst.If) and isinstance(block, cst.IndentedBlock)):
            raise CodemodError("the gate's branch is no `if` with an indented body")
        *kept, gate = block.body
        if not kept:
            raise CodemodError("the gate is all its branch holds")
        # What followed the gate's body inside the branch follows it inside the guard.
        moved = guard_block.with_changes(
            body=[*guard_lines, _with_test(gate, post)], indent=block.indent, footer=block.footer
        )
        branch = node.with_changes(body=block.with_changes(body=kept, footer=[]))
        return [branch, guard.with_changes(body=moved)]

    return change
