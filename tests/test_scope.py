"""Scope lookup refuses ambiguity: a name bound twice in one scope (a second method, a later
class of the same name, an assignment over a def) is drift, because the later binding is the
live one and patching the first would patch dead code and still say "applied"."""

from __future__ import annotations

import ast
import json

import pytest
from conftest import run_cli, sha

from k3patch.astkit import (
    AmbiguousDefinition,
    find_class,
    find_def,
    find_function,
    find_method,
)

ONE = """
class A:
    def f(self):
        return 1

def g():
    pass
"""


def test_single_definitions_are_found():
    module = ast.parse(ONE)
    cls = find_class(module, "A")
    assert cls is not None and find_method(cls, "f") is not None
    assert find_function(module, "g") is not None
    assert find_def(module, "A.f") is find_method(cls, "f")
    assert find_class(module, "B") is None and find_def(module, "A.nope") is None


def test_find_def_finds_functions_and_methods_never_classes():
    module = ast.parse(ONE)
    assert find_def(module, "A.f") is not None
    assert find_def(module, "g") is find_function(module, "g")
    assert find_def(module, "A") is None and find_def(module, "A.nope") is None
    with pytest.raises(AmbiguousDefinition):
        find_def(ast.parse(ONE + "g = None\n"), "g")


@pytest.mark.parametrize(
    "extra, lookup",
    [
        ("class A:\n    pass\n", "A"),  # a later class of the same name
        ("A = object\n", "A"),  # an assignment rebinds it
        ("from x import A\n", "A"),  # so does an import
        ("def g():\n    return 2\n", "g"),
        ("g = lambda: 3\n", "g"),
    ],
)
def test_a_second_binding_in_the_module_is_ambiguous(extra, lookup):
    module = ast.parse(ONE + extra)
    with pytest.raises(AmbiguousDefinition) as info:
        find_def(module, lookup)
    assert info.value.name == lookup and len(info.value.lines) == 2


def test_a_second_method_in_the_class_is_ambiguous():
    module = ast.parse(ONE.replace("        return 1\n", "        return 1\n\n    f = None\n"))
    cls = find_class(module, "A")
    assert cls is not None
    with pytest.raises(AmbiguousDefinition):
        find_method(cls, "f")


SECOND_METHOD = """
    @classmethod
    def is_mla_enabled(cls) -> bool:
        return cls._AITER_ENABLED and cls._MLA_ENABLED
"""


def _add_after_class_line(text: str, addition: str) -> str:
    # Insert right after the class header so the addition sits inside the class body.
    head = "class rocm_aiter_ops:\n"
    assert text.count(head) == 1
    return text.replace(head, head + addition, 1)


@pytest.mark.wheel
@pytest.mark.parametrize("where", ["second method", "later class"])
def test_duplicated_site_is_drift_and_nothing_of_it_is_written(make_tree, where):
    site = make_tree("0.31.0")
    target = site / "vllm" / "_aiter_ops.py"
    text = target.read_text()
    if where == "second method":
        text = _add_after_class_line(text, SECOND_METHOD)
    else:
        text += "\n\nclass rocm_aiter_ops(rocm_aiter_ops):\n    pass\n"
    target.write_text(text)
    before = sha(target)
    proc = run_cli("status", "--vllm", str(site), "--json", "--only", "aiter-mla-gfx942")
    data = json.loads(proc.stdout)
    assert proc.returncode == 1
    (result,) = data["patches"][0]["sites"]
    assert result["verdict"] == "drifted"
    assert "bound 2 times" in result["detail"] and result["file"] == "_aiter_ops.py"
    assert run_cli("apply", "--vllm", str(site), "--only", "aiter-mla-gfx942").returncode == 1
    assert sha(target) == before


def _patch(pid: str, after: tuple[str, ...] = ()):
    from k3patch.patch import Patch

    patch = Patch()
    patch.id = pid
    patch.after = after
    return patch


def test_patch_order_follows_after_then_id():
    from k3patch.registry import ordered

    got = ordered([_patch("b"), _patch("a", after=("c",)), _patch("c")])
    assert [p.id for p in got] == ["b", "c", "a"]
    assert [p.id for p in ordered([_patch("b"), _patch("a")])] == ["a", "b"]


@pytest.mark.parametrize(
    "patches",
    [
        [_patch("a", after=("b",)), _patch("b", after=("a",))],
        [_patch("a", after=("nope",))],
    ],
)
def test_patch_order_refuses_cycles_and_unknown_ids(patches):
    from k3patch.registry import PatchOrderError, ordered

    with pytest.raises(PatchOrderError):
        ordered(patches)
