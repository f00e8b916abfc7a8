"""Property tests: formatting never changes a verdict; a semantic change never reads as a shape
k3patch would patch or has patched.

The inputs are the real target files of a vLLM 0.31.0 wheel, before and after `apply`, reformatted
by ruff at random line lengths and quote styles, with comments and blank lines inserted at
random statement boundaries.
"""

from __future__ import annotations

import ast
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3patch import engine, scan
from k3patch.fingerprints import Shape, source_fingerprint
from k3patch.registry import all_patches
from k3patch.sources import Sources
from k3patch.tree import locate
from k3patch.verdicts import Verdict, summarise

pytestmark = pytest.mark.wheel


def ruff() -> str:
    return shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """(pre-image tree, post-image tree) of 0.31.0 with every landed patch."""
    from conftest import _copy_minimal, pristine_tree

    src = pristine_tree("0.31.0")
    rels = scan.target_files(all_patches())
    pre = tmp_path_factory.mktemp("pre") / "site"
    post = tmp_path_factory.mktemp("post") / "site"
    _copy_minimal(src, pre, rels)
    _copy_minimal(src, post, rels)
    outcome = engine.apply(locate(post))
    assert outcome.written, "nothing was pending on 0.31.0: the post-image test proves nothing"
    return pre, post


def verdicts_of(texts: dict[str, str | None]) -> list[tuple[str, str, str, str]]:
    def reader(rel: str) -> bytes | None:
        text = texts.get(rel)
        return None if text is None else text.encode()

    sources = Sources(reader)
    return sorted(
        (r.patch_id, r.site, r.file, r.verdict.value)
        for p in all_patches()
        for r in scan.classify(p, sources)
    )


def read_texts(site: Path) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for rel in scan.target_files(all_patches()):
        path = site / "vllm" / rel
        out[rel] = path.read_text() if path.exists() else None
    return out


def ruff_format(text: str, line_length: int, quote: str, tmp: Path) -> str:
    path = tmp / "f.py"
    path.write_text(text)
    subprocess.run(
        [
            ruff(),
            "format",
            "--no-cache",
            "--isolated",
            "--line-length",
            str(line_length),
            "--config",
            f"format.quote-style='{quote}'",
            str(path),
        ],
        check=True,
        capture_output=True,
    )
    return path.read_text()


def insert_noise(text: str, rng: random.Random, count: int) -> str:
    """Comments and blank lines before randomly chosen statements, at their indentation."""
    tree = ast.parse(text)
    starts = sorted(
        {
            (n.lineno, n.col_offset)
            for n in ast.walk(tree)
            if isinstance(n, ast.stmt) and not getattr(n, "decorator_list", None)
        }
    )
    lines = text.splitlines(keepends=True)
    for lineno, col in sorted(rng.sample(starts, min(count, len(starts))), reverse=True):
        noise = rng.choice(["# k3patch applied\n", '# a comment, "quoted"\n', "\n"])
        lines.insert(lineno - 1, " " * col + noise if noise.strip() else noise)
    return "".join(lines)


SETTINGS = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@SETTINGS
@given(
    which=st.sampled_from(["pre", "post"]),
    line_length=st.sampled_from([60, 79, 88, 100, 120, 160]),
    quote=st.sampled_from(["single", "double", "preserve"]),
    seed=st.integers(0, 2**32 - 1),
    noise=st.integers(0, 40),
)
def test_formatting_never_changes_a_verdict(
    trees, tmp_path, which, line_length, quote, seed, noise
):
    site = trees[0] if which == "pre" else trees[1]
    texts = read_texts(site)
    expected = verdicts_of(texts)
    rng = random.Random(seed)
    changed = {}
    for rel, text in texts.items():
        if text is None:
            changed[rel] = None
            continue
        formatted = ruff_format(text, line_length, quote, tmp_path)
        changed[rel] = insert_noise(formatted, rng, noise)
    assert verdicts_of(changed) == expected


# ---------------------------------------------------------------------------------------------
# Semantic mutations of the real sites, judged by classify: a change in the code never makes
# unfixed code read fixed, and never makes k3patch's fix read as fixed by someone else.

_SWAPS: list[tuple[type, type]] = [
    (ast.And, ast.Or),
    (ast.Or, ast.And),
    (ast.GtE, ast.Gt),
    (ast.Gt, ast.GtE),
    (ast.Lt, ast.LtE),
    (ast.LtE, ast.Lt),
    (ast.Add, ast.Sub),
    (ast.Sub, ast.Add),
    (ast.Mult, ast.Add),
    (ast.Eq, ast.NotEq),
    (ast.NotEq, ast.Eq),
    (ast.Is, ast.IsNot),
    (ast.In, ast.NotIn),
]


class _Mutator(ast.NodeTransformer):
    """Makes the k-th mutable point of a tree different: an operator, a name, a constant, or a
    `not` dropped."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.seen = 0
        self.done = False

    def _hit(self) -> bool:
        hit = self.seen == self.target and not self.done
        self.seen += 1
        if hit:
            self.done = True
        return hit

    def generic_visit(self, node: ast.AST) -> ast.AST:
        for old, new in _SWAPS:
            if isinstance(node, old) and self._hit():
                return new()
        if isinstance(node, ast.Attribute) and self._hit():
            node.attr += "_x"
        elif isinstance(node, ast.Name) and self._hit():
            node.id += "_x"
        elif isinstance(node, ast.Constant) and isinstance(node.value, int | str) and self._hit():
            node.value = node.value + 1 if isinstance(node.value, int) else node.value + "x"
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and self._hit():
            return super().generic_visit(node.operand)
        return super().generic_visit(node)


def _statement_at(module: ast.Module, line: int) -> ast.stmt | None:
    """The outermost statement that starts at `line` (decorators count as its start)."""
    for node in ast.walk(module):
        if isinstance(node, ast.stmt):
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", []))])
            if first == line or node.lineno == line:
                return node
    return None


@pytest.fixture(scope="module")
def mutation_trees(trees, tmp_path_factory):
    """Real trees in every state: 0.31.0 before/after apply, fork trees a (the fork) and d
    (the older scripts' legacy forms) before and after apply."""
    from conftest import _copy_minimal, built_fork_tree

    found = {"0.31.0 pre": trees[0], "0.31.0 post": trees[1]}
    rels = scan.target_files(all_patches())
    for name in ("a", "d"):
        for state in ("pre", "post"):
            site = tmp_path_factory.mktemp(f"fork-{name}-{state}") / "site"
            _copy_minimal(built_fork_tree(name), site, rels)
            if state == "post":
                assert engine.apply(locate(site)).written
            found[f"fork {name} {state}"] = site
    return found


@pytest.fixture(scope="module")
def mutable_sites(mutation_trees):
    """(tree label, texts, patch, site result) for every located site not 'not applicable'."""
    out = []
    for label, site in mutation_trees.items():
        texts = read_texts(site)
        report = scan.scan(locate(site), use_record=False)
        patches = {p.id: p for p in all_patches()}
        for result in report.results:
            if result.line is None or result.verdict is Verdict.NOT_APPLICABLE:
                continue
            out.append((label, texts, patches[result.patch_id], result))
    assert {r.patch_id for *_, r in out} == {p.id for p in all_patches()}
    return out


STATS = {"draws": 0, "mutated": 0, "changed": 0}
_UNMUTATED: dict[tuple[str, str], list] = {}
_NEVER = {
    # unfixed code must never read fixed or absent
    Verdict.PENDING: {Verdict.APPLIED, Verdict.SATISFIED, Verdict.NOT_APPLICABLE},
    Verdict.DRIFTED: {Verdict.APPLIED, Verdict.SATISFIED, Verdict.NOT_APPLICABLE},
    # k3patch's own fix, changed, must never read as fixed by someone else or as absent
    Verdict.APPLIED: {Verdict.SATISFIED, Verdict.NOT_APPLICABLE},
}


@pytest.mark.slow
@settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_real_sites_never_read_as_a_better_state(mutable_sites, data):
    import textwrap

    # Draw an index, not the entry: a failure then prints a number, not whole vLLM files.
    label, texts, patch, result = mutable_sites[data.draw(st.integers(0, len(mutable_sites) - 1))]
    text = texts[result.file]
    assert text is not None
    stmt = _statement_at(ast.parse(text), result.line or 0)
    assert stmt is not None, (label, result)
    counter = _Mutator(-1)
    counter.visit(ast.parse(ast.unparse(stmt)))
    point = data.draw(st.integers(0, max(counter.seen - 1, 0)))
    STATS["draws"] += 1
    before_dump = ast.dump(stmt)
    mutated = _Mutator(point).visit(stmt)
    if ast.dump(mutated) == before_dump:
        return  # past the last mutable point of this statement
    STATS["mutated"] += 1
    lines = text.splitlines(keepends=True)
    first = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", []))])
    indent = " " * stmt.col_offset
    new_source = textwrap.indent(ast.unparse(ast.fix_missing_locations(mutated)), indent)
    new_text = "".join([*lines[: first - 1], new_source + "\n", *lines[stmt.end_lineno :]])
    changed = dict(texts)
    changed[result.file] = new_text
    if (label, patch.id) not in _UNMUTATED:  # the tree as it is, read once per tree and patch
        _UNMUTATED[label, patch.id] = scan.classify(patch, _sources(texts))
    before_results = _UNMUTATED[label, patch.id]
    before = summarise(r.verdict for r in before_results)
    after_results = scan.classify(patch, _sources(changed))
    after = summarise(r.verdict for r in after_results)
    if after != before or {r.shape for r in after_results} != {r.shape for r in before_results}:
        STATS["changed"] += 1
    assert after not in _NEVER.get(before, set()), (
        f"{label}: {patch.id} {result.site}: mutation {point} turned {before.value} into "
        f"{after.value}"
    )


def _sources(texts: dict[str, str | None]) -> Sources:
    def reader(rel: str) -> bytes | None:
        value = texts.get(rel)
        return None if value is None else value.encode()

    return Sources(reader)


def test_the_mutation_test_really_mutates():
    """Runs after the property test (file order): most draws must change the code, and most
    changes must change what k3patch reads, or the property above proves little."""
    draws, mutated, changed = STATS["draws"], STATS["mutated"], STATS["changed"]
    print(
        f"\nmutation draws: {draws}, code changed: {mutated} ({mutated / max(draws, 1):.0%}), "
        f"verdict or shape changed: {changed} ({changed / max(mutated, 1):.0%} of those)"
    )
    if draws == 0:
        pytest.skip("the property test did not run in this session")
    assert mutated / draws > 0.5
    assert changed / mutated > 0.5


def declared_shapes() -> list[tuple[str, Shape]]:
    import importlib

    found = []
    for patch in all_patches():
        module = importlib.import_module(type(patch).__module__)
        for value in vars(module).values():
            if isinstance(value, Shape):
                found.append((patch.id, value))
            elif (
                isinstance(value, tuple | list)
                and value
                and all(isinstance(v, Shape) for v in value)
            ):
                found.extend((patch.id, v) for v in value)
    return found


def test_declared_shape_fingerprints_are_distinct():
    """Two declared shapes of one patch with the same fingerprint would make the verdict depend
    on table order, whatever their names."""
    seen: dict[tuple[str, str], Shape] = {}
    for patch_id, shape in declared_shapes():
        key = (patch_id, shape.fingerprint)
        other = seen.setdefault(key, shape)
        assert other is shape or other == shape, (patch_id, other.name, shape.name)
    assert source_fingerprint("x = 1") != source_fingerprint("x = 2")
