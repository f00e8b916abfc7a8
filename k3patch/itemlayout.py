"""An item appended to a parameter list, an argument list or a dict display (libcst nodes), laid
out like the items already there: one per line stays one per line, a trailing comma stays
trailing, a comment after the last item stays with it."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst
import libcst.matchers as m


def appended(items: Sequence[cst.CSTNode], new: cst.CSTNode) -> list[cst.CSTNode]:
    """`items` + `new`: `new` takes the last item's place at the end (its trailing comma and
    the whitespace before the closer); the last item gets the separator the items use."""
    if not items:
        return [new]
    last = items[-1]
    comma = last.comma  # type: ignore[attr-defined]
    if len(items) > 1 and isinstance(items[-2].comma, cst.Comma):  # type: ignore[attr-defined]
        separator = items[-2].comma  # type: ignore[attr-defined]
    elif isinstance(comma, cst.Comma) and m.matches(
        comma.whitespace_after, m.ParenthesizedWhitespace()
    ):
        separator = comma  # a lone item on its own line: the new one goes on the next
    else:
        separator = cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
    if isinstance(comma, cst.Comma):
        # `a,  # note` + `b`: the note stays with `a`; `b` ends the list as `a` did.
        kept = _comment_of(comma)
        sep = separator.with_changes(
            whitespace_after=_with_comment(separator.whitespace_after, kept)
        )
        tail = comma.with_changes(whitespace_after=_with_comment(comma.whitespace_after, None))
        return [*items[:-1], last.with_changes(comma=sep), new.with_changes(comma=tail)]
    moved = _trailing_whitespace(last)
    return [
        *items[:-1],
        _set_trailing(last.with_changes(comma=separator), None),
        _set_trailing(new, moved),
    ]


def _comment_of(comma: cst.Comma) -> cst.Comment | None:
    ws = comma.whitespace_after
    return ws.first_line.comment if isinstance(ws, cst.ParenthesizedWhitespace) else None


def _with_comment(ws: cst.BaseParenthesizableWhitespace, comment: cst.Comment | None) -> object:
    if not isinstance(ws, cst.ParenthesizedWhitespace):
        return ws
    first = ws.first_line.with_changes(
        comment=comment, whitespace=cst.SimpleWhitespace("  " if comment else "")
    )
    return ws.with_changes(first_line=first)


_TRAILING = {cst.Arg: "whitespace_after_arg", cst.Param: "whitespace_after_param"}


def _trailing_whitespace(node: cst.CSTNode) -> object:
    name = _TRAILING.get(type(node))
    return getattr(node, name) if name else None


def _set_trailing(node: cst.CSTNode, value: object) -> cst.CSTNode:
    name = _TRAILING.get(type(node))
    if name is None:
        return node
    return node.with_changes(**{name: value if value is not None else cst.SimpleWhitespace("")})
