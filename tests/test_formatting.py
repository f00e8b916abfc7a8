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

from k3patch import engine
from k3patch.model import Shape, Sources, Verdict, site_fingerprint, source_fingerprint
from k3patch.registry import all_patches
from k3patch.tree import locate

pytestmark = pytest.mark.wheel


def ruff() -> str:
    return shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """(pre-image tree, post-image tree) of 0.31.0 with every landed patch."""
    from conftest import _copy_minimal, pristine_tree

    src = pristine_tree("0.31.0")
    rels = engine.target_files(all_patches())
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
        for r in engine._classify(p, sources)
    )


def read_texts(site: Path) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for rel in engine.target_files(all_patches()):
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
# Semantic mutations of declared shapes: never a pending or applied shape.

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


SHAPES = declared_shapes()


def test_some_shapes_are_declared():
    assert any(s.verdict is Verdict.PENDING for _, s in SHAPES)
    assert any(s.verdict is Verdict.APPLIED for _, s in SHAPES)


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, max(len(SHAPES) - 1, 0)), point=st.integers(0, 400))
def test_mutated_shapes_never_match_a_patchable_shape(index, point):
    patch_id, shape = SHAPES[index]
    import textwrap

    tree = ast.parse(textwrap.dedent(shape.source))
    before = ast.dump(tree)
    mutated = _Mutator(point).visit(tree)
    ast.fix_missing_locations(mutated)
    if ast.dump(mutated) == before:
        return  # the point index was past the last mutable point
    body = mutated.body
    fingerprint = site_fingerprint(body[0] if len(body) == 1 else body)
    same_patch = [s for p, s in SHAPES if p == patch_id]
    matched = [s for s in same_patch if s.fingerprint == fingerprint]
    assert not [s for s in matched if s.verdict in (Verdict.PENDING, Verdict.APPLIED)], (
        f"{patch_id}: a mutation of {shape.name!r} reads as {[s.name for s in matched]}"
    )


def test_shape_fingerprints_are_distinct():
    seen: dict[str, str] = {}
    for patch_id, shape in SHAPES:
        key = f"{patch_id}:{shape.fingerprint}"
        assert key not in seen or seen[key] == shape.name, (seen.get(key), shape.name)
        seen[key] = shape.name
    assert source_fingerprint("x = 1") != source_fingerprint("x = 2")
