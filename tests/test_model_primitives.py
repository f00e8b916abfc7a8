"""model's scope primitives: what binds a name, the scope walker, parent maps, shapes with holes."""

from __future__ import annotations

import ast

from k3patch.model import (
    Shape,
    Verdict,
    attribute_names,
    bindings,
    find_class,
    imported_names,
    loaded_names,
    parameter_names,
    parent_map,
    runtime_module_names,
    stored_names,
    walk_scope,
)
from k3patch.shapes import VersionRange


def test_an_attribute_store_does_not_rebind_the_class():
    # `Cls.flag = ...` after the class reads the name; only a second def or `Cls = ...` would
    # make the lookup ambiguous.
    module = ast.parse("class Cls:\n    pass\n\nCls.flag = True\nregistry[Cls] = 1\n")
    found = find_class(module, "Cls")
    assert found is not None and found.lineno == 1
    assert [s.lineno for s in bindings(module.body, "Cls")] == [1]
    rebound = ast.parse("class Cls:\n    pass\n\nCls, other = 1, 2\n")
    assert [s.lineno for s in bindings(rebound.body, "Cls")] == [1, 4]


def test_walk_scope_stays_out_of_nested_definitions():
    func = ast.parse(
        "def f():\n    a = 1\n    def g():\n        b = 2\n    class C:\n        c = 3\n"
    ).body[0]
    assert isinstance(func, ast.FunctionDef)
    names = {n.id for n in walk_scope(func.body) if isinstance(n, ast.Name)}
    assert names == {"a"}


def test_parent_map_leads_back_to_the_root():
    module = ast.parse("if x:\n    y = z.w\n")
    parents = parent_map(module)
    leaf = next(n for n in ast.walk(module) if isinstance(n, ast.Name) and n.id == "z")
    chain = []
    node: ast.AST | None = leaf
    while node is not None:
        chain.append(type(node).__name__)
        node = parents.get(id(node))
    assert chain == ["Name", "Attribute", "Assign", "If", "Module"]


def test_a_shape_with_holes_matches_and_carries_its_versions():
    shape = Shape(
        "guard",
        Verdict.PENDING,
        "n = int(HOLE_pool.shape[0])\n...\nreturn n",
        versions=VersionRange("0.27.1", "0.28.0"),
    )
    body = ast.parse("def f(s):\n    n = int(s.shape[0])\n    x = 1\n    return n\n").body[0]
    assert isinstance(body, ast.FunctionDef)
    found = shape.match(body.body)
    assert found is not None and ast.unparse(found["HOLE_pool"]) == "s"
    assert shape.match(body.body[:1]) is None
    assert shape.versions is not None and shape.versions.contains("0.31.0") is False


def test_loaded_and_stored_names_and_the_skipped_subtrees():
    module = ast.parse("a = b + c\nfor i in d:\n    e = i\n")
    assert loaded_names(module.body) == {"b", "c", "d", "i"}
    assert stored_names(module.body) == {"a", "i", "e"}
    # A name read inside a skipped subtree and nowhere else is not read.
    assign = module.body[0]
    assert isinstance(assign, ast.Assign)
    assert loaded_names(module.body, skip=[assign.value]) == {"d", "i"}


def test_runtime_module_names_skip_type_checking_imports():
    module = ast.parse(
        "import os.path\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n"
        "else:\n    fallback = 1\ntry:\n    import json as js\nexcept ImportError:\n"
        "    js = None\nlogger = get()\ndef f():\n    inner = 1\n"
    )
    assert runtime_module_names(module) == {"os", "TYPE_CHECKING", "fallback", "js", "logger", "f"}


def test_attribute_names_by_owner_and_context():
    cls = ast.parse(
        "class C:\n    def f(self):\n        self.a = self.b\n        other.c = self.d.e\n"
    )
    assert attribute_names([cls], "self", ast.Store) == {"a"}
    assert attribute_names([cls], "self", ast.Load) == {"b", "d"}
    assert attribute_names([cls], "other", ast.Store) == {"c"}


def test_imported_names_anywhere_under_a_node():
    func = ast.parse(
        "def f():\n    import os.path\n    import numpy as np\n    if x:\n"
        "        from a.b import c, d as e\n    def g():\n        import json\n"
    ).body[0]
    assert imported_names(func) == {"os", "np", "c", "e", "json"}
    assert imported_names(ast.parse("x = 1")) == set()


def test_parameter_names_all_named_or_only_positional():
    func = ast.parse("def f(a, /, b, *args, c, d=1, **kw): pass").body[0]
    assert isinstance(func, ast.FunctionDef)
    assert parameter_names(func) == {"a", "b", "c", "d"}
    assert parameter_names(func, positional=True) == {"a", "b"}
    lam = ast.parse("lambda *, k: k", mode="eval").body
    assert isinstance(lam, ast.Lambda)
    assert parameter_names(lam) == {"k"} and parameter_names(lam, positional=True) == set()
