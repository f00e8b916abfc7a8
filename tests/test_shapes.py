"""Shapes with named holes and elisions, and version ranges as data."""

from __future__ import annotations

import ast

import pytest

from k3patch.fingerprints import Shape, shape_detail
from k3patch.shapes import (
    VersionRange,
    blocks,
    find_expressions,
    holes,
    match,
    matches_each,
    search,
    version_key,
)
from k3patch.sources import SourceFile
from k3patch.verdicts import Verdict

GATE = """
if HOLE_cond:
    ...
    self._reqs_need_pending_save.pop(HOLE_req)
"""


def body(source: str) -> list[ast.stmt]:
    return ast.parse(source).body


def test_named_holes_bind_what_they_matched():
    code = body("if done(req):\n    log()\n    note()\n    self._reqs_need_pending_save.pop(rid)\n")
    found = match(GATE, code)
    assert found is not None
    assert holes(found) == {"HOLE_cond": "done(req)", "HOLE_req": "rid"}


@pytest.mark.parametrize(
    "code",
    [
        "if x:\n    self._reqs_need_pending_save.pop(r)\n",  # the elision matches nothing too
        "if x:\n    a()\n    self._reqs_need_pending_save.pop(r)\n",
    ],
)
def test_an_elision_matches_any_run_of_statements(code):
    assert match(GATE, body(code)) is not None


@pytest.mark.parametrize(
    "code",
    [
        "if x:\n    self._reqs_need_pending_save.get(r)\n",  # another method
        "if x:\n    self._reqs_need_pending_save.pop(r)\n    more()\n",  # a statement after
        "while x:\n    self._reqs_need_pending_save.pop(r)\n",  # another statement kind
        "if x:\n    self._reqs_need_save.pop(r)\n",  # another attribute
    ],
)
def test_anything_else_does_not_match(code):
    assert match(GATE, body(code)) is None


def test_a_hole_used_twice_must_match_equal_code():
    pattern = "HOLE_a = HOLE_a + 1"
    assert match(pattern, body("x = x + 1")) is not None
    assert match(pattern, body("x = y + 1")) is None


def test_formatting_comments_and_docstrings_do_not_matter():
    pattern = "def f(a):\n    return a >= HOLE_limit\n"
    code = body('def f(a):  # c\n    """doc"""\n    return (\n        a\n        >= 5\n    )\n')
    found = match(pattern, code)
    assert found is not None and holes(found) == {"HOLE_limit": "5"}


def test_an_expression_pattern_matches_an_expression():
    expr = ast.parse("a.b + scheduled[rid] >= n", mode="eval").body
    assert match("HOLE_x + scheduled[HOLE_id] >= HOLE_n", expr) is not None
    assert match("HOLE_x + scheduled[HOLE_id] > HOLE_n", expr) is None


def test_version_ranges_are_data():
    seen = VersionRange("0.28.0", "0.29.0")
    assert seen.contains("0.28.0") and seen.contains("0.29.0+k3fork")
    assert seen.contains("0.31.0") is False and seen.contains("nonsense") is None

    def detail(versions: VersionRange, version: str) -> str:
        shape = Shape("s", Verdict.PENDING, "x = 1", origin="o", versions=versions)
        return shape_detail(shape, SourceFile("f.py", None, version=version))

    assert detail(seen, "0.28.0") == "o"
    note = detail(seen, "0.31.0")
    assert note.startswith("o; ") and "0.28.0-0.29.0" in note and "0.31.0" in note
    assert detail(VersionRange("0.32.0"), "0.33.0") == "o"
    assert version_key("0.28.1.dev3") == (0, 28, 1) and version_key("x") is None


NESTED = """
def f(x):
    a = 1
    try:
        a = 1
        b = a
    except ValueError:
        a = 1
        b = a
    else:
        if x:
            a = 1
            b = a
    def g():
        a = 1
        b = a
    return a
"""


def test_blocks_cover_every_nested_block_but_not_nested_defs():
    func = body(NESTED)[0]
    firsts = [ast.unparse(block[0]) for block in blocks(func)]
    # f's body, the try body, the handler, the else, the if: g's body is another scope.
    assert firsts == ["a = 1", "a = 1", "a = 1", "if x:\n    a = 1\n    b = a", "a = 1"]


def test_search_finds_each_run_with_its_bindings():
    func = body(NESTED)[0]
    hits = search("a = 1\nb = HOLE_x", func)
    assert [(block[i].lineno, holes(found)) for block, i, found in hits] == [
        (5, {"HOLE_x": "a"}),
        (8, {"HOLE_x": "a"}),
        (12, {"HOLE_x": "a"}),
    ]
    assert search("a = 2\nb = a", func) == []
    with pytest.raises(ValueError):
        search("a = 1\n...", func)


@pytest.mark.wheel
def test_a_known_shape_outside_its_versions_is_reported(make_tree):
    """The shape still decides the verdict; the report says the tree is not a vLLM the shape
    was seen in (here: 0.31.0's code under a dist-info that says 0.40.0)."""
    import json

    from conftest import run_cli

    site = make_tree("0.31.0")
    (metadata,) = site.glob("vllm-*.dist-info/METADATA")
    metadata.write_text(metadata.read_text().replace("Version: 0.31.0", "Version: 0.40.0", 1))
    proc = run_cli("status", "--vllm", str(site), "--json", "--only", "aiter-mla-gfx942")
    (result,) = json.loads(proc.stdout)["patches"][0]["sites"]
    assert result["verdict"] == "pending"
    assert "seen in vLLM 0.12.0-0.34.0, not 0.40.0" in result["detail"]
    plain = make_tree("0.31.0")
    proc = run_cli("status", "--vllm", str(plain), "--json", "--only", "aiter-mla-gfx942")
    (result,) = json.loads(proc.stdout)["patches"][0]["sites"]
    assert "seen in vLLM" not in result["detail"]


def test_find_expressions_under_a_node_holes_included():
    tree = ast.parse("x = a.get(k)[0]\nif a.get(j)[0]:\n    b = [a.get(k)[1], c]\n")
    found = find_expressions("a.get(HOLE_key)[0]", tree)
    assert [ast.unparse(n) for n in found] == ["a.get(k)[0]", "a.get(j)[0]"]
    assert list(find_expressions("a.get(k)[2]", tree)) == []
    assert len(list(find_expressions("HOLE_any", ast.parse("f(x)", mode="eval").body))) == 3
    with pytest.raises(ValueError):
        find_expressions("x = 1", tree)


def test_matches_each_pairs_patterns_with_targets_in_order():
    call = ast.parse("f(a, b=g(1))", mode="eval").body
    assert isinstance(call, ast.Call)
    value = call.keywords[0].value
    assert matches_each(["a", "g(HOLE_x)"], [call.args[0], value])
    assert not matches_each(["g(HOLE_x)", "a"], [call.args[0], value])
    assert not matches_each(["a"], [None])  # a missing node (no default) matches nothing
    assert matches_each([], [value])  # no patterns: only the item's name had to be there
    with pytest.raises(ValueError):
        matches_each(["a"], [call.args[0], value])


def test_versions_are_read_as_pep_440_releases():
    """packaging reads the versions: a release candidate, dev, post or local build of a release
    is that release's code; a string that is no version (or only begins like one) is None."""
    for build in ("0.31.0rc1", "0.31.0.dev4", "0.31.0.post1", "0.31.0+rocm", "v0.31"):
        assert version_key(build) == (0, 31, 0), build
    assert version_key("0.31.0junk") is None and version_key("") is None
    assert VersionRange("0.30.0", "0.31.0").contains("0.31.0rc2") is True
