"""Issue 21, the engine's half: every file a patch reads must parse (items 2 and 14), and a patch
whose rewrite fails its own checks is refused on its own (item 3). In-process: the engine over
real trees' files read into memory, no CLI."""

from __future__ import annotations

import functools

import pytest

from conftest import built_fork_tree, pristine_tree
from k3patch import engine
from k3patch.model import SourceFile, Sources, Verdict
from k3patch.registry import all_patches

pytestmark = pytest.mark.wheel

# What a target file can hold that is not Python source a patch could judge. Each must make
# the patch drifted, naming that file and why.
BAD = {
    "syntax error": (b"def broken(:\n", "does not parse"),
    "binary junk": (b"\x00\x01\x02\xff\xfe binary", "not UTF-8"),
    "latin-1": (b"x = '\xe9t\xe9'\n", "not UTF-8"),
    "NUL byte": (b"x = 1\x00\n", "NUL"),
    "empty": (b"", "holds no code"),
    "comments only": (b"# truncated by a full disk\n\n", "holds no code"),
    "deep unary (MemoryError in the parser)": (b"x = " + b"-" * 100_000 + b"1\n", "too deeply"),
    "deep chain (RecursionError in the parser)": (b"x = 1" + b"+1" * 6000 + b"\n", "too deeply"),
    "deep indentation (a parser limit)": (
        b"".join(b" " * i + b"if x:\n" for i in range(120)) + b" " * 120 + b"pass\n",
        "does not parse",
    ),
}

TREES = {"0.31.0": lambda: pristine_tree("0.31.0"), "fork a": lambda: built_fork_tree("a")}


@functools.cache
def base_sources(tree: str) -> Sources:
    """The real tree's target files, parsed once for every case of this module."""
    package = TREES[tree]() / "vllm"

    def read(rel: str) -> bytes | None:
        path = package / rel
        return path.read_bytes() if path.is_file() else None

    return Sources(read, "0.31.0" if tree == "0.31.0" else "0.28.0")


class Swapped(Sources):
    """A tree's sources with one file's bytes replaced (the others shared, parsed trees too)."""

    def __init__(self, base: Sources, rel: str, data: bytes | None) -> None:
        super().__init__(lambda _: data, base.version)
        self._base = base
        self._rel = rel

    def __getitem__(self, rel: str) -> SourceFile:
        return super().__getitem__(rel) if rel == self._rel else self._base[rel]


CASES = [(p.id, rel) for p in all_patches() for rel in p.files]


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("kind", BAD)
@pytest.mark.parametrize("patch_id, rel", CASES)
def test_a_file_that_does_not_parse_makes_its_patch_drifted(tree, kind, patch_id, rel):
    patch = next(p for p in all_patches() if p.id == patch_id)
    data, reason = BAD[kind]
    results = engine._classify(patch, Swapped(base_sources(tree), rel, data))
    verdicts = {r.verdict for r in results}
    assert engine.summarise(verdicts) is Verdict.DRIFTED, (kind, results)
    bad = [r for r in results if r.verdict is Verdict.DRIFTED]
    # Named against the file itself, never a sibling (item 14), with the reason.
    assert all(r.file == rel for r in bad), bad
    assert any(reason in r.detail and "restore it from the wheel" in r.detail for r in bad), bad


def test_an_absent_file_is_still_absent():
    """The rule is about files that are there: a patch whose files are all absent is not
    applicable, as before."""
    for patch in all_patches():
        empty = Sources(lambda _: None)
        assert {r.verdict for r in engine._classify(patch, empty)} == {Verdict.NOT_APPLICABLE}


def test_too_deep_to_analyse_names_the_deepest_file(monkeypatch):
    """A file that parses but is nested deeper than the analysis can follow (a recursive copy of
    an expression 1,000 operators deep) is reported against itself, whichever file the patch
    was reading when the recursion ran out."""
    patch = next(p for p in all_patches() if len(p.files) == 3)
    deep = b"x = 1" + b"+1" * 1000 + b"\n"
    sources = Swapped(base_sources("fork a"), patch.files[2], deep)

    def classify(self, sources):  # the analysis of the first file runs out of stack
        import copy

        copy.deepcopy(sources[patch.files[2]].tree)
        return []

    monkeypatch.setattr(type(patch), "classify", classify)
    (result,) = engine._classify(patch, sources)
    assert result.verdict is Verdict.DRIFTED and result.file == patch.files[2], result
    assert "too deeply to analyse" in result.detail


def test_real_analysis_recursion_is_drift_of_that_file():
    """The same without a stand-in: an expression 1,000 operators deep inside the function
    aiter-mla-gfx942 judges."""
    patch = next(p for p in all_patches() if p.id == "aiter-mla-gfx942")
    rel = "_aiter_ops.py"
    base = base_sources("fork a")
    site = next(r for r in patch.classify(base) if r.file == rel and r.line)
    lines = base[rel].text.splitlines(keepends=True)
    inside = next(i for i in range(site.line, len(lines)) if lines[i].strip())
    indent = lines[inside][: len(lines[inside]) - len(lines[inside].lstrip())]
    lines.insert(inside, indent + "_deep = 1" + "+1" * 1000 + "\n")
    results = engine._classify(patch, Swapped(base, rel, "".join(lines).encode()))
    assert [(r.file, r.verdict) for r in results] == [(rel, Verdict.DRIFTED)], results
    assert "too deeply to analyse" in results[0].detail
