"""kda-gather-diagnostic on the hand-written fork fixtures and the real 0.29/0.31/0.33 wheels:
verdicts, the pending -> applied -> revert cycle, the clamp left exactly as it was, one
`import os`, formatting insensitivity, marker comments, drift refusal, and the probe (which must
pass on patched code and fail on the fork's own)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import FIXTURES, run_cli, tree_hashes
from conftest import sites_of as _sites_of
from conftest import status_json as _status_json
from k3patch.patches import kda_gather_diagnostic as kda

from k3patch import model
from k3patch.registry import patch_module_file

ONLY = ["--only", "kda-gather-diagnostic"]
OPS = "vllm/" + kda.OPS_FILE
PREFILL = "vllm/" + kda.PREFILL_FILE
LAYER = "vllm/" + kda.KDA_FILE
SITE_NAMES = [s.name for s in kda.SITES]


def copy_fixture(name: str, tmp_path: Path) -> Path:
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def status_json(tree: Path) -> dict:
    return _status_json(tree, *ONLY)


def sites_of(tree: Path) -> dict[str, dict]:
    return _sites_of(tree, *ONLY)


def source_hashes(tree: Path) -> dict[str, str]:
    """Hashes of the tree's own files; k3patch's state record beside them does not count."""
    return {rel: h for rel, h in tree_hashes(tree).items() if not rel.startswith("vllm/.k3patch")}


# --------------------------------------------------------------------------------------------
# Verdicts of every fixture and of the real wheels.

FIXTURE_VERDICTS = {
    "kda-fork-folded": {
        "gather_initial_states": ("pending", "fork, folded guard (clamp_); fork diagnostic"),
        "chunk_kda_prefill": ("not applicable", ""),
        "KimiK3DeltaAttention._forward": ("not applicable", ""),
    },
    "kda-fork-guard-script": {
        "gather_initial_states": ("pending", "fork, guard script (clamp); fork diagnostic"),
        "chunk_kda_prefill": ("not applicable", ""),
        "KimiK3DeltaAttention._forward": ("not applicable", ""),
    },
    "kda-legacy-nosync": {
        "gather_initial_states": (
            "satisfied",
            "fork, folded guard (clamp_); older anchor script (k3-kda-nosync)",
        ),
        "chunk_kda_prefill": ("not applicable", ""),
        "KimiK3DeltaAttention._forward": ("not applicable", ""),
    },
    "kda-inlined-caller": {
        "gather_initial_states": ("not applicable", ""),
        "chunk_kda_prefill": ("pending", "fork diagnostic"),
        "KimiK3DeltaAttention._forward": ("pending", "fork diagnostic"),
    },
}


@pytest.mark.parametrize("fixture", sorted(FIXTURE_VERDICTS))
def test_fixture_verdicts(fixture, tmp_path):
    tree = copy_fixture(fixture, tmp_path)
    found = sites_of(tree)
    assert sorted(found) == sorted(SITE_NAMES)
    for name, (verdict, shape) in FIXTURE_VERDICTS[fixture].items():
        assert (found[name]["verdict"], found[name]["shape"]) == (verdict, shape), name
        if verdict == "not applicable":
            assert found[name]["detail"], "not applicable needs a reason"


@pytest.mark.wheel
@pytest.mark.parametrize("version", ["0.29.0", "0.31.0", "0.33.0"])
def test_upstream_wheels_are_not_applicable(make_tree, version):
    site = make_tree(version)
    assert (site / OPS).is_file(), "the upstream file exists: this is not 'file absent'"
    before = source_hashes(site)
    found = sites_of(site)
    ops = found["gather_initial_states"]
    assert ops["verdict"] == "not applicable"
    assert "upstream" in ops["detail"] and "masks on device" in ops["detail"]
    for name in ("chunk_kda_prefill", "KimiK3DeltaAttention._forward"):
        assert found[name]["verdict"] == "not applicable", name
        assert found[name]["detail"]
    proc = run_cli("apply", "--vllm", str(site), *ONLY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert source_hashes(site) == before, "nothing to do must write nothing"


# --------------------------------------------------------------------------------------------
# The full cycle on the fork fixtures.

CHANGED = {
    "kda-fork-folded": [OPS],
    "kda-fork-guard-script": [OPS],
    "kda-inlined-caller": [PREFILL, LAYER],
}


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


@pytest.mark.parametrize("fixture", sorted(CHANGED))
def test_full_cycle(fixture, tmp_path):
    tree = copy_fixture(fixture, tmp_path)
    original = tree_hashes(tree)
    guards = {rel: guard_statements(tree / rel) for rel in CHANGED[fixture]}

    before = status_json(tree)
    assert before["_rc"] == 1
    assert before["patches"][0]["verdict"] == "pending"

    check = run_cli("apply", "--vllm", str(tree), "--check", *ONLY)
    assert check.returncode == 1
    assert tree_hashes(tree) == original, "--check wrote something"

    first = run_cli("apply", "--vllm", str(tree), *ONLY)
    assert first.returncode == 0, first.stdout + first.stderr
    after = status_json(tree)
    assert after["_rc"] == 0
    assert after["patches"][0]["verdict"] == "applied"
    changed = {rel for rel, digest in tree_hashes(tree).items() if original.get(rel) != digest}
    assert {c for c in changed if not c.startswith("vllm/.k3patch")} == set(CHANGED[fixture])

    for rel in CHANGED[fixture]:
        text = (tree / rel).read_text()
        # The clamp and the reassignment are byte-for-byte what they were.
        assert guard_statements(tree / rel) == guards[rel]
        module = ast.parse(text)
        top_imports = [
            a.name
            for n in module.body
            if isinstance(n, ast.Import)
            for a in n.names
            if a.name == "os"
        ]
        assert top_imports == ["os"], "exactly one module-level `import os`"
        assert text.count('os.environ.get("K3_KDA_GATHER_LOG", "0") == "1"') == 1

    once = tree_hashes(tree)
    second = run_cli("apply", "--vllm", str(tree), *ONLY)
    assert second.returncode == 0
    assert tree_hashes(tree) == once, "a second apply changed bytes"

    back = run_cli("revert", "--vllm", str(tree))
    assert back.returncode == 0, back.stdout + back.stderr
    assert tree_hashes(tree) == original, "revert is not byte-identical"


def test_gate_sits_where_the_diagnostic_was(tmp_path):
    tree = copy_fixture("kda-fork-folded", tmp_path)
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    module = ast.parse((tree / OPS).read_text())
    func = kda.find_site_function(module, kda.SITES[0])
    body = [ast.unparse(s) for s in func.body]
    start = body.index("_n_state_blocks = int(state.shape[0])")
    gate = func.body[start + 2]
    assert isinstance(gate, ast.If) and kda.is_gate(gate.test)
    assert len(gate.body) == 1 and not gate.orelse
    assert kda.match_diagnostic(gate.body[0], kda.GUARD_NAMES) is kda.FORK_DIAGNOSTIC
    assert body[start + 3] == "indices = _safe_idx"


def test_legacy_fixed_form_is_left_alone(tmp_path):
    tree = copy_fixture("kda-legacy-nosync", tmp_path)
    before = source_hashes(tree)
    proc = run_cli("apply", "--vllm", str(tree), *ONLY)
    assert proc.returncode == 0
    assert source_hashes(tree) == before


def test_existing_import_os_is_reused(tmp_path):
    tree = copy_fixture("kda-fork-folded", tmp_path)
    path = tree / OPS
    path.write_text(path.read_text().replace("import torch\n", "import os\nimport torch\n", 1))
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    assert path.read_text().count("import os\n") == 1


# --------------------------------------------------------------------------------------------
# Fingerprints, not markers: formatting never matters, comments never count.


def test_reformatted_post_image_still_applied(tmp_path):
    tree = copy_fixture("kda-inlined-caller", tmp_path)
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    for rel in (PREFILL, LAYER):
        path = tree / rel
        text = path.read_text()
        subprocess.run([ruff, "format", "--line-length", "79", "--no-cache", str(path)], check=True)
        new = path.read_text()
        assert new != text, "ruff changed nothing: the test proves nothing"
        new = new.replace('"K3_KDA_GATHER_LOG"', "'K3_KDA_GATHER_LOG'").replace(
            "# k3patch kda-gather-diagnostic:", "# reworded by hand:"
        )
        path.write_text(new)
    found = sites_of(tree)
    assert found["chunk_kda_prefill"]["verdict"] == "applied"
    assert found["KimiK3DeltaAttention._forward"]["verdict"] == "applied"


@pytest.mark.parametrize(
    "comment",
    ["# k3-kda-nosync", "# k3patch kda-gather-diagnostic: applied", "# K3_KDA_GATHER_LOG"],
)
def test_marker_comment_on_unpatched_code_is_pending(tmp_path, comment):
    tree = copy_fixture("kda-fork-folded", tmp_path)
    path = tree / OPS
    text = path.read_text()
    anchor = "    if bool((indices >= _n_state_blocks).any())"
    path.write_text(text.replace(anchor, f"    {comment}\n{anchor}"))
    assert sites_of(tree)["gather_initial_states"]["verdict"] == "pending"


# --------------------------------------------------------------------------------------------
# Drift: the site is there, in a shape k3patch does not know. Nothing is written.

OPS_DRIFTS = {
    "diagnostic through .item()": (
        "bool((indices < 0).any())",
        "(indices < 0).any().item()",
        "the diagnostic is in no known shape",
    ),
    "diagnostic logs 16 indices": ("_bad[:8].tolist()", "_bad[:16].tolist()", "no known shape"),
    "clamp bound changed": (
        ".clamp_(0, _n_state_blocks - 1)",
        ".clamp_(0, _n_state_blocks)",
        "guard is in no known shape",
    ),
    "diagnostic test replaced": (
        "    if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):\n",
        "    if False:\n",
        "no known shape",
    ),
    "`os` bound to something else": (
        "import torch\n",
        "import torch\nfrom torch import os\n",
        "binds `os` to something else",
    ),
}


@pytest.mark.parametrize("case", sorted(OPS_DRIFTS))
def test_drift_in_gather_initial_states_is_refused(tmp_path, case):
    old, new, why = OPS_DRIFTS[case]
    tree = copy_fixture("kda-fork-folded", tmp_path)
    path = tree / OPS
    text = path.read_text()
    assert old in text
    text = text.replace(old, new, 1)
    compile(text, str(path), "exec")
    path.write_text(text)
    assert_refused(tree, why)


def assert_refused(tree: Path, why: str) -> None:
    before = tree_hashes(tree)
    data = status_json(tree)
    assert data["_rc"] == 1
    site = next(s for s in data["patches"][0]["sites"] if s["site"] == "gather_initial_states")
    assert site["verdict"] == "drifted", site
    assert why in site["detail"]
    assert site["found"], "a drift report must show what was found"
    assert site["expected"], "a drift report must say what was expected"
    proc = run_cli("apply", "--vllm", str(tree), *ONLY)
    assert proc.returncode == 1
    assert "drifted" in proc.stdout
    assert tree_hashes(tree) == before


def test_deleted_diagnostic_is_drift(tmp_path):
    # Sync-free, but not a shape anyone described: a person has to look, k3patch does not guess.
    tree = copy_fixture("kda-fork-folded", tmp_path)
    path = tree / OPS
    text = path.read_text()
    start = text.index("    if bool((indices >= _n_state_blocks).any())")
    path.write_text(text[:start] + text[text.index("    indices = _safe_idx") :])
    assert_refused(tree, "guard is in no known shape")


def test_gate_without_import_os_is_drift(tmp_path):
    tree = copy_fixture("kda-fork-folded", tmp_path)
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    assert run_cli("revert", "--vllm", str(tree)).returncode == 0
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    path = tree / OPS
    path.write_text(path.read_text().replace("import os\n\n", "", 1))
    assert_refused(tree, "NameError")


def test_syncing_test_without_the_guard_is_drift_not_upstream(tmp_path):
    # Upstream-shaped function plus an ad-hoc syncing check: not upstream, not the fork either.
    tree = copy_fixture("kda-inlined-caller", tmp_path)
    path = tree / OPS
    text = path.read_text()
    anchor = "    output = torch.empty("
    path.write_text(
        text.replace(
            anchor, "    if bool((indices < 0).any()):\n        indices = indices.abs()\n" + anchor
        )
    )
    before = tree_hashes(tree)
    site = sites_of(tree)["gather_initial_states"]
    assert site["verdict"] == "drifted"
    assert "indices.abs()" in site["found"]
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 1
    assert tree_hashes(tree) == before


def test_legacy_gate_without_its_import_is_drift(tmp_path):
    tree = copy_fixture("kda-legacy-nosync", tmp_path)
    path = tree / OPS
    path.write_text(path.read_text().replace("    import os as _k3os\n", ""))
    site = sites_of(tree)["gather_initial_states"]
    assert site["verdict"] == "drifted"
    assert "_k3os" in site["detail"]


def test_legacy_import_at_module_level_is_satisfied(tmp_path):
    tree = copy_fixture("kda-legacy-nosync", tmp_path)
    path = tree / OPS
    text = path.read_text().replace("    import os as _k3os\n", "")
    path.write_text(text.replace("import torch\n", "import os as _k3os\nimport torch\n", 1))
    assert sites_of(tree)["gather_initial_states"]["verdict"] == "satisfied"


def test_one_drifted_caller_blocks_the_other(tmp_path):
    tree = copy_fixture("kda-inlined-caller", tmp_path)
    path = tree / LAYER
    path.write_text(path.read_text().replace("_bad[:8].tolist()", "_bad.tolist()"))
    before = tree_hashes(tree)
    found = sites_of(tree)
    assert found["KimiK3DeltaAttention._forward"]["verdict"] == "drifted"
    assert found["chunk_kda_prefill"]["verdict"] == "pending"
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 1
    assert tree_hashes(tree) == before


# --------------------------------------------------------------------------------------------
# The shape table: what must match, what must not.

DIAG = textwrap.dedent(
    """
    if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):
        import logging as _lg

        _bad = indices[(indices >= _n_state_blocks) | (indices < 0)]
        _lg.getLogger(__name__).warning(
            "k3-kda guard: %d out of range [0, %d): %s",
            int(_bad.numel()),
            _n_state_blocks,
            _bad[:8].tolist(),
        )
    """
)


def first_if(source: str) -> ast.If:
    node = ast.parse(textwrap.dedent(source)).body[0]
    assert isinstance(node, ast.If)
    return node


MUST_MATCH = {
    "as the fork writes it": (DIAG, kda.FORK_DIAGNOSTIC),
    "another log text, other quotes": (
        DIAG.replace('"k3-kda guard: %d out of range [0, %d): %s"', "'bad: %d / %d: %s'"),
        kda.FORK_DIAGNOSTIC,
    ),
    "a caller's names": (
        DIAG.replace("indices", "state_indices").replace("_n_state_blocks", "pool.shape[0]"),
        kda.FORK_DIAGNOSTIC,
    ),
    "k3patch's gate": (
        'if os.environ.get("K3_KDA_GATHER_LOG", "0") == "1":\n' + textwrap.indent(DIAG, "    "),
        kda.APPLIED_DIAGNOSTIC,
    ),
    "the older script's gate": (
        "if _k3os.environ.get('K3_KDA_GATHER_LOG', '0') == '1':\n" + textwrap.indent(DIAG, "    "),
        kda.LEGACY_DIAGNOSTIC,
    ),
}

MUST_NOT_MATCH = {
    ".item() instead of bool()": DIAG.replace(
        "bool((indices < 0).any())", "(indices < 0).any().item()"
    ),
    "> instead of >=": DIAG.replace(
        "(indices >= _n_state_blocks).any()", "(indices > _n_state_blocks).any()"
    ),
    "only the upper bound": DIAG.replace(" or bool((indices < 0).any())", ""),
    "logs 16": DIAG.replace("[:8]", "[:16]"),
    "error, not warning": DIAG.replace(".warning(", ".error("),
    "f-string log": DIAG.replace(
        '"k3-kda guard: %d out of range [0, %d): %s",', 'f"{_n_state_blocks}",'
    ),
    "gate on another variable": (
        'if os.environ.get("K3_OTHER", "0") == "1":\n' + textwrap.indent(DIAG, "    ")
    ),
    "gate defaulting on": (
        'if os.environ.get("K3_KDA_GATHER_LOG", "1") == "1":\n' + textwrap.indent(DIAG, "    ")
    ),
    "gate with more in it": (
        'if os.environ.get("K3_KDA_GATHER_LOG", "0") == "1":\n'
        + textwrap.indent(DIAG, "    ")
        + "    print(indices)\n"
    ),
}


@pytest.mark.parametrize("case", sorted(MUST_MATCH))
def test_shapes_that_match(case):
    source, shape = MUST_MATCH[case]
    assert kda.match_diagnostic(first_if(source)) is shape


@pytest.mark.parametrize("case", sorted(MUST_NOT_MATCH))
def test_near_misses_match_nothing(case):
    assert kda.match_diagnostic(first_if(MUST_NOT_MATCH[case])) is None


def test_guard_names_are_fixed_inside_gather_initial_states():
    caller = DIAG.replace("indices", "state_indices")
    assert kda.match_diagnostic(first_if(caller)) is kda.FORK_DIAGNOSTIC
    assert kda.match_diagnostic(first_if(caller), kda.GUARD_NAMES) is None


def test_guard_shapes_differ_only_in_the_clamp():
    assert kda.GUARD_FOLDED.fingerprint != kda.GUARD_SCRIPT.fingerprint
    assert kda.GUARD_FOLDED.source.replace(".clamp_(", ".clamp(") == kda.GUARD_SCRIPT.source


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
    found = sorted(kind for _, kind in kda.sync_points(ast.parse(snippet)))
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
    'bool(x.any()) and os.environ.get("K3_KDA_GATHER_LOG") == "1"': False,
}


@pytest.mark.parametrize("test", sorted(GATES))
def test_gate_recognition(test):
    assert kda.is_gate(ast.parse(test, mode="eval").body) is GATES[test]


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
    gated, ungated = kda.ungated_sync_points(func)
    assert gated == ["bool() of a tensor at line 4"]
    assert sorted(ungated) == [".item() at line 7", ".tolist() at line 8"]


# --------------------------------------------------------------------------------------------
# `import os`: once, where isort would put it, never over an existing one.

IMPORTS = {
    "third-party first": ("import torch\n", "import os\n\nimport torch\n"),
    "stdlib first": ("import logging\nimport torch\n", "import os\nimport logging\nimport torch\n"),
    "after docstring and __future__": (
        '"""Doc."""\nfrom __future__ import annotations\n\nimport torch\n',
        '"""Doc."""\nfrom __future__ import annotations\n\nimport os\n\nimport torch\n',
    ),
    "already there": ("import os\nimport torch\n", "import os\nimport torch\n"),
    "os.path counts": ("import os.path\nimport torch\n", "import os.path\nimport torch\n"),
}


@pytest.mark.parametrize("case", sorted(IMPORTS))
def test_import_os_placement(case):
    before, after = IMPORTS[case]
    assert kda.gate_diagnostics(before, ast.parse(before), []) == after


def test_gating_keeps_multiline_string_content():
    source = textwrap.dedent(
        '''
        def f(indices, _n_state_blocks):
            if bool((indices >= _n_state_blocks).any()) or bool((indices < 0).any()):
                import logging as _lg

                _bad = indices[(indices >= _n_state_blocks) | (indices < 0)]
                _lg.getLogger(__name__).warning(
                    """bad
        indices: %d %d %s""",
                    int(_bad.numel()),
                    _n_state_blocks,
                    _bad[:8].tolist(),
                )
        '''
    ).lstrip()
    tree = ast.parse(source)
    diag = tree.body[0].body[0]
    new = kda.gate_diagnostics(source, tree, [diag])
    message = [n.value for n in ast.walk(ast.parse(new)) if isinstance(n, ast.Constant)]
    assert "bad\nindices: %d %d %s" in message
    gated = ast.parse(new).body[1].body[0]
    assert kda.match_diagnostic(gated) is kda.APPLIED_DIAGNOSTIC


# --------------------------------------------------------------------------------------------
# The probe, in the tree's own interpreter (torch on CPU, no GPU).

PROBE_RUNNER = r"""
import importlib.util, json, sys, types
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
for name in ("k3patch", "k3patch.patches"):
    package = types.ModuleType(name)
    package.__path__ = []
    sys.modules[name] = package
load("k3patch.model", sys.argv[1])
outcome = load("k3patch.patches._kda_probe", sys.argv[2]).PATCH.probe()
print(json.dumps({"ok": outcome.ok, "summary": outcome.summary, "checks": list(outcome.checks)}))
"""


def run_probe(python: str, tree: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("K3_KDA_GATHER_LOG", None)
    proc = subprocess.run(
        [python, "-c", PROBE_RUNNER, model.__file__, str(patch_module_file(kda.PATCH))],
        capture_output=True,
        text=True,
        env=env,
        cwd=tree,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.verify
@pytest.mark.parametrize(
    "fixture", ["kda-fork-folded", "kda-fork-guard-script", "kda-inlined-caller"]
)
def test_verify_passes_once_applied(tmp_path, verify_python, fixture):
    tree = copy_fixture(fixture, tmp_path)
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    proc = run_cli("verify", "--vllm", str(tree), "--python", verify_python, "--json", *ONLY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    check = json.loads(proc.stdout)["verify"]["patches"][0]
    assert check["modules"][0]["status"] == "ok"
    probe = check["probe"]
    assert probe["ok"] is True, probe
    assert "AST of every site and a traced CPU run" in probe["summary"]
    unset = [c for c in probe["checks"] if "K3_KDA_GATHER_LOG=unset" in c]
    assert unset and all("sync-capable ops: none" in c for c in unset)
    if fixture != "kda-inlined-caller":
        (on,) = [c for c in probe["checks"] if "K3_KDA_GATHER_LOG=1" in c]
        assert "__bool__" in on and "1 warning(s)" in on and "rows right" in on


@pytest.mark.verify
def test_verify_passes_on_the_legacy_form(tmp_path, verify_python):
    tree = copy_fixture("kda-legacy-nosync", tmp_path)
    proc = run_cli("verify", "--vllm", str(tree), "--python", verify_python, "--json", *ONLY)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["verify"]["patches"][0]["probe"]["ok"] is True


@pytest.mark.verify
@pytest.mark.parametrize("fixture", ["kda-fork-folded", "kda-inlined-caller"])
def test_probe_fails_on_the_fork_code(tmp_path, verify_python, fixture):
    tree = copy_fixture(fixture, tmp_path)
    out = run_probe(verify_python, tree)
    assert out["ok"] is False
    assert "reachable with K3_KDA_GATHER_LOG unset" in out["summary"]
    assert "bool() of a tensor" in out["summary"]
    if fixture == "kda-fork-folded":
        (traced,) = [c for c in out["checks"] if "unset, indices in range" in c]
        assert "__bool__" in traced


@pytest.mark.verify
def test_probe_sees_a_lost_clamp(tmp_path, verify_python):
    # Gated, but the clamp no longer bounds the index: the stubbed kernel sees index 9 of 6.
    tree = copy_fixture("kda-fork-folded", tmp_path)
    assert run_cli("apply", "--vllm", str(tree), *ONLY).returncode == 0
    path = tree / OPS
    path.write_text(path.read_text().replace("_n_state_blocks - 1)", "_n_state_blocks + 9)"))
    out = run_probe(verify_python, tree)
    assert out["ok"] is False
    assert "out-of-range index reached the kernel" in out["summary"]


def test_patch_module_imports_only_stdlib_and_model():
    # The verify child loads this file by path with nothing but the stdlib and k3patch.model.
    tree = ast.parse(Path(patch_module_file(kda.PATCH)).read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            top.add(node.module or "")
    outside = {m for m in top if m.split(".")[0] not in sys.stdlib_module_names}
    assert outside == {"k3patch.model"}


def test_fixture_headers_name_the_sites_paragraph():
    paths = sorted(FIXTURES.glob("kda-*/**/*.py"))
    assert len(paths) > 30
    for path in paths:
        head = path.read_text().splitlines()[:4]
        assert head[0].startswith("# k3patch fixture"), path
        assert "SITES.md" in " ".join(head), path
