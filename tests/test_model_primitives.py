"""model's scope primitives: what binds a name, the scope walker, parent maps, shapes with holes."""

from __future__ import annotations

import ast

from k3patch.astkit import (
    attribute_owner,
    bindings,
    blocks,
    callee_name,
    find_class,
    imported_names,
    parameter_names,
    stored_names,
    walk,
)
from k3patch.fingerprints import Shape
from k3patch.patches.kda_gather_diagnostic import imported_module, string_constants
from k3patch.patches.kda_gather_diagnostic.syncs import truth_tests
from k3patch.patches.moriio_chunk_gate.names import (
    ancestors,
    assigned_name,
    attribute_names,
    loaded_names,
    loops_over,
    outline,
    parent_map,
    runtime_module_names,
    temporaries_before,
    unbound_names,
    unset_attributes,
)
from k3patch.shapes import VersionRange, match
from k3patch.sitemodel import clip_lines, combined_verdict, named_items
from k3patch.verdicts import Verdict


def test_an_attribute_store_does_not_rebind_the_class():
    # `Cls.flag = ...` after the class reads the name; only a second def or `Cls = ...` would
    # make the lookup ambiguous.
    module = ast.parse("class Cls:\n    pass\n\nCls.flag = True\nregistry[Cls] = 1\n")
    found = find_class(module, "Cls")
    assert found is not None and found.lineno == 1
    assert [s.lineno for s in bindings(module.body, "Cls")] == [1]
    rebound = ast.parse("class Cls:\n    pass\n\nCls, other = 1, 2\n")
    assert [s.lineno for s in bindings(rebound.body, "Cls")] == [1, 4]


def test_walk_with_scope_stays_out_of_nested_definitions():
    func = ast.parse(
        "def f():\n    a = 1\n    def g():\n        b = 2\n    class C:\n        c = 3\n"
    ).body[0]
    assert isinstance(func, ast.FunctionDef)
    names = {n.id for n in walk(func, scope=True) if isinstance(n, ast.Name)}
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


def test_clip_lines_keeps_a_short_text_and_counts_what_it_cuts():
    assert clip_lines("a\nb\n", 2) == "a\nb\n"
    assert clip_lines("", 0) == ""
    assert clip_lines("a\nb\nc", 2) == "a\nb\n... (1 more lines)"
    assert clip_lines("\n".join(map(str, range(50)))).splitlines()[-1] == "... (10 more lines)"


def test_callee_name_of_names_attributes_and_anything_else():
    calls = [ast.parse(s, mode="eval").body for s in ("f(1)", "a.b.m()", "f()()", "t[k]()")]
    assert [callee_name(c) for c in calls if isinstance(c, ast.Call)] == ["f", "m", "", ""]


def test_named_items_of_each_holder():
    cls, func = ast.parse(
        "class C:\n    a: int = 1\n    b: str\n    c = 2\n    a: float = 3\n    self.x: int = 4\n"
        "def f(p, /, q: int, r=1, *s, t=2, **u): pass\n"
    ).body
    fields = named_items(cls)
    assert list(fields) == ["a", "b"] and fields["b"][1] is None
    assert [ast.unparse(fields["a"][0]), ast.unparse(fields["a"][1])] == ["a: float = 3", "3"]
    params = named_items(func)
    assert list(params) == ["p", "q", "r"]
    assert params["q"][1] is None and ast.unparse(params["r"][1]) == "1"
    assert isinstance(params["q"][0], ast.arg) and ast.unparse(params["q"][0].annotation) == "int"
    call = ast.parse("g(1, k=2, **rest)", mode="eval").body
    assert {n: ast.unparse(v) for n, (_, v) in named_items(call).items()} == {"k": "2"}
    literal = ast.parse("{'a': 1, 2: 3, **more, 'a': 4}", mode="eval").body
    assert {n: ast.unparse(v) for n, (_, v) in named_items(literal).items()} == {"a": "4"}
    assert named_items(ast.parse("x + 1", mode="eval").body) == {}
    lam = ast.parse("lambda a, b=2: a", mode="eval").body
    assert list(named_items(lam)) == ["a", "b"]


def test_assigned_name_takes_plain_assignments_only():
    body = ast.parse("a = 1\nb = c = 2\nd.e = 3\nf: int = 4\ng += 5\n(h, i) = 6, 7\na = 8\n").body
    assert [assigned_name(s) for s in body] == ["a", None, None, None, None, None, "a"]


def test_temporaries_before_take_the_feeding_run_only():
    block = ast.parse(
        "unrelated = 0\nbase = 1\nother = 2\nscaled = base * 3\nif scaled > n:\n    pass\n"
    ).body
    # `other` is not read: the run ends there, so `base` (above it) is not taken.
    assert [assigned_name(s) for s in temporaries_before(block, 4, block[4].test)] == ["scaled"]
    block = ast.parse("base = 1\nscaled = base * 3\nif scaled:\n    pass\n").body
    assert [assigned_name(s) for s in temporaries_before(block, 2, block[2])] == ["base", "scaled"]
    assert temporaries_before(block, 0, block[2]) == []


def test_attribute_owner():
    core = ast.parse("x.y", mode="eval").body
    assert attribute_owner(core, "y") == "x"
    assert attribute_owner(core, "z") is None
    assert attribute_owner(ast.parse("a.b.y", mode="eval").body, "y") is None


def test_ancestors_up_to_the_root_or_a_stop():
    func = ast.parse("def f():\n    for x in y:\n        if x:\n            z = 1\n").body[0]
    assert isinstance(func, ast.FunctionDef)
    loop = func.body[0]
    assert isinstance(loop, ast.For) and isinstance(loop.body[0], ast.If)
    stmt = loop.body[0].body[0]
    parents = parent_map(func)
    assert ancestors(stmt, parents) == [loop.body[0], loop, func]
    assert ancestors(stmt, parents, stop=loop) == [loop.body[0]]
    assert ancestors(func, parents) == []


def test_loops_over_a_name_in_the_iterable_only():
    func = ast.parse(
        "def f(self):\n    for a in self.items.values():\n        for b in a:\n"
        "            pass\n    for items in other:\n        pass\n"
    ).body[0]
    assert [loop.lineno for loop in loops_over(func, "items")] == [2]
    assert [loop.lineno for loop in loops_over(func, "self.items")] == [2]
    assert [loop.lineno for loop in loops_over(func, "a")] == [3]


def test_an_expression_pattern_ignores_positions_and_parentheses():
    # How moriio-chunk-gate holds an `if` test against a known condition.
    assert match("a + b", ast.parse("(a  +\n b)", mode="eval").body) is not None
    assert match("a + b", ast.parse("b + a", mode="eval").body) is None


def test_imported_module_names_the_one_module_every_binding_imports():
    def of(source: str, name: str = "os") -> str | None:
        return imported_module(ast.parse(source).body, name)

    assert of("import sys\n") is None
    assert of("import os\n") == of("import os.path\n") == of("import os as os\n") == "os"
    assert of("import os\nimport os.path\n") == "os"
    assert of("import posix as os\n") == "posix"
    assert of("import os.path as os\n") == "os.path"
    assert of("import os, sys as _k3os\n", "_k3os") == "sys"
    for other in ("from x import os\n", "os = 1\n", "def os(): ...\n", "import os\nos = 2\n"):
        assert of(other) == "", other
    assert of("import os\nimport posix as os\n") == ""
    assert of("def f():\n    import os\n") is None, "only the scope's own statements bind"


def test_walk_leaves_out_annotations_but_not_defaults():
    func = ast.parse("def f(a: A | B = d, *, k: K = e) -> R[x]:\n    y: Y = z\n").body[0]
    names = {n.id for n in walk(func) if isinstance(n, ast.Name)}
    assert names == {"d", "e", "y", "z"}
    lam = ast.parse("lambda a=q: a", mode="eval").body
    assert {n.id for n in walk(lam) if isinstance(n, ast.Name)} == {"q", "a"}
    nested = ast.parse("def f():\n    def g(v: V = w):\n        u\n").body[0]
    assert {n.id for n in walk(nested) if isinstance(n, ast.Name)} == {"w", "u"}


def test_truth_tests_are_the_node_s_own_tests_only():
    def tests(source: str) -> list[str]:
        node = ast.parse(source).body[0]
        node = node.value if isinstance(node, ast.Expr) else node
        return [ast.unparse(t) for t in truth_tests(node)]

    assert tests("if a:\n    pass\n") == tests("while a:\n    pass\n") == ["a"]
    assert tests("assert a, m\n") == tests("x if a else y\n") == tests("not a\n") == ["a"]
    assert tests("a and (b or c)\n") == ["a", "b or c"]
    assert tests("-a\n") == tests("a == b\n") == tests("f(a)\n") == []
    comp = ast.parse("[x for x in y if p if q]", mode="eval").body
    assert isinstance(comp, ast.ListComp)
    assert [ast.unparse(t) for t in truth_tests(comp.generators[0])] == ["p", "q"]
    assert truth_tests(comp) == []


def test_string_constants_reads_the_nodes_given_not_their_children():
    call = ast.parse("f('a', b'b', 1, g('c'))", mode="eval").body
    assert isinstance(call, ast.Call)
    assert string_constants(call.args) == ["a"]
    assert string_constants(ast.walk(call)) == ["a", "c"]


def test_attribute_assignments_are_the_owner_s_one_target_assignments_with_their_values():
    from k3patch.patches.moriio_chunk_gate.names import attribute_assignments

    init = ast.parse(
        "def __init__(self, other):\n"
        "    self.a = {}\n"
        "    self.b: dict[str, int] = dict()\n"
        "    self.c: int\n"  # no value: not an assignment
        "    self.d = self.e = []\n"  # two targets
        "    other.f = {}\n"
        "    self.a = 1\n"  # a later assignment is another entry
        "    x = self.g = 2\n"
        "    def inner():\n"
        "        self.h = ()\n"
    ).body[0]
    found = [(name, ast.unparse(value)) for name, value in attribute_assignments([init], "self")]
    assert found == [("a", "{}"), ("b", "dict()"), ("a", "1"), ("h", "()")]
    assert [n for n, _ in attribute_assignments([init], "other")] == ["f"]
    assert attribute_assignments([], "self") == []


def test_unbound_names_count_module_builtins_parameters_and_function_bindings():
    module = ast.parse(
        "import os\nif TYPE_CHECKING:\n    import typing\nLIMIT = 1\n\n"
        "def f(a, *, b):\n    c = 1\n    if a:\n        import json\n"
        "    return os, typing, LIMIT, a, b, c, json, len, missing, d\n"
        "    d = 2\n"
    )
    func = module.body[-1]
    assert isinstance(func, ast.FunctionDef)
    # `typing` is bound only for the type checker; `d` is bound (later) somewhere in f.
    assert unbound_names(func.body, module, func) == {"typing", "missing"}


def test_unset_attributes_of_self_in_a_class():
    cls = ast.parse(
        "class C:\n    def __init__(self):\n        self.a = 1\n"
        "    def m(self):\n        return self.a, self.b, self.m, self.c.d\n"
        "    async def n(self):\n        self.e += 1\n"
    ).body[0]
    assert isinstance(cls, ast.ClassDef)
    method = cls.body[1]
    assert unset_attributes([method], cls) == {"b", "c"}
    assert unset_attributes([cls.body[2]], cls) == set()  # `self.e += 1` stores e


def test_combined_verdict_any_drift_wins_agreement_gives_its_verdict_a_mixture_none():
    pending, applied, drifted_ = Verdict.PENDING, Verdict.APPLIED, Verdict.DRIFTED
    assert combined_verdict([pending, pending]) is pending
    assert combined_verdict(iter([applied])) is applied
    assert combined_verdict([applied, drifted_, pending]) is drifted_
    assert combined_verdict([applied, pending]) is None
    assert combined_verdict([]) is None


def test_outline_shows_each_enclosing_header_then_the_inner_lines():
    module = ast.parse("if a:\n    for x in (\n        y\n    ):\n        pass\n")
    branch = module.body[0]
    assert isinstance(branch, ast.If)
    assert outline([branch, branch.body[0]], ["z = 1", "..."]) == (
        "if a:\n    for x in y:\n        z = 1\n        ..."
    )
    assert outline([], ["z = 1"]) == "z = 1"
    assert outline([branch], [], unit="\t") == "if a:"


def test_walk_yields_statements_in_source_order_and_blocks_by_position():
    # The codemod pairs the ast's statements with libcst's by position in this order; a ternary's
    # or a lambda's `body` is an expression, no block.
    module = ast.parse(
        "if a:\n    b = 1\n    for c in d:\n        e = 2\nelse:\n    f = 3\n"
        "try:\n    g = 4\nexcept E:\n    h = 5\nfinally:\n    i = 6\n"
        "def j():\n    k = 7\nm = (lambda: n) if o else p\n"
    )
    lines = [n.lineno for n in walk(module) if isinstance(n, ast.stmt)]
    assert lines == sorted(lines) and len(lines) == 12
    heads = [ast.unparse(block[0]).split("\n")[0] for block in blocks(module)]
    assert heads == ["if a:", "b = 1", "e = 2", "f = 3", "g = 4", "h = 5", "i = 6"]
