"""An item appended to a parameter list, an argument list or a dict display (libcst nodes), laid
out like the items already there: one per line stays one per line, a trailing comma stays
trailing, a comment after the last item stays with it."""

from __future__ import annotations

from collections.abc import Sequence

import libcst as cst

# The whitespace before the closer, which the new last item takes over (a dict element has none).
_TRAILING = {cst.Arg: "whitespace_after_arg", cst.Param: "whitespace_after_param"}


def appended(items: Sequence[cst.CSTNode], new: cst.CSTNode) -> list[cst.CSTNode]:
    """`items` + `new`: `new` takes the last item's place at the end (its trailing comma and
    the whitespace before the closer); the last item gets the separator the items use."""
    if not items:
        return [new]
    last = items[-1]
    comma = last.comma  # type: ignore[attr-defined]
    if len(items) > 1 and isinstance(items[-2].comma, cst.Comma):  # type: ignore[attr-defined]
        separator = items[-2].comma  # type: ignore[attr-defined]
    elif isinstance(comma, cst.Comma) and isinstance(
        comma.whitespace_after, cst.ParenthesizedWhitespace
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
    name = _TRAILING.get(type(last))
    if name is None:
        return [*items[:-1], last.with_changes(comma=separator), new]
    bare = last.with_changes(comma=separator, **{name: cst.SimpleWhitespace("")})
    return [*items[:-1], bare, new.with_changes(**{name: getattr(last, name)})]


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
