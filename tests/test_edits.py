"""The engine's one line model and Edit type, on the files Python accepts that str.splitlines
and naive line models get wrong: form feed and the other Unicode line-break characters inside
strings, CRLF and CR files, tab indentation, a UTF-8 byte-order mark; overlapping edits refused."""

from __future__ import annotations

import ast

import pytest

from k3patch import edits
from k3patch.edits import Edit, EditError, SourceText, apply_edits, header_end
from k3patch.model import SourceFile, module_binds

ODD_CHARS = ["\f", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


def _run(text: str, name: str = "x"):
    scope: dict = {}
    exec(compile(text, "t.py", "exec"), scope)
    return scope.get(name)


@pytest.mark.parametrize("char", ODD_CHARS)
def test_odd_line_break_characters_in_strings_are_not_lines(char):
    text = f'def f():\n    s = "a{char}b"\n    x = 1\n    return x\n'
    module = ast.parse(text)
    func = module.body[0]
    assert isinstance(func, ast.FunctionDef)
    src = SourceText(text)
    assert len(src.starts) == 5  # four lines and the end, whatever the string holds
    new = apply_edits(text, [edits.insert_after(src, func.body[1], "x = x + 41")])
    assert f'"a{char}b"' in new  # the string is untouched
    assert _run(new + "x = f()\n") == 42


def test_form_feed_before_an_indented_statement():
    text = "def f():\n    x = 1\n\f    y = 2\n    return x + y\n"
    func = ast.parse(text).body[0]
    assert isinstance(func, ast.FunctionDef)
    src = SourceText(text)
    assert src.indent_of(func.body[1]) == "\f    "
    new = apply_edits(text, [edits.replace(src, [func.body[1]], "y = 40")])
    assert _run(new + "x = f()\n") == 41


@pytest.mark.parametrize("newline", ["\r\n", "\r"])
def test_crlf_and_cr_files_keep_their_newlines(newline):
    text = newline.join(["def f():", "    x = 1", "    return x", ""])
    func = ast.parse(text).body[0]
    assert isinstance(func, ast.FunctionDef)
    src = SourceText(text)
    assert src.newline == newline
    new = apply_edits(
        text,
        [
            edits.insert_after(src, func.body[0], "x += 1\nx += 1"),
            edits.nest_under(src, [func.body[1]], "if x:"),
        ],
    )
    assert "\n" not in new.replace("\r\n", "") if newline == "\r\n" else "\n" not in new
    assert new.count(newline) == text.count(newline) + 3
    assert _run(new + newline + "x = f()" + newline) == 3


def test_tab_indented_code_is_edited_with_tabs():
    text = "def f():\n\tx = 1\n\tif x:\n\t\tx = 2\n\treturn x\n"
    func = ast.parse(text).body[0]
    assert isinstance(func, ast.FunctionDef)
    src = SourceText(text)
    new = apply_edits(
        text,
        [
            edits.insert_before(src, func.body[0], "y = 5"),
            edits.nest_under(src, [func.body[2]], "if True:"),
        ],
    )
    assert "\ty = 5\n" in new and "\tif True:\n\t\treturn x\n" in new
    assert " " * 4 not in new
    assert _run(new + "x = f()\n") == 2


def test_a_byte_order_mark_is_read_and_kept():
    data = b"\xef\xbb\xbfimport os\nx = 1\n"
    src_file = SourceFile("m.py", data)
    assert src_file.bom and src_file.text == "import os\nx = 1\n"
    assert isinstance(src_file.tree, ast.Module)
    new_text = src_file.text.replace("x = 1", "x = 2")
    assert src_file.encode(new_text) == b"\xef\xbb\xbfimport os\nx = 2\n"
    assert SourceFile("n.py", b"x = 1\n").encode("x = 2\n") == b"x = 2\n"


def test_ensure_import_only_when_unbound():
    text = '"""doc"""\nimport sys\n\nx = 1\n'
    module = ast.parse(text)
    edit = edits.ensure_import(SourceText(text), module, "os")
    assert edit is not None
    # A standard-library module heads the import block, as isort puts it.
    assert apply_edits(text, [edit]) == '"""doc"""\nimport os\nimport sys\n\nx = 1\n'
    third = edits.ensure_import(SourceText(text), module, "torch")
    assert third is not None
    assert apply_edits(text, [third]) == '"""doc"""\nimport sys\nimport torch\n\nx = 1\n'
    bound = "import os as os\n"
    assert edits.ensure_import(SourceText(bound), ast.parse(bound), "os") is None
    assert module_binds(ast.parse("os = None\n"), "os")
    assert not module_binds(ast.parse("def f():\n    import os\n"), "os")


IMPORT_OS = {
    "third-party first": ("import torch\n", "import os\n\nimport torch\n"),
    "stdlib first": ("import logging\nimport torch\n", "import os\nimport logging\nimport torch\n"),
    "after docstring and __future__": (
        '"""Doc."""\nfrom __future__ import annotations\n\nimport torch\n',
        '"""Doc."""\nfrom __future__ import annotations\n\nimport os\n\nimport torch\n',
    ),
    "before a decorated def": ("@d\ndef f():\n    pass\n", "import os\n\n@d\ndef f():\n    pass\n"),
    "only a docstring, no final newline": ('"""Doc."""', '"""Doc."""\nimport os\n'),
    "CRLF": ("import torch\r\n", "import os\r\n\r\nimport torch\r\n"),
}


@pytest.mark.parametrize("case", sorted(IMPORT_OS))
def test_ensure_import_puts_a_stdlib_module_first(case):
    before, after = IMPORT_OS[case]
    edit = edits.ensure_import(SourceText(before), ast.parse(before), "os")
    assert edit is not None
    assert apply_edits(before, [edit]) == after


@pytest.mark.parametrize("bound", ["import os.path\n", "from x import os\n", "os: int = 1\n"])
def test_ensure_import_leaves_a_bound_name(bound):
    assert edits.ensure_import(SourceText(bound), ast.parse(bound), "os") is None


def test_binding_means_storing_the_bare_name():
    # `os.environ[...] = ...` and `table[os] = ...` read `os`; only a stored name binds it.
    assert not module_binds(ast.parse('os.environ["A"] = "1"\ntable[os] = 1\n'), "os")
    assert module_binds(ast.parse("a, os = 1, 2\n"), "os")


def test_nest_under_leaves_multiline_string_content_alone():
    text = 'def f(x):\n    if x:\n        log("""bad\nindices""", x)\n    return x\n'
    func = ast.parse(text).body[0]
    assert isinstance(func, ast.FunctionDef)
    src = SourceText(text)
    new = apply_edits(text, [edits.nest_under(src, [func.body[0]], "if True:")])
    assert new == (
        'def f(x):\n    if True:\n        if x:\n            log("""bad\nindices""", x)\n'
        "    return x\n"
    )


def test_nest_under_uses_the_statements_own_step():
    text = "def f(x):\n  if x:\n    x = 2\n  return x\n"
    func = ast.parse(text).body[0]
    assert isinstance(func, ast.FunctionDef)
    new = apply_edits(text, [edits.nest_under(SourceText(text), [func.body[0]], "if True:")])
    assert new == "def f(x):\n  if True:\n    if x:\n      x = 2\n  return x\n"


def test_append_item_keeps_one_item_per_line():
    text = "f(\n    a=1,\n    b=2,\n)\n"
    call = ast.parse(text).body[0]
    assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call)
    kws = call.value.keywords
    src = SourceText(text)
    new = apply_edits(text, [edits.append_item(src, call.value, kws[0], kws[-1].value, "c=3")])
    assert new == "f(\n    a=1,\n    b=2,\n    c=3,\n)\n"
    flat = "f(a=1, b=2)\n"
    call = ast.parse(flat).body[0]
    assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call)
    kws = call.value.keywords
    src = SourceText(flat)
    out = apply_edits(flat, [edits.append_item(src, call.value, kws[0], kws[-1].value, "c=3")])
    assert out == "f(a=1, b=2, c=3)\n"


@pytest.mark.parametrize(
    "text,want",
    [
        # A marker comment after the trailing comma stays with the item it was written for.
        ("f(\n    a=1,\n    b=2,  # mark\n)\n", "f(\n    a=1,\n    b=2,  # mark\n    c=3,\n)\n"),
        ("f(\r\n    a=1,\r\n    b=2,  # mark\r\n)\r\n", None),
        # No trailing comma: the comment follows the new item, as the line's last text.
        ("f(\n    a=1,\n    b=2  # mark\n)\n", "f(\n    a=1,\n    b=2,\n    c=3  # mark\n)\n"),
        # The comma and the closing parenthesis share the line: the item goes before them.
        ("f(\n    a=1,\n    b=2,)\n", "f(\n    a=1,\n    b=2,\n    c=3,)\n"),
    ],
)
def test_append_item_after_a_trailing_comma(text, want):
    call = ast.parse(text).body[0]
    assert isinstance(call, ast.Expr) and isinstance(call.value, ast.Call)
    kws = call.value.keywords
    new = apply_edits(
        text, [edits.append_item(SourceText(text), call.value, kws[0], kws[-1].value, "c=3")]
    )
    if want is None:  # CRLF: the same as the LF case, line endings kept
        want = "f(\r\n    a=1,\r\n    b=2,  # mark\r\n    c=3,\r\n)\r\n"
    assert new == want
    assert _run(new.replace("f(", "x = dict(", 1)) == {"a": 1, "b": 2, "c": 3}


@pytest.mark.parametrize(
    ("text", "item", "want"),
    [
        # A parameter goes after the last positional one's default, not after `*args`.
        ("def f(a, b=1, *args):\n    pass\n", "c=2", "def f(a, b=1, c=2, *args):\n    pass\n"),
        ("def f(a, /):\n    pass\n", "b", "def f(a, b, /):\n    pass\n"),
        # A call's last argument by position: a keyword before a later `*rest` is not it.
        ("f(x, k=1, *rest)\n", "c=3", "f(x, k=1, *rest, c=3)\n"),
        # A dict's last entry may be `**other` (no key).
        ('d = {"a": 1, **other}\n', '"b": 2', 'd = {"a": 1, **other, "b": 2}\n'),
        # A class's field goes after its last annotated one, before its methods.
        (
            "class C:\n    a: int = 1\n    b: str\n    def m(self):\n        pass\n",
            "c: int = 0",
            "class C:\n    a: int = 1\n    b: str\n    c: int = 0\n    def m(self):\n"
            "        pass\n",
        ),
    ],
)
def test_append_to_finds_the_last_item_of_its_holder(text, item, want):
    holder = next(
        n
        for n in ast.walk(ast.parse(text))
        if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.Call | ast.Dict)
    )
    assert apply_edits(text, [edits.append_to(SourceText(text), holder, item)]) == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("x = 1\n", "x = 1\n\n\ndef g():\n    return 1\n"),
        ("x = 1", "x = 1\n\n\ndef g():\n    return 1\n"),  # no final newline
        ("x = 1\r\n", "x = 1\r\n\r\n\r\ndef g():\r\n    return 1\r\n"),
    ],
)
def test_append_definition_after_two_blank_lines_in_the_files_newlines(text, want):
    source = "\n    def g():\n        return 1\n"
    assert apply_edits(text, [edits.append_definition(SourceText(text), source)]) == want


@pytest.mark.parametrize(
    "pair",
    [
        (Edit(0, 5, "a"), Edit(3, 8, "b")),  # overlapping replacements
        (Edit(4, 4, "a"), Edit(4, 4, "b")),  # two insertions at one point: order unknown
        (Edit(0, 9, "a"), Edit(4, 4, "b")),  # an insertion inside a replacement
    ],
)
def test_overlapping_edits_are_refused(pair):
    with pytest.raises(EditError):
        apply_edits("0123456789", list(pair))


def test_adjacent_edits_apply_in_one_pass():
    assert apply_edits("0123456789", [Edit(5, 7, "x"), Edit(0, 2, "y"), Edit(2, 2, "z")]) == (
        "yz234x789"
    )


def test_a_statement_sharing_its_line_is_refused():
    text = "x = 1; y = 2\n"
    stmt = ast.parse(text).body[0]
    with pytest.raises(EditError):
        edits.insert_after(SourceText(text), stmt, "z = 3")


def test_header_end_is_past_the_colon_after_parentheses_and_comments():
    text = (
        "if (\n    a  # why\n    and b\n):  # trailing\n    pass\n"
        "for x in (\n    y\n)  :\r\n    z\n"
    )
    module = ast.parse(text)
    src = SourceText(text)
    gate, loop = module.body
    assert isinstance(gate, ast.If) and isinstance(loop, ast.For)
    assert text[: header_end(src, gate)].endswith("    and b\n):")
    assert text[: header_end(src, loop)].endswith("    y\n)  :")
    # A header whose colon is not where the grammar puts it cannot be read: refused.
    stale = ast.parse("if a + b:\n    pass\n").body[0]
    assert isinstance(stale, ast.If)
    with pytest.raises(EditError):
        header_end(SourceText("if a:\n    pass\n"), stale)
