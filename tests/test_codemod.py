"""The codemod driver (k3patch/codemod.py): each operation as the diff it makes, in the style of
libcst's `CodemodTest.assertCodemod(before, after)`; layouts the file already has (tabs, CRLF,
one item per line, trailing commas, comments) are kept."""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Callable

import libcst as cst
import pytest

from k3patch.codemod import Codemod, CodemodError, ScopedTransformer


def first(tree: ast.Module, kind: type, **attrs: object) -> ast.AST:
    return next(
        n
        for n in ast.walk(tree)
        if isinstance(n, kind) and all(getattr(n, k, None) == v for k, v in attrs.items())
    )


def assert_codemod(before: str, after: str, edit: Callable[[Codemod, ast.Module], None]) -> None:
    before, after = textwrap.dedent(before), textwrap.dedent(after)
    tree = ast.parse(before)
    codemod = Codemod(before, tree)
    edit(codemod, tree)
    assert codemod.code() == after


def stmt_at(tree: ast.Module, line: int) -> ast.stmt:
    return next(n for n in ast.walk(tree) if isinstance(n, ast.stmt) and n.lineno == line)


CASES = {
    "insert after, indentation of the block": (
        """\
        def f():
            a = 1
            return a
        """,
        """\
        def f():
            a = 1
            # why
            b = 2
            return a
        """,
        lambda c, t: c.insert_after(stmt_at(t, 2), "# why\nb = 2"),
    ),
    "insert before keeps the comment above the statement above the insertion": (
        """\
        def f():
            # about a
            a = 1
        """,
        """\
        def f():
            # about a
            b = 2
            a = 1
        """,
        lambda c, t: c.insert_before(stmt_at(t, 3), "b = 2"),
    ),
    "replace a run of statements; the comment above the first stays": (
        """\
        def f():
            # keep
            x = 1
            y = 2
            z = 3
        """,
        """\
        def f():
            # keep
            w = 0
            z = 3
        """,
        lambda c, t: c.replace([stmt_at(t, 3), stmt_at(t, 4)], "w = 0"),
    ),
    "nest under a header, with a comment above it (tabs stay tabs)": (
        "def f():\n\tx = 1\n\tif x:\n\t\tprint(x)\n\treturn x\n",
        "def f():\n\tx = 1\n\t# gated\n\tif GATE:\n\t\tif x:\n\t\t\tprint(x)\n\treturn x\n",
        lambda c, t: (
            c.insert_before(stmt_at(t, 3), "# gated"),
            c.nest_under([stmt_at(t, 3)], "if GATE:"),
        ),
    ),
    "CRLF stays CRLF": (
        "def f():\r\n    a = 1\r\n",
        "def f():\r\n    a = 1\r\n    b = 2\r\n",
        lambda c, t: c.insert_after(stmt_at(t, 2), "b = 2"),
    ),
    "CRLF stays CRLF inside a new multi-line string too": (
        "x = 1\r\n",
        'x = 1\r\n\r\n\r\ndef g():\r\n    """Doc.\r\n\r\n    More.\r\n    """\r\n',
        lambda c, t: c.append_definition('def g():\n    """Doc.\n\n    More.\n    """'),
    ),
    "a keyword argument after one per line, trailing comma and a note": (
        """\
        x = f(
            a=1,
            b=2,  # note
        )
        """,
        """\
        x = f(
            a=1,
            b=2,  # note
            c=3,
        )
        """,
        lambda c, t: c.append_to(first(t, ast.Call), "c=3", within=t.body[0]),
    ),
    "a keyword argument on one line": (
        "x = f(a, b=2)\n",
        "x = f(a, b=2, c=3)\n",
        lambda c, t: c.append_to(first(t, ast.Call), "c=3", within=t.body[0]),
    ),
    "a dict entry": (
        'd = {"a": 1, "b": 2}\n',
        'd = {"a": 1, "b": 2, "c": 3}\n',
        lambda c, t: c.append_to(first(t, ast.Dict), '"c": 3', within=t.body[0]),
    ),
    "a parameter": (
        "def f(self, a: int = 1) -> None:\n    pass\n",
        "def f(self, a: int = 1, b: int | None = None) -> None:\n    pass\n",
        lambda c, t: c.append_to(t.body[0], "b: int | None = None"),
    ),
    "a dataclass field after the last annotated one": (
        """\
        class C:
            a: int
            b: str = ""

            def m(self):
                pass
        """,
        """\
        class C:
            a: int
            b: str = ""
            c: list[int] | None = None

            def m(self):
                pass
        """,
        lambda c, t: c.append_to(t.body[0], "c: list[int] | None = None"),
    ),
    "a definition at the end, after two blank lines": (
        "x = 1\n",
        "x = 1\n\n\ndef g():\n    return x\n",
        lambda c, t: c.append_definition("def g():\n    return x"),
    ),
    "an import, unless bound": (
        '"""Doc."""\nimport sys\n\nx = 1\n',
        '"""Doc."""\nimport sys\nimport os\n\nx = 1\n',
        lambda c, t: c.ensure_import("os"),
    ),
    "a change of one statement through its libcst node": (
        "if a > b:\n    pass\n",
        "if a >= b:\n    pass\n",
        lambda c, t: c.change(
            t.body[0], lambda n: n.with_changes(test=cst.parse_expression("a >= b"))
        ),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_each_operation_makes_its_diff(name):
    before, after, edit = CASES[name]
    assert_codemod(before, after, edit)


def test_after_to_after_changes_nothing_without_an_edit():
    text = "def f():\n\tx = 1  # c\n\n\n# end\n"
    assert Codemod(text, ast.parse(text)).code() == text


def test_statements_of_elif_else_try_and_match_are_found():
    text = textwrap.dedent(
        """\
        if a:
            pass
        elif b:
            x = 1
        else:
            y = 2
        try:
            z = 3
        except E:
            w = 4
        finally:
            v = 5
        match q:
            case 1:
                u = 6
        """
    )
    tree = ast.parse(text)
    codemod = Codemod(text, tree)
    for line in (4, 6, 8, 10, 12, 15):
        codemod.insert_after(stmt_at(tree, line), f"n{line} = 0")
    out = codemod.code()
    compile(out, "x", "exec")
    for line in (4, 6, 8, 10, 12, 15):
        assert f"n{line} = 0" in out


def test_a_statement_that_shares_its_line_is_refused():
    text = "a = 1; b = 2\n"
    tree = ast.parse(text)
    with pytest.raises(CodemodError, match="shares its line"):
        Codemod(text, tree).insert_after(tree.body[0], "c = 3")


def test_two_changes_of_one_statement_are_refused():
    text = "a = 1\n"
    tree = ast.parse(text)
    codemod = Codemod(text, tree)
    codemod.replace([tree.body[0]], "b = 1")
    with pytest.raises(CodemodError, match="two changes"):
        codemod.replace([tree.body[0]], "c = 1")


def test_a_change_inside_a_removed_statement_is_refused():
    text = "if a:\n    x = 1\ny = 2\n"
    tree = ast.parse(text)
    codemod = Codemod(text, tree)
    codemod.nest_under([tree.body[0], tree.body[1]], "if g:")
    codemod.insert_after(stmt_at(tree, 3), "z = 3")  # y is moved: refused at the end
    with pytest.raises(CodemodError):
        codemod.code()


class _Rename(ScopedTransformer):
    scope = "C.m"

    def leave_scope(self, node: cst.CSTNode) -> cst.CSTNode:
        assert isinstance(node, cst.FunctionDef)
        return node.with_changes(name=cst.Name("renamed"))


def test_a_scoped_transformer_changes_only_its_qualified_name():
    text = (
        "def m():\n    pass\n\n\nclass C:\n    def m(self):\n        def m():\n            pass\n"
    )
    tree = ast.parse(text)
    codemod = Codemod(text, tree)
    rename = _Rename()
    codemod.transform(rename)
    out = codemod.code()
    assert out == text.replace("    def m(self)", "    def renamed(self)")


def _run(text: str, name: str = "x") -> object:
    scope: dict = {}
    exec(compile(text, "t.py", "exec"), scope)
    return scope.get(name)


@pytest.mark.parametrize("char", ["\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"])
def test_odd_line_break_characters_in_strings_are_not_lines(char):
    text = f'def f():\n    s = "a{char}b"\n    x = 1\n    return x\n'
    tree = ast.parse(text)
    codemod = Codemod(text, tree)
    codemod.insert_after(tree.body[0].body[1], "x = x + 41")
    new = codemod.code()
    assert f'"a{char}b"' in new
    assert _run(new + "x = f()\n") == 42


@pytest.mark.parametrize("newline", ["\r\n", "\r"])
def test_crlf_and_cr_files_keep_their_newlines(newline):
    text = newline.join(["def f():", "    x = 1", "    return x", ""])
    tree = ast.parse(text)
    codemod = Codemod(text, tree)
    codemod.insert_after(tree.body[0].body[0], "x += 1\nx += 1")
    codemod.nest_under([tree.body[0].body[1]], "if x:")
    new = codemod.code()
    assert new.replace(newline, "") == new.replace(newline, "").replace("\n", "")
    assert new.count(newline) == text.count(newline) + 3
    assert _run(new + newline + "x = f()" + newline) == 3


def test_nest_under_leaves_multiline_string_content_alone():
    text = 'def f(x):\n    if x:\n        log("""bad\nindices""", x)\n    return x\n'
    tree = ast.parse(text)
    codemod = Codemod(text, tree)
    codemod.nest_under([tree.body[0].body[0]], "if True:")
    assert codemod.code() == (
        'def f(x):\n    if True:\n        if x:\n            log("""bad\nindices""", x)\n'
        "    return x\n"
    )


def test_nest_under_uses_the_files_own_step():
    text = "def f(x):\n  if x:\n    x = 2\n  return x\n"
    tree = ast.parse(text)
    codemod = Codemod(text, tree)
    codemod.nest_under([tree.body[0].body[0]], "if True:")
    assert codemod.code() == "def f(x):\n  if True:\n    if x:\n      x = 2\n  return x\n"


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("f(\n    a=1,\n    b=2,  # mark\n)\n", "f(\n    a=1,\n    b=2,  # mark\n    c=3,\n)\n"),
        ("f(\n    a=1,\n    b=2\n)\n", "f(\n    a=1,\n    b=2,\n    c=3\n)\n"),
        ("f(x, k=1, *rest)\n", "f(x, k=1, *rest, c=3)\n"),
    ],
)
def test_an_argument_is_laid_out_like_the_others(text, want):
    tree = ast.parse(text)
    codemod = Codemod(text, tree)
    codemod.append_to(first(tree, ast.Call), "c=3", within=tree.body[0])
    assert codemod.code() == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("def f(a, b=1, *args):\n    pass\n", "def f(a, b=1, c=2, *args):\n    pass\n"),
        ('d = {"a": 1, **other}\n', 'd = {"a": 1, **other, "b": 2}\n'),
    ],
)
def test_an_item_goes_after_the_last_of_its_kind(text, want):
    tree = ast.parse(text)
    codemod = Codemod(text, tree)
    holder = first(tree, ast.FunctionDef) if text.startswith("def") else first(tree, ast.Dict)
    item = "c=2" if text.startswith("def") else '"b": 2'
    codemod.append_to(holder, item, within=tree.body[0])
    assert codemod.code() == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("x = 1", "x = 1\n\n\ndef g():\n    return 1\n"),  # no final newline
        ("x = 1\r\n", "x = 1\r\n\r\n\r\ndef g():\r\n    return 1\r\n"),
    ],
)
def test_a_definition_takes_the_files_newlines(text, want):
    codemod = Codemod(text, ast.parse(text))
    codemod.append_definition("\n    def g():\n        return 1\n")
    assert codemod.code() == want


@pytest.mark.parametrize("bound", ["import os\n", "import os.path\n", "from x import os\n"])
def test_an_import_is_not_added_twice(bound):
    codemod = Codemod(bound, ast.parse(bound))
    codemod.ensure_import("os")
    assert codemod.code() == bound
