"""The no-op path reads JSON, METADATA headers and the patches' `files` declarations without
`json` or `re` (their imports cost 5-11 ms of every rank's start-up on Python 3.12). Each lean
reader is held here against the standard-library way it replaces, on generated input."""

from __future__ import annotations

import json
import math
import re
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from k3patch import formats, tree

# -- JSON ------------------------------------------------------------------------------------

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(values, st.sampled_from([None, 0, 2]), st.sampled_from(["", " ", "\n", " \t\r\n"]))
def test_load_json_reads_what_json_writes(value, indent, pad):
    text = pad + json.dumps(value, indent=indent) + pad
    assert formats.load_json(text.encode()) == json.loads(text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='{}[]",:0123456789.eE-+ tnrufalsx\\', max_size=30))
def test_load_json_refuses_what_json_refuses(text):
    try:
        expected = json.loads(text)
    except (ValueError, RecursionError):
        with pytest.raises((ValueError, RecursionError)):
            formats.load_json(text.encode())
    else:
        got = formats.load_json(text.encode())
        assert got == expected or (isinstance(got, float) and math.isnan(got))


@pytest.mark.parametrize(
    "text", ['{"a": 1} x', '{"a": NaN}', "[Infinity]", "", "  ", '{"a": 1}{}', "\ufeff{}"]
)
def test_load_json_refuses_trailing_data_and_constants_k3patch_never_writes(text):
    with pytest.raises(ValueError):
        formats.load_json(text.encode())


def test_load_json_refuses_deep_nesting_without_crashing():
    with pytest.raises((ValueError, RecursionError)):
        formats.load_json(b"[" * 100_000 + b"]" * 100_000)


def test_load_json_falls_back_to_json_without_the_c_scanner(monkeypatch):
    monkeypatch.setitem(sys.modules, "_json", None)  # `from _json import ...` -> ImportError
    assert formats.load_json(b' {"a": [1, 2.5, "x"]} ') == {"a": [1, 2.5, "x"]}
    with pytest.raises(ValueError):
        formats.load_json(b"{")


# -- METADATA headers and _version.py ---------------------------------------------------------

VERSION_LINE = re.compile(r"^Version:\s*(\S+)\s*$", re.MULTILINE)
VERSION_PY = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.M)
LINES = st.lists(
    st.text(alphabet="Version:_ \t0.1a'\"=x", max_size=20)
    | st.sampled_from(
        [
            "Version: 0.31.0",
            "Version:0.9",
            "Version: 0.31 rc1",
            "Version:",
            "Version: \t",
            "__version__ = '0.9.1'",
            "__version__ = ''",
            '__version__ = version = "1.2"',
            "__version__=version='3'",
            "__version__ = \"4'",
        ]
    ),
    max_size=6,
)


@settings(max_examples=500, deadline=None)
@given(LINES)
def test_header_agrees_with_the_metadata_regex(lines):
    text = "\n".join(lines)
    match = VERSION_LINE.search(text)
    expected = match.group(1) if match and "\n" not in match.group(0) else None
    if match is None or "\n" not in match.group(0):  # a value on the next line: regex only
        assert tree._header(text, "Version") == expected


@settings(max_examples=500, deadline=None)
@given(LINES)
def test_version_assignment_agrees_with_the_version_py_regex(lines):
    text = "\n".join(lines)
    match = VERSION_PY.search(text)
    if match is None or "\n" not in match.group(0):
        assert tree._version_assignment(text) == (match.group(1) if match else None)


# -- the patches' `files` declarations ---------------------------------------------------------

NAME = re.compile(r"[A-Z][A-Z0-9_]*")
TUPLE = re.compile(r"\(\s*([A-Z][A-Z0-9_]*\s*(?:,\s*[A-Z][A-Z0-9_]*\s*)*),?\s*\)")
STRING = re.compile(r'(f?)"([^"\\{}]*(?:\{[A-Z][A-Z0-9_]*\}[^"\\{}]*)*)"')
REF = re.compile(r"\{([A-Z][A-Z0-9_]*)\}")


def resolve_with_regexes(text: str, expr: str, depth: int = 0) -> list[str] | None:
    """The regex reading the no-op path used before, kept here as the oracle."""
    if depth > 4:
        return None
    string = STRING.fullmatch(expr)
    if string:
        value = string.group(2)
        if string.group(1):
            parts = {}
            for ref in set(REF.findall(value)):
                got = resolve_with_regexes(text, formats._assigned(text, ref) or "", depth + 1)
                if got is None or len(got) != 1:
                    return None
                parts[ref] = got[0]
            value = REF.sub(lambda m: parts[m.group(1)], value)
        return [value]
    names = TUPLE.fullmatch(expr)
    if names:
        out: list[str] = []
        for name in names.group(1).split(","):
            got = resolve_with_regexes(text, name.strip(), depth + 1)
            if got is None:
                return None
            out += got
        return out
    if NAME.fullmatch(expr):
        return resolve_with_regexes(text, formats._assigned(text, expr) or "", depth + 1)
    return None


SAMPLES = ['f"{A}/{B}.py"', "(A, B,)", "(A,B)", '"x.py"', "A", 'f"{A}{A}"', "(A,,)", "()"]
SAMPLES += ["(f, A)", 'f"{x}.py"', '"}{A}"', 'f"}{A}"', '"{A}}"', "x", "(A, x)", "(A, B)"]
EXPR = st.text(alphabet='AB_1f"{}(), \\x/.', max_size=16) | st.sampled_from(SAMPLES)
MODULE = '\nA = "dir"\nB = f"{A}_b"\nx = "lower"\nf = "f"\nC = (A, B)\nFILES = (A, B,)\n'


@pytest.mark.parametrize("expr", [*SAMPLES, "C", "FILES", "(C,)", 'f"{C}"', "(FILES, A)"])
def test_resolve_agrees_with_the_regexes_on_a_module_of_constants(expr):
    expected = resolve_with_regexes(MODULE, expr)
    assert formats._resolve(MODULE, expr) == expected


def test_resolve_reads_the_declarations_patches_write():
    assert formats._resolve(MODULE, "FILES") == ["dir", "dir_b"]
    assert formats._resolve(MODULE, "(C, B)") is None  # nested past the depth the reader follows
    assert formats._resolve(MODULE, 'f"{A}/{B}.py"') == ["dir/dir_b.py"]
    assert formats._resolve(MODULE, "(A, x)") is None  # a lower-case name is not a constant


@settings(max_examples=1000, deadline=None)
@given(EXPR, st.lists(st.tuples(st.sampled_from(["A", "B", "A_1", "f", "x"]), EXPR), max_size=4))
def test_resolve_agrees_with_the_regexes(expr, assignments):
    text = "\n" + "\n".join(f"{name} = {value}" for name, value in assignments) + "\n"
    assert formats._resolve(text, expr) == resolve_with_regexes(text, expr)


# -- JSON out -----------------------------------------------------------------------------------

out_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=500, deadline=None)
@given(out_values)
def test_dump_json_writes_what_json_dumps_writes(value):
    assert formats.dump_json(value) == json.dumps(value, indent=2)


@pytest.mark.parametrize("value", [{1: "a"}, {"a": {None: 1}}, [object()], {"s": {1, 2}}])
def test_dump_json_leaves_what_it_does_not_know_to_json(value):
    try:
        expected: object = json.dumps(value, indent=2)
    except TypeError as exc:
        expected = type(exc)
    try:
        got: object = formats.dump_json(value)
    except TypeError as exc:
        got = type(exc)
    assert got == expected


def test_dump_json_of_a_cycle_fails_as_json_does():
    cycle: list[object] = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="Circular"):
        formats.dump_json(cycle)


def test_dump_json_without_the_c_escaper(monkeypatch):
    monkeypatch.setitem(sys.modules, "_json", None)
    assert formats.dump_json({"a": ["é", 1.5, None]}) == json.dumps(
        {"a": ["é", 1.5, None]}, indent=2
    )


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=5000), st.integers(1, 7))
def test_sha256_is_hashlibs(data, pieces):
    import hashlib

    digest = formats.sha256()
    step = max(1, len(data) // pieces)
    for i in range(0, len(data), step):
        digest.update(data[i : i + step])
    assert digest.hexdigest() == hashlib.sha256(data).hexdigest()
    assert formats.sha256(data).hexdigest() == hashlib.sha256(data).hexdigest()
