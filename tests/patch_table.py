"""Table-driven patch tests, in the spirit of LibCST's `CodemodTest.assertCodemod(before,
after)`: a patch's expectations written as data and checked through one helper.

- verdict rows: (tree, expected verdict of every site, and words its detail must carry);
- rewrite rows: every change `apply` makes to a file, as `Change(file, at, removed, added)`
  (the line just before the change, then the lines it takes out and puts in, dedented), so a
  test reads as the diff it checks and a change nobody listed fails it;
- must-not-touch rows: statements of the real tree that stay byte-identical after `apply`.
"""

from __future__ import annotations

import difflib
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Change:
    file: str
    at: str  # the (stripped) line just before the change
    removed: str = ""  # the lines taken out, dedented
    added: str = ""  # the lines put in, dedented


def _block(lines: list[str]) -> str:
    return textwrap.dedent("".join(lines)) if lines else ""


def changes(file: str, before: str, after: str, *, join: int = 2) -> list[Change]:
    """The changes from `before` to `after`, line by line; changes at most `join` unchanged
    lines apart are one change (a replaced region shares a few lines with its old text)."""
    old, new = before.splitlines(keepends=True), after.splitlines(keepends=True)
    ops = [
        op
        for op in difflib.SequenceMatcher(None, old, new, autojunk=False).get_opcodes()
        if op[0] != "equal"
    ]
    merged: list[list[int]] = []
    for _tag, i1, i2, j1, j2 in ops:
        if merged and i1 - merged[-1][1] <= join:
            merged[-1][1], merged[-1][3] = i2, j2
        else:
            merged.append([i1, i2, j1, j2])
    return [
        Change(file, old[i1 - 1].strip() if i1 else "", _block(old[i1:i2]), _block(new[j1:j2]))
        for i1, i2, j1, j2 in merged
    ]


def assert_rewrite(
    before: Mapping[str, str], after: Mapping[str, str], expected: Iterable[Change]
) -> None:
    """`after` differs from `before` by exactly the `expected` changes, in file order."""
    found = [c for rel in before for c in changes(rel, before[rel], after[rel])]
    expected = list(expected)
    for want, got in zip(expected, found, strict=False):
        assert got == want, f"\nexpected {want}\n   found {got}"
    assert len(found) == len(expected), found[len(expected) :] or expected[len(found) :]


def assert_untouched(
    before: Mapping[str, str], after: Mapping[str, str], kept: Iterable[str]
) -> None:
    """Each `kept` text occurs in the files before (so the row means something) and as often
    after."""
    old, new = "".join(before.values()), "".join(after.values())
    for text in kept:
        assert old.count(text) >= 1, f"not in the tree: {text!r}"
        assert new.count(text) == old.count(text), f"touched: {text!r}"


def assert_sites(sites: Mapping[str, Mapping[str, object]], expected: Mapping[str, object]) -> None:
    """Every site's verdict is the expected one (a verdict for all, or per site name)."""
    for name, site in sites.items():
        want = expected[name] if name in expected else expected.get("*")
        assert site["verdict"] == want, (name, site["verdict"], site.get("detail"))
