"""kda-gather-diagnostic as tables: (tree or snippet, expected verdicts), (before, after) and
must-not-touch, through conftest's shared helpers; then the CLI cycle on the fork trees (the
real 0.28.0 wheel + the older scripts), what counts as a sync and as the gate, and the probe,
which must pass on patched code and fail on the fork's own.

Snippets hold only the site statements SITES.md section 3 describes, inside functions of our
own (not vLLM source)."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import (
    FIXTURES,
    assert_untouched,
    classify_files,
    patch_named,
    run_cli,
    sites_of,
    slow_after,
    slow_except,
    tree_hashes,
)
from cycle import assert_full_cycle

from k3patch import verify as verify_mod
from k3patch.codemod import Codemods
from k3patch.patches import kda_gather_diagnostic as kda
from k3patch.patches.kda_gather_diagnostic import sites as kda_sites
from k3patch.patches.kda_gather_diagnostic import syncs
from k3patch.sources import Sources
from k3patch.tree import locate
from k3patch.verdicts import Verdict

PATCH = "kda-gather-diagnostic"
ONLY = ["--only", PATCH]
OPS, PREFILL, LAYER = kda.OPS_FILE, kda.PREFILL_FILE, kda.KDA_FILE
GATE_LINE = 'if os.environ.get("K3_KDA_GATHER_LOG", "0") == "1":'
COMMENT = (
    "# k3patch kda-gather-diagnostic: each bool() below waits for the GPU stream to drain, once\n"
    "# per KDA layer per prefill chunk; the diagnostic runs only with K3_KDA_GATHER_LOG=1.\n"
)

# --------------------------------------------------------------------------------------------
# Snippets. The diagnostic and the guard as SITES.md gives them; the functions around are ours.

DIAG = """\
if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):
    import logging as _lg
    _bad = indices[(indices >= _n_state_blocks) | (indices < 0)]
    _lg.getLogger(__name__).warning(
        "k3-kda guard: %d out of range [0, %d): %s",
        int(_bad.numel()), _n_state_blocks, _bad[:8].tolist(),
    )
"""
LEGACY = "import os as _k3os\nif _k3os.environ.get('K3_KDA_GATHER_LOG', '0') == '1':\n"


def pad(text: str, by: str = "    ") -> str:
    return textwrap.indent(text, by, lambda line: bool(line.strip()))


def gated(diag: str, by: str = "    ") -> str:
    """What k3patch leaves: its comment, its gate, the diagnostic one level in (test's own
    spelling of the post-image, not the patch's code)."""
    return pad(COMMENT + GATE_LINE + "\n" + pad(diag), by)


def ops(diag: str = DIAG, clamp: str = "clamp_", head: str = "import torch\n") -> str:
    return (
        f"{head}\n\ndef gather_initial_states(state, indices, has_initial_state):\n"
        "    row_size = state[0].numel()\n"
        "    assert state[0].is_contiguous()\n"
        "    # k3-kda guard: indices stay inside the pool, on device.\n"
        "    _n_state_blocks = int(state.shape[0])\n"
        "    _safe_idx = torch.where(\n"
        "        has_initial_state,\n"
        f"        indices.to(torch.int64).{clamp}(0, _n_state_blocks - 1),\n"
        "        torch.zeros_like(indices, dtype=torch.int64),\n"
        "    )\n"
        f"{diag}"
        "    indices = _safe_idx\n"
        "    return torch.empty((indices.shape[0], row_size), dtype=state.dtype)\n"
    )


UPSTREAM_OPS = (
    "import torch\n\n\ndef gather_initial_states(state, indices, has_initial_state):\n"
    "    out = torch.empty((indices.shape[0], state[0].numel()), dtype=state.dtype)\n"
    "    return out\n"
)
CALLER_DIAG = DIAG.replace("indices", "state_indices").replace("_n_state_blocks", "pool.shape[0]")


def prefill(diag: str = pad(CALLER_DIAG), head: str = "import torch\n") -> str:
    return (
        f"{head}\n\ndef chunk_kda_prefill(q, pool, state_indices):\n"
        f"{diag}"
        "    return q + pool[state_indices.clamp(0, pool.shape[0] - 1)]\n"
    )


def layer(diag: str = pad(CALLER_DIAG, " " * 8), head: str = "import torch\n") -> str:
    return (
        f"{head}\n\nclass KimiK3DeltaAttention:\n"
        "    def _forward(self, q, pool, state_indices):\n"
        f"{diag}"
        "        return q\n"
    )


# --------------------------------------------------------------------------------------------
# Table 1: (tree or snippet, expected verdict and shape per site).

NA = ("not applicable", "")
FORK = ("pending", "fork, guard script (clamp); fork diagnostic")
TREE_VERDICTS = {
    "fork:a": {"gather_initial_states": FORK},
    "fork:a-comments": {"gather_initial_states": FORK},
    "fork:a-nodebug": {"gather_initial_states": FORK},
    "fork:c": {"gather_initial_states": FORK},
    "fork:b": {
        "gather_initial_states": ("pending", "fork, folded guard (clamp_); fork diagnostic")
    },
    "fork:d": {
        "gather_initial_states": (
            "satisfied",
            "fork, guard script (clamp); older anchor script (k3-kda-nosync)",
        )
    },
    "wheel:0.29.0": {"gather_initial_states": NA},
    "wheel:0.31.0": {"gather_initial_states": NA},
    "wheel:0.33.0": {"gather_initial_states": NA},
    "wheel:0.34.0": {"gather_initial_states": NA},
    "fixture:kda-inlined-caller": {
        "gather_initial_states": NA,
        "chunk_kda_prefill": ("pending", "fork diagnostic"),
        "KimiK3DeltaAttention._forward": ("pending", "fork diagnostic"),
    },
}


@pytest.fixture
def tree_of(make_tree, fork_tree, tmp_path):
    def make(spec: str) -> Path:
        kind, name = spec.split(":")
        if kind == "fork":
            return fork_tree(name)
        if kind == "wheel":
            return make_tree(name)
        shutil.copytree(FIXTURES / name, tmp_path / name)
        return tmp_path / name

    return make


@pytest.mark.wheel
@pytest.mark.parametrize("spec", sorted(TREE_VERDICTS))
def test_tree_verdicts(tree_of, spec):
    found = sites_of(tree_of(spec), *ONLY)
    assert sorted(found) == sorted(s.name for s in kda.SITES)
    for name in found:
        verdict, shape = TREE_VERDICTS[spec].get(name, NA)
        assert (found[name]["verdict"], found[name]["shape"]) == (verdict, shape), name
        if verdict == "not applicable":
            assert found[name]["detail"], "not applicable needs a reason"
    if spec.startswith("wheel:"):
        ops_site = found["gather_initial_states"]
        assert "upstream" in ops_site["detail"] and "masks on device" in ops_site["detail"]


SNIPPET_VERDICTS = {
    "fork's folded guard": (
        {OPS: ops(pad(DIAG))},
        {"gather_initial_states": "pending"},
    ),
    "another log text, other quotes": (
        {OPS: ops(pad(DIAG.replace('"k3-kda guard: %d out of range [0, %d): %s"', "'bad'")))},
        {"gather_initial_states": "pending"},
    ),
    "k3patch's gate": (
        {OPS: ops(gated(DIAG), head="import os\n\nimport torch\n")},
        {"gather_initial_states": "applied"},
    ),
    "the older script's gate, its import in the function": (
        {OPS: ops(pad(LEGACY + pad(DIAG)))},
        {"gather_initial_states": "satisfied"},
    ),
    "the older script's gate, its import at module level": (
        {OPS: ops(pad(LEGACY.split("\n", 1)[1] + pad(DIAG)), head="import os as _k3os\n")},
        {"gather_initial_states": "satisfied"},
    ),
    "a marker comment on unpatched code": (
        {OPS: ops(pad("# k3-kda-nosync\n# K3_KDA_GATHER_LOG\n" + DIAG))},
        {"gather_initial_states": "pending"},
    ),
    "upstream's function": ({OPS: UPSTREAM_OPS}, {"gather_initial_states": "not applicable"}),
    "callers with the inlined diagnostic": (
        {OPS: UPSTREAM_OPS, PREFILL: prefill(), LAYER: layer()},
        {"chunk_kda_prefill": "pending", "KimiK3DeltaAttention._forward": "pending"},
    ),
    "a caller without it": (
        {PREFILL: prefill(diag="")},
        {"chunk_kda_prefill": "not applicable"},
    ),
}


@pytest.mark.parametrize("case", sorted(SNIPPET_VERDICTS))
def test_snippet_verdicts(case):
    files, expected = SNIPPET_VERDICTS[case]
    found = classify_files(PATCH, files)
    for name in found:
        assert found[name].verdict.value == expected.get(name, "not applicable"), name


# --------------------------------------------------------------------------------------------
# Table 2: (before, after) of the codemod, as libcst's CodemodTest.assertCodemod reads. Only the
# files that change are in `after`.


def codemod(files: dict[str, str]) -> dict[str, str]:
    """What the patch's codemod makes of `files` (the changed files only), as the engine runs
    it: one Codemods over the sources, every pending site handed to rewrite."""
    patch = patch_named(PATCH)
    sources = Sources(lambda rel: files[rel].encode() if rel in files else None)
    pending = [r for r in patch.classify(sources) if r.verdict is Verdict.PENDING]
    if not pending:
        return {}
    codemods = Codemods(sources)
    patch.rewrite(sources, pending, codemods)
    return codemods.texts()


def assert_codemod(before: dict[str, str], after: dict[str, str]) -> None:
    """`before` -> `after`; then `after` -> `after`: it reads good, nothing is left pending, so
    a second apply changes nothing (the idempotence proof)."""
    found = classify_files(PATCH, before).values()
    assert any(r.verdict is Verdict.PENDING for r in found), "the test proves nothing"
    assert codemod(before) == after
    again = {**before, **after}
    assert all(r.verdict.is_good for r in classify_files(PATCH, again).values())
    assert codemod(again) == {}


def multiline_message(text: str) -> str:
    """The log text as a triple-quoted string whose second line starts at column 0."""
    return text.replace('"k3-kda guard: %d out of range [0, %d): %s",', '"""bad\nindices: %d""",')


TAB_DIAG = DIAG.replace("    ", "\t")
# libcst's AddImportsVisitor puts `import os` at the end of the module's first import block.
WITH_OS = "import torch\nimport os\n"
FUTURE = '"""Doc."""\nfrom __future__ import annotations\n\n'
BEFORE_AFTER = {
    "fork's folded file": (
        {OPS: ops(pad(DIAG))},
        {OPS: ops(gated(DIAG), head=WITH_OS)},
    ),
    "guard script's clamp": (
        {OPS: ops(pad(DIAG), clamp="clamp")},
        {OPS: ops(gated(DIAG), clamp="clamp", head=WITH_OS)},
    ),
    "existing `import os` is reused": (
        {OPS: ops(pad(DIAG), head="import os\nimport torch\n")},
        {OPS: ops(gated(DIAG), head="import os\nimport torch\n")},
    ),
    "docstring and __future__ kept, `import os` after the imports": (
        {OPS: ops(pad(DIAG), head=FUTURE + "import torch\n")},
        {OPS: ops(gated(DIAG), head=FUTURE + WITH_OS)},
    ),
    "an `import os` below the first import block is not written again": (
        {OPS: ops(pad(DIAG), head="import torch\n\nX = 1\nimport os\n")},
        {OPS: ops(gated(DIAG), head="import torch\n\nX = 1\nimport os\n")},
    ),
    "multi-line log text keeps its value": (
        {OPS: multiline_message(ops(pad(DIAG)))},
        {OPS: multiline_message(ops(gated(DIAG), head=WITH_OS))},
    ),
    "both callers, one `import os` each": (
        {OPS: UPSTREAM_OPS, PREFILL: prefill(), LAYER: layer()},
        {
            PREFILL: prefill(gated(CALLER_DIAG), head=WITH_OS),
            LAYER: layer(gated(CALLER_DIAG, " " * 8), head=WITH_OS),
        },
    ),
    "a CRLF file stays CRLF": (
        {OPS: ops(pad(DIAG)).replace("\n", "\r\n")},
        {OPS: ops(gated(DIAG), head=WITH_OS).replace("\n", "\r\n")},
    ),
    "a tab-indented caller stays tab-indented": (
        {
            PREFILL: prefill(pad(TAB_DIAG.replace("indices", "state_indices"), "\t")).replace(
                "    return", "\treturn"
            )
        },
        {
            PREFILL: prefill(
                "\t"
                + COMMENT.replace("\n#", "\n\t#")
                + "\t"
                + GATE_LINE
                + "\n"
                + pad(TAB_DIAG.replace("indices", "state_indices"), "\t\t"),
                head=WITH_OS,
            ).replace("    return", "\treturn")
        },
    ),
}


@pytest.mark.parametrize("case", sorted(BEFORE_AFTER))
def test_before_after(case):
    before, after = BEFORE_AFTER[case]
    assert_codemod(before, after)


# --------------------------------------------------------------------------------------------
# Table 3: must not touch. Drift (a person must look; k3patch does not guess) and good states.

MUST_NOT_TOUCH = {
    "diagnostic through .item()": (
        {OPS: ops(pad(DIAG.replace("bool((indices < 0).any())", "(indices < 0).any().item()")))},
        "the diagnostic is in no known shape",
    ),
    "diagnostic logs 16 indices": (
        {OPS: ops(pad(DIAG.replace("[:8]", "[:16]")))},
        "no known shape",
    ),
    "error, not warning": ({OPS: ops(pad(DIAG.replace(".warning(", ".error(")))}, "no known shape"),
    "f-string log text": (
        {OPS: ops(pad(DIAG.replace('"k3-kda guard: %d out of range [0, %d): %s"', 'f"{x}"')))},
        "no known shape",
    ),
    "only the upper bound": (
        {OPS: ops(pad(DIAG.replace(" or bool((indices < 0).any())", "")))},
        "no known shape",
    ),
    "clamp bound changed": (
        {OPS: ops(pad(DIAG)).replace("_n_state_blocks - 1)", "_n_state_blocks)")},
        "guard is in no known shape",
    ),
    "diagnostic test replaced": (
        {OPS: ops(pad("if False:\n" + DIAG.split("\n", 1)[1]))},
        "no known shape",
    ),
    "diagnostic deleted": ({OPS: ops("")}, "guard is in no known shape"),
    "`os` bound to something else": (
        {OPS: ops(pad(DIAG), head="import torch\nfrom torch import os\n")},
        "binds `os` to something else",
    ),
    "gate without `import os`": ({OPS: ops(gated(DIAG))}, "NameError"),
    "legacy gate without its import": (
        {OPS: ops(pad(LEGACY.split("\n", 1)[1] + pad(DIAG)))},
        "_k3os",
    ),
    "gate on another variable": (
        {OPS: ops(gated(DIAG).replace("K3_KDA_GATHER_LOG", "K3_OTHER"), head="import os\n")},
        "no known shape",
    ),
    "gate defaulting on": (
        {OPS: ops(gated(DIAG).replace('"0") == "1"', '"1") == "1"'), head="import os\n")},
        "no known shape",
    ),
    "gate with more in it": (
        {OPS: ops(gated(DIAG) + "        print(indices)\n", head="import os\n")},
        "no known shape",
    ),
    "a syncing test without the guard": (
        {
            OPS: UPSTREAM_OPS.replace(
                "    out =",
                "    if bool((indices < 0).any()):\n        indices = indices.abs()\n    out =",
            )
        },
        "fork traces",
    ),
    "one drifted caller blocks the other": (
        {PREFILL: prefill(), LAYER: layer(pad(CALLER_DIAG.replace("[:8]", ""), " " * 8))},
        "no known shape",
    ),
    "the older script's fix": ({OPS: ops(pad(LEGACY + pad(DIAG)))}, ""),
    "already applied": ({OPS: ops(gated(DIAG), head="import os\n")}, ""),
    "upstream": ({OPS: UPSTREAM_OPS}, ""),
}


@pytest.mark.parametrize("case", sorted(MUST_NOT_TOUCH))
def test_must_not_touch(case):
    files, why = MUST_NOT_TOUCH[case]
    for text in files.values():
        compile(text, "snippet", "exec")
    found = assert_untouched(PATCH, files)
    if why:
        (drift,) = [r for r in found.values() if r.verdict.value == "drifted"]
        assert why in drift.detail, drift.detail
        assert drift.found and drift.expected, "a drift report shows what it found and wanted"


def test_a_drift_shows_what_was_found_at_its_first_line_and_what_was_expected():
    text = prefill(pad(CALLER_DIAG.replace("[:8]", "")) + "    X = 1\n")
    (result,) = [r for r in classify_files(PATCH, {PREFILL: text}).values() if r.line]
    assert (result.patch_id, result.site, result.file) == (PATCH, "chunk_kda_prefill", PREFILL)
    assert result.verdict is Verdict.DRIFTED and result.line == 5
    assert result.detail == "the diagnostic is in no known shape; nothing will be written"
    assert result.found == textwrap.dedent(CALLER_DIAG.replace("[:8]", "")).rstrip("\n")
    assert result.expected == tuple(f"{s.name} ({s.verdict.value})" for s in kda.DIAGNOSTIC_SHAPES)


def test_guard_names_are_fixed_inside_gather_initial_states():
    # A caller may name the indices anything; inside the guard they are the guard's own names.
    caller = ast.parse(CALLER_DIAG).body[0]
    assert kda.match_diagnostic(caller) is kda.FORK_DIAGNOSTIC
    assert kda.match_diagnostic(caller, kda.GUARD_NAMES) is None


def test_known_shapes_carry_versions_as_data():
    assert (
        kda_sites.GUARD_FOLDED.versions == kda_sites.GUARD_SCRIPT.versions == kda_sites.FORK_BUILDS
    )
    assert kda_sites.FORK_BUILDS.contains("0.28.0") and not kda_sites.FORK_BUILDS.contains("0.29.0")
    assert kda.APPLIED_DIAGNOSTIC.versions is None, "k3patch's own shape holds on any version"


# --------------------------------------------------------------------------------------------
# The CLI cycle on real trees: check, apply, applied, idempotent, revert byte-identical.


def guard_statements(path: Path) -> list[str]:
    """The exact source text of the clamp and of `... = _safe_idx` in every function of a file."""
    text = path.read_text()
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            if names & {"_n_state_blocks", "_safe_idx"}:
                out.append(ast.get_source_segment(text, node))
    return out


CYCLE = {"fork:b": [OPS], "fork:a": [OPS], "fixture:kda-inlined-caller": [PREFILL, LAYER]}


@pytest.mark.wheel
@pytest.mark.parametrize("spec", slow_after(sorted(CYCLE)))
def test_full_cycle(tree_of, spec):
    tree = tree_of(spec)
    rels = ["vllm/" + rel for rel in CYCLE[spec]]
    guards = {rel: guard_statements(tree / rel) for rel in rels}

    def while_applied(status: dict) -> None:
        for rel in rels:
            text = (tree / rel).read_text()
            assert guard_statements(tree / rel) == guards[rel], "the clamp must stay byte for byte"
            top = [
                a.name for n in ast.parse(text).body if isinstance(n, ast.Import) for a in n.names
            ]
            assert top.count("os") == 1, "exactly one module-level `import os`"
            assert text.count(GATE_LINE) == 1

    assert_full_cycle(tree, PATCH, written=rels, while_applied=while_applied)


@pytest.mark.wheel
def test_drift_on_a_real_tree_is_refused(fork_tree):
    tree = fork_tree("b")
    path = tree / "vllm" / OPS
    path.write_text(path.read_text().replace("_bad[:8].tolist()", "_bad[:16].tolist()"))
    before = tree_hashes(tree)
    proc = run_cli("apply", "--vllm", str(tree), *ONLY)
    assert proc.returncode == 1 and "drifted" in proc.stdout
    assert tree_hashes(tree) == before


@pytest.mark.wheel
def test_older_fix_on_tree_d_is_left_alone(fork_tree):
    tree = fork_tree("d")
    before = (tree / "vllm" / OPS).read_bytes()
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    assert (tree / "vllm" / OPS).read_bytes() == before


def test_reformatted_post_image_still_applied(tmp_path):
    tree = tmp_path / "t"
    shutil.copytree(FIXTURES / "kda-inlined-caller", tree)
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    for rel in (PREFILL, LAYER):
        path = tree / "vllm" / rel
        text = path.read_text()
        subprocess.run([ruff, "format", "--line-length", "79", "--no-cache", str(path)], check=True)
        new = path.read_text()
        assert new != text, "ruff changed nothing: the test proves nothing"
        new = new.replace('"K3_KDA_GATHER_LOG"', "'K3_KDA_GATHER_LOG'").replace(
            "# k3patch kda-gather-diagnostic:", "# reworded by hand:"
        )
        path.write_text(new)
    found = sites_of(tree, *ONLY)
    assert found["chunk_kda_prefill"]["verdict"] == "applied"
    assert found["KimiK3DeltaAttention._forward"]["verdict"] == "applied"


# --------------------------------------------------------------------------------------------
# What counts as a sync, and what counts as the gate.

SYNCS = {
    "bool((x >= n).any())": ["bool() of a tensor"],
    "int(x.max())": ["int() of a tensor"],
    "int(state.shape[0])": [],
    "int(x.numel()) + len(y)": [],
    "x.item()": [".item()"],
    "x[:8].tolist()": [".tolist()"],
    "x.cpu()": [".cpu()"],
    "torch.nonzero(x)": ["torch.nonzero()"],
    "x.nonzero()": [".nonzero()"],
    "x[(x >= n) | (x < 0)]": ["boolean-mask indexing"],
    "x[~m]": ["boolean-mask indexing"],
    "x[y.long()]": [],
    "x[0]": [],
    "assert x.is_contiguous()": [],
    "if (x < 0).any():\n    pass": ["truth value of .any()"],
    "torch.where(m, x.clamp_(0, n - 1), torch.zeros_like(x))": [],
    "def f(a: int | None) -> tuple[int, int | None]:\n    b: dict[str, int | None] = {}": [],
}


@pytest.mark.parametrize("snippet", sorted(SYNCS))
def test_sync_points(snippet):
    found = sorted(kind for _, kind in syncs.sync_points(ast.parse(snippet)))
    assert found == sorted(SYNCS[snippet])


GATES = {
    'os.environ.get("K3_KDA_GATHER_LOG", "0") == "1"': True,
    "_k3os.environ.get('K3_KDA_GATHER_LOG', '0') == '1'": True,
    'os.getenv("K3_KDA_GATHER_LOG") == "1"': True,
    'os.environ.get("K3_KDA_GATHER_LOG", "0") != "1"': False,
    'os.environ.get("K3_KDA_GATHER_LOG", "0") == "0"': False,
    'os.environ.get("OTHER", "0") == "1"': False,
    'os.environ.get("K3_KDA_GATHER_LOG", "1") == "1"': False,
    'os.getenv("K3_KDA_GATHER_LOG", "1") == "1"': False,
    # on when the variable is unset, by keyword: not a gate (it was read as one before)
    'os.getenv("K3_KDA_GATHER_LOG", default="1") == "1"': False,
    'os.environ.get("K3_KDA_GATHER_LOG", default=flag) == "1"': False,
    'os.getenv("K3_KDA_GATHER_LOG", default="0") == "1"': True,
    'os.getenv("K3_KDA_GATHER_LOG", **opts) == "1"': False,
    'os.getenv("K3_KDA_GATHER_LOG", "0", default="0") == "1"': False,
    'bool(x.any()) and os.environ.get("K3_KDA_GATHER_LOG") == "1"': False,
}


@pytest.mark.parametrize("test", sorted(GATES))
def test_gate_recognition(test):
    assert syncs.is_gate(ast.parse(test, mode="eval").body) is GATES[test]


def test_ungated_points_are_reported_with_lines():
    func = ast.parse(
        textwrap.dedent(
            """
            def f(x, n):
                if os.environ.get("K3_KDA_GATHER_LOG", "0") == "1":
                    if bool((x >= n).any()):
                        pass
                else:
                    x.item()
                return x.tolist()
            """
        )
    ).body[0]
    gated_points, ungated = syncs.ungated_sync_points(func)
    assert gated_points == ["bool() of a tensor at line 4"]
    assert sorted(ungated) == [".item() at line 7", ".tolist() at line 8"]


# --------------------------------------------------------------------------------------------
# The probe, in the verify child (the tree's own interpreter: torch on CPU, no GPU).


def run_probe(python: str, root: Path) -> dict:
    """The probe alone, as verify runs it, on whatever code the tree holds."""
    from probe_child import child_args

    args = {**child_args(kda.PATCH), "modules": [kda.OPS_MODULE]}
    result = verify_mod._run_child(python, locate(root), args)
    probe: dict = result["probes"][PATCH]
    return probe


def verify_json(tree: Path, python: str) -> dict:
    proc = run_cli("verify", "--vllm", str(tree), "--python", python, "--json", *ONLY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check: dict = json.loads(proc.stdout)["verify"]["patches"][0]
    return check


@pytest.mark.wheel
@pytest.mark.verify
@pytest.mark.parametrize(
    "spec",
    slow_except(
        ["fork:a", "fixture:kda-inlined-caller", "fork:b"], "fork:a", "fixture:kda-inlined-caller"
    ),
)
def test_verify_passes_once_applied(tree_of, verified, verify_python, spec):
    kind = spec.split(":")[0]
    if kind == "fork":  # every patch applied and verified once per test run (conftest)
        found = verified(spec)
        assert found["apply_rc"] == 0, found["output"]
        check = found["patches"][PATCH]
    else:
        tree = tree_of(spec)
        assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
        check = verify_json(tree, verify_python)
    assert check["modules"][0]["status"] == "ok"
    probe = check["probe"]
    assert probe["ok"] is True, probe
    assert probe["summary"] == (
        "no sync reachable with K3_KDA_GATHER_LOG unset (decided by the AST of every site and "
        "a traced CPU run of gather_initial_states)"
    )
    unset = [c for c in probe["checks"] if "K3_KDA_GATHER_LOG=unset" in c]
    assert unset and all("sync-capable ops: none" in c for c in unset)
    if kind == "fork":
        on = [c for c in probe["checks"] if "K3_KDA_GATHER_LOG=1" in c]
        assert len(on) == 5 and all("rows right" in c for c in on), on
        # With the variable set, the diagnostic syncs and logs each layout with a bad index.
        bad = [c for c in on if "indices in range" not in c]
        assert all("__bool__" in c and "1 warning(s)" in c for c in bad), bad


@pytest.mark.wheel
@pytest.mark.verify
def test_verify_passes_on_the_older_fix(verified):
    check = verified("fork:d")["patches"][PATCH]
    assert check["verdict"] == "satisfied" and check["probe"]["ok"] is True, check


@pytest.mark.wheel
@pytest.mark.verify
@pytest.mark.parametrize(
    "spec",
    slow_except(
        ["fork:a", "fixture:kda-inlined-caller", "fork:b"], "fork:a", "fixture:kda-inlined-caller"
    ),
)
def test_probe_fails_on_the_fork_code(probed, verify_python, spec):
    kind, name = spec.split(":")
    # The fork's probe result is shared with the other patches' tests (one child per tree).
    out = probed(spec, PATCH) if kind == "fork" else run_probe(verify_python, FIXTURES / name)
    assert out["ok"] is False
    assert "reachable with K3_KDA_GATHER_LOG unset" in out["summary"]
    assert "bool() of a tensor" in out["summary"]
    if kind == "fork":
        (traced,) = [c for c in out["checks"] if "unset, indices in range" in c]
        assert "__bool__" in traced and "FAILED" in traced


@pytest.mark.wheel
@pytest.mark.verify
def test_probe_sees_a_lost_clamp(fork_tree, verify_python):
    # Gated, but the clamp no longer bounds the index: the stubbed kernel sees index 9 of 6.
    tree = fork_tree("b", full=True)
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    path = tree / "vllm" / OPS
    path.write_text(path.read_text().replace("_n_state_blocks - 1)", "_n_state_blocks + 9)"))
    out = run_probe(verify_python, tree)
    assert out["ok"] is False
    assert "out-of-range index reached the kernel" in out["summary"]


def test_patch_imports_only_stdlib_and_k3patch_stdlib_modules():
    # The verify child imports the patch with nothing but the stdlib and these k3patch modules;
    # the codemod driver (libcst) only under TYPE_CHECKING, and no text splicing (k3patch.edits).
    allowed = {"k3patch.astkit", "k3patch.fingerprints", "k3patch.patch", "k3patch.probekit"}
    allowed |= {"k3patch.shapes", "k3patch.sources", "k3patch.verdicts"}
    for path in sorted(Path(kda.__file__).parent.glob("*.py")):
        top = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                top |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                top.add(node.module or "")
        outside = {m for m in top if m.split(".")[0] not in sys.stdlib_module_names}
        assert outside <= allowed, (path.name, outside)


def test_fixture_headers_name_the_sites_paragraph():
    paths = sorted(FIXTURES.glob("kda-*/**/*.py"))
    assert len(paths) > 30
    for path in paths:
        head = path.read_text().splitlines()[:4]
        assert head[0].startswith("# k3patch fixture"), path
        assert "SITES.md" in " ".join(head), path
