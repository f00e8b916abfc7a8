"""moriio-chunk-gate's codemod on libcst nodes (imported only when a gate is rewritten): a gate's
header becomes the post-image's, its body and the comments around it stay; G1's gate also moves
out of `if new_block_ids is not None:`, under the post-image's guard."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst

from k3patch.codemod import Change, CodemodError, Statement, statements


def _template(source: str) -> cst.If:
    node = statements(source)[0]
    if not isinstance(node, cst.If):
        raise CodemodError(f"the post-image is no `if`: {source!r}")
    return node


def _with_test(gate: cst.CSTNode, post: cst.If) -> cst.If:
    """`gate` with `post`'s test: the lines from `if` to the `:` are the post-image's, the body
    (from the comment after the colon on) is the gate's."""
    if not isinstance(gate, cst.If):
        raise CodemodError("the gate is no `if`")
    return gate.with_changes(
        test=post.test,
        whitespace_before_test=post.whitespace_before_test,
        whitespace_after_test=post.whitespace_after_test,
    )


def new_header(template: str) -> Change:
    """The change of G2's gate: the template's header, its comments right above it (under the
    comments the gate already had)."""
    post = _template(template)

    def change(node: Statement) -> Statement:
        return _with_test(node, post).with_changes(leading_lines=post.leading_lines)

    return change


def under_guard(template: str) -> Change:
    """The change of `if new_block_ids is not None:`, whose last statement is G1's gate: the gate
    leaves the branch and follows it, under the template's guard (its comments above the guard,
    its own above the gate), with the template's header. The branch's indentation step is the
    guard's, so the gate and its body keep their columns."""
    guard = _template(template)
    guard_block = guard.body
    if not isinstance(guard_block, cst.IndentedBlock):
        raise CodemodError("the post-image's guard has no indented body")
    *guard_lines, post = guard_block.body
    if not isinstance(post, cst.If):
        raise CodemodError("the post-image's guard does not end in the gate")

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
