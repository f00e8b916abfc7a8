"""Every file a patch reads must parse: one that does not (a syntax error, binary junk,
latin-1, a NUL byte, empty, comments only, too deep for the parser) makes its patch drifted,
named against that file, with nothing written; a patch whose rewrite fails its own checks is
refused on its own. The engine runs in-process over real trees' files read into memory; the
last tests go through the CLI."""

from __future__ import annotations

import functools

import pytest
from conftest import built_fork_tree, pristine_tree, run_cli, slow_after
from disk_setups import AITER, everything, record_of

from k3patch import engine, scan
from k3patch.registry import all_patches
from k3patch.sources import SourceFile, Sources
from k3patch.verdicts import Verdict, summarise

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
    results = scan.classify(patch, Swapped(base_sources(tree), rel, data))
    verdicts = {r.verdict for r in results}
    assert summarise(verdicts) is Verdict.DRIFTED, (kind, results)
    bad = [r for r in results if r.verdict is Verdict.DRIFTED]
    # Named against the file itself, never a sibling (item 14), with the reason.
    assert all(r.file == rel for r in bad), bad
    assert any(reason in r.detail and "restore it from the wheel" in r.detail for r in bad), bad


def test_an_absent_file_is_still_absent():
    """The rule is about files that are there: a patch whose files are all absent is not
    applicable, as before."""
    for patch in all_patches():
        empty = Sources(lambda _: None)
        assert {r.verdict for r in scan.classify(patch, empty)} == {Verdict.NOT_APPLICABLE}


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
    (result,) = scan.classify(patch, sources)
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
    results = scan.classify(patch, Swapped(base, rel, "".join(lines).encode()))
    assert [(r.file, r.verdict) for r in results] == [(rel, Verdict.DRIFTED)], results
    assert "too deeply to analyse" in results[0].detail


# ---------------------------------------------------------------------------------------------
# Item 3: a patch whose rewrite fails its own checks is refused on its own.

CONNECTOR = "distributed/kv_transfer/kv_connector/v1/moriio/moriio_connector.py"


@pytest.fixture(scope="module")
def fork_report():
    """Fork tree a, where all four patches are pending; two of them change CONNECTOR."""
    from k3patch.tree import locate

    report = scan.scan(locate(built_fork_tree("a")), use_record=False)
    assert {
        p.id: v.value for p, v in zip(report.patches, report.verdicts().values(), strict=True)
    } == {p.id: "pending" for p in all_patches()}
    return report


@pytest.fixture(scope="module")
def clean_plan(fork_report):
    return engine.plan(fork_report)


@pytest.fixture(scope="module")
def without_chunk_gate(fork_report):
    """The plan with moriio-chunk-gate held back (as a drifted patch is): what the others write."""
    return engine.plan(fork_report, refused=["moriio-chunk-gate"])


def broken(monkeypatch, patch_id: str, how):
    """Make `patch_id`'s rewrite do `how(original, self, sources, pending, files)` instead."""
    cls = type(next(p for p in all_patches() if p.id == patch_id))
    original = cls.rewrite

    def rewrite(self, sources, pending, files):
        return how(original, self, sources, pending, files)

    monkeypatch.setattr(cls, "rewrite", rewrite)


def raises_after_its_edits(original, self, sources, pending, files):
    original(self, sources, pending, files)  # its codemods are registered on `files` ...
    raise RuntimeError("a bug in the rewrite")  # ... and then it fails


def does_not_compile(original, self, sources, pending, files):
    original(self, sources, pending, files)
    files[CONNECTOR].append_definition("return 1\n")  # parses; compile() refuses it


def changes_nothing_it_should(original, self, sources, pending, files):
    files[CONNECTOR].append_definition("def k3patch_unrelated():\n    return 1\n")


@pytest.mark.parametrize(
    "how, says",
    slow_after(
        [
            (raises_after_its_edits, "rewrite failed: RuntimeError('a bug in the rewrite')"),
            (does_not_compile, "does not compile: 'return' outside function"),
            (changes_nothing_it_should, "reads pending, expected applied"),
        ],
        unpack=True,
    ),
)
def test_a_failing_rewrite_is_left_out_and_poisons_nothing(
    monkeypatch, fork_report, clean_plan, without_chunk_gate, how, says
):
    """moriio-chunk-gate fails after (or instead of) its own edits of moriio_connector.py, which
    moriio-group-routing changes too: the plan names it, leaves its sites pending, and every
    other patch's edits are exactly what they are without it."""
    broken(monkeypatch, "moriio-chunk-gate", how)
    the_plan = engine.plan(fork_report)
    assert (
        list(the_plan.bugs) == ["moriio-chunk-gate"] and says in the_plan.bugs["moriio-chunk-gate"]
    )
    ours = [
        (r.site, r.verdict) for r in the_plan.after_results if r.patch_id == "moriio-chunk-gate"
    ]
    # As classified (pending); its lines are those of the file the others' edits left.
    assert ours == [(r.site, r.verdict) for r in fork_report.for_patch("moriio-chunk-gate")]

    def others(results):
        return [(r.site, r.verdict, r.shape) for r in results if r.patch_id != "moriio-chunk-gate"]

    assert others(the_plan.after_results) == others(clean_plan.after_results)
    # What the others wrote is what they write with moriio-chunk-gate held back.
    assert the_plan.new_texts == without_chunk_gate.new_texts
    assert without_chunk_gate.new_texts[CONNECTOR] != clean_plan.new_texts[CONNECTOR]


def test_apply_writes_the_others_and_exits_2(monkeypatch, fork_tree):
    from conftest import tree_hashes

    from k3patch import exitcodes, state
    from k3patch.tree import locate

    site = fork_tree("a")
    broken(monkeypatch, "moriio-chunk-gate", raises_after_its_edits)
    before = tree_hashes(site)
    tree = locate(str(site))
    held = engine.apply(tree, all_or_nothing=True)
    assert list(held.bugs) == ["moriio-chunk-gate"] and not held.written and held.all_or_nothing
    assert exitcodes.for_apply(held) == 2 and tree_hashes(site) == before

    outcome = engine.apply(tree)
    assert list(outcome.bugs) == ["moriio-chunk-gate"] and exitcodes.for_apply(outcome) == 2
    assert CONNECTOR in outcome.written  # moriio-group-routing's edit of the shared file
    record = state.load(tree.state_dir)
    assert record is not None
    recorded = {r.patch_id: r.verdict for r in record.results if r.patch_id == "moriio-chunk-gate"}
    assert recorded == {"moriio-chunk-gate": Verdict.PENDING}
    # No file is recorded as written by the patch that was left out.
    assert all("moriio-chunk-gate" not in fs.patches for fs in record.files.values())
    assert scan.scan(tree).verdicts() == {
        p.id: Verdict.PENDING if p.id == "moriio-chunk-gate" else Verdict.APPLIED
        for p in all_patches()
    }


# What a user meets: the CLI names the file and what to do, and writes nothing.


@pytest.mark.parametrize(
    "junk, expect",
    [
        (b"def broken(:\n", "does not parse"),
        (b"\x00\x01\x02\xff\xfe binary", "not UTF-8"),
        (b"x = '\xe9t\xe9'\n", "not UTF-8"),
        (b"", "holds no code"),
        (b"x = " + b"-" * 100_000 + b"1\n", "too deeply"),
    ],
)
def test_the_cli_names_a_target_that_is_not_python_and_writes_nothing(make_tree, junk, expect):
    site = make_tree("0.31.0")
    (site / "vllm" / "_aiter_ops.py").write_bytes(junk)
    before = everything(site)
    proc = run_cli("apply", "--vllm", str(site), "--quiet", "--only", "aiter-mla-gfx942")
    assert proc.returncode == 1
    line = record_of(proc.stdout, "k3patch: aiter-mla-gfx942: drifted")
    assert "vllm/_aiter_ops.py" in line and expect in line and "restore it from the wheel" in line
    assert everything(site) == before


def test_deep_expressions_are_drift_not_a_traceback(make_tree):
    """Issue 13 item 11: deep expressions."""
    site = make_tree("0.31.0")
    target = site / "vllm" / AITER
    deep = "x = " + " + ".join(["1"] * 5000) + "\n"
    target.write_text(target.read_text() + deep)
    proc = run_cli("status", "--vllm", str(site), "--json")
    assert proc.returncode == 1, proc.stderr
    assert "too deeply" in proc.stdout and "internal error" not in proc.stdout + proc.stderr
