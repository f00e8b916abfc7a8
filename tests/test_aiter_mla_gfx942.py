"""aiter-mla-gfx942 on real vLLM wheels: the full pending -> apply -> applied -> revert cycle,
formatting insensitivity, marker comments, semantic drift, and missing preconditions."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, slow_after, slow_except, tree_hashes
from conftest import status_json as _status_json
from cycle import assert_full_cycle

from k3patch.fingerprints import source_fingerprint
from k3patch.patches import aiter_mla_gfx942 as aiter
from k3patch.patches.aiter_mla_gfx942 import probe as truth
from k3patch.verdicts import Verdict

VERSIONS = ["0.29.0", "0.31.0", "0.33.0", "0.34.0"]
ONLY = ["--only", "aiter-mla-gfx942"]


def status_json(site: Path) -> dict:
    return _status_json(site, *ONLY)


def verdict_of(site: Path) -> str:
    return status_json(site)["patches"][0]["verdict"]


@pytest.mark.wheel
@pytest.mark.parametrize("version", slow_after(VERSIONS))
def test_full_cycle_on_real_wheel(make_tree, version):
    cycle = assert_full_cycle(make_tree(version), aiter.PATCH.id, written=["vllm/_aiter_ops.py"])
    assert cycle.pending["vllm"]["version"] == version
    (site_result,) = cycle.pending["patches"][0]["sites"]
    assert site_result["shape"] == aiter.UPSTREAM_BUGGY.name
    assert "seen in vLLM" not in site_result["detail"]  # a release the shape's range covers


@pytest.mark.wheel
def test_only_the_site_changes(make_tree):
    site = make_tree("0.31.0")
    target = site / "vllm" / "_aiter_ops.py"
    before = target.read_text()
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    after = target.read_text()
    # Everything outside is_mla_enabled is byte-identical.
    start = before.index("    def is_mla_enabled(cls) -> bool:")
    end = before.index("\n    @classmethod", start)
    assert after.startswith(before[:start])
    assert after.endswith(before[end:])
    assert 'envs.is_set("VLLM_ROCM_USE_AITER_MLA")' in after[start : len(after) - len(before[end:])]


@pytest.mark.wheel
def test_ruff_reformatted_post_image_still_applied(make_tree, tmp_path):
    site = make_tree("0.31.0")
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 0
    target = site / "vllm" / "_aiter_ops.py"
    text_before = target.read_text()
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    subprocess.run([ruff, "format", "--line-length", "120", "--no-cache", str(target)], check=True)
    assert target.read_text() != text_before, "ruff changed nothing: the test proves nothing"
    assert verdict_of(site) == "applied"
    # Quote style and comments do not matter either.
    text = target.read_text().replace('"VLLM_ROCM_USE_AITER_MLA"', "'VLLM_ROCM_USE_AITER_MLA'")
    text = text.replace("# Imported here:", "# (a rewritten comment)\n        # Imported here:")
    target.write_text(text)
    assert verdict_of(site) == "applied"


@pytest.mark.wheel
def test_marker_comment_on_unpatched_code_is_not_applied(make_tree):
    site = make_tree("0.31.0")
    target = site / "vllm" / "_aiter_ops.py"
    text = target.read_text().replace(
        "    def is_mla_enabled(cls) -> bool:\n",
        "    def is_mla_enabled(cls) -> bool:\n        # k3patch aiter-mla-gfx942 applied\n",
    )
    target.write_text(text)
    assert verdict_of(site) == "pending"


@pytest.mark.wheel
def test_semantic_mutation_is_drift_and_nothing_is_written(make_tree):
    site = make_tree("0.31.0")
    target = site / "vllm" / "_aiter_ops.py"
    target.write_text(
        target.read_text().replace(
            "return cls._AITER_ENABLED and cls._MLA_ENABLED",
            "return cls._AITER_ENABLED or cls._MLA_ENABLED",
        )
    )
    before = tree_hashes(site)
    data = status_json(site)
    assert data["_rc"] == 1
    site_result = data["patches"][0]["sites"][0]
    assert site_result["verdict"] == "drifted"
    assert "cls._AITER_ENABLED or cls._MLA_ENABLED" in site_result["found"]
    assert site_result["expected"], "a drift report must say what was expected"
    proc = run_cli("apply", "--vllm", str(site), *ONLY)
    assert proc.returncode == 1
    assert "drifted" in proc.stdout
    assert tree_hashes(site) == before


@pytest.mark.wheel
def test_missing_arch_helper_is_refused(make_tree):
    # Before 0.15.0 there is no on_gfx942(): the fix cannot be written safely.
    site = make_tree("0.31.0")
    rocm = site / "vllm" / "platforms" / "rocm.py"
    rocm.write_text(rocm.read_text().replace("def on_gfx942()", "def on_gfx942_renamed()"))
    before = tree_hashes(site)
    data = status_json(site)
    assert data["patches"][0]["verdict"] == "drifted"
    (result,) = data["patches"][0]["sites"]
    assert "on_gfx942" in result["detail"]
    # A drift says what it found and what was expected, as every drift does (SiteResult.drift).
    assert "def is_mla_enabled" in result["found"]
    assert any("on_gfx942" in item for item in result["expected"])
    assert run_cli("apply", "--vllm", str(site), *ONLY).returncode == 1
    assert tree_hashes(site) == before


# Table of shapes: every declared shape reads as its verdict; near misses never do.
MUST_NOT_MATCH = [
    "return cls._AITER_ENABLED or cls._MLA_ENABLED",
    "return cls._AITER_ENABLED",
    "return cls._MLA_ENABLED and cls._AITER_ENABLED",
    "return True",
]


@pytest.mark.parametrize("body", MUST_NOT_MATCH)
def test_near_misses_do_not_match_any_shape(body):
    source = f"""
    @classmethod
    @if_aiter_supported
    def is_mla_enabled(cls) -> bool:
        {body}
    """
    assert source_fingerprint(source) not in {s.fingerprint for s in aiter.SHAPES}


def test_decorators_are_part_of_the_shape():
    undecorated = (
        "def is_mla_enabled(cls) -> bool:\n    return cls._AITER_ENABLED and cls._MLA_ENABLED\n"
    )
    assert source_fingerprint(undecorated) != aiter.UPSTREAM_BUGGY.fingerprint


def test_docstring_variant_of_0_12_is_pending():
    source = '''
    @classmethod
    @if_aiter_supported
    def is_mla_enabled(cls) -> bool:
        """Verifies device specs and availability of env variable."""
        return cls._AITER_ENABLED and cls._MLA_ENABLED
    '''
    assert source_fingerprint(source) == aiter.UPSTREAM_BUGGY.fingerprint
    assert aiter.UPSTREAM_BUGGY.verdict is Verdict.PENDING


# --------------------------------------------------------------------------------------------
# The truth table on every tree where the patch is pending: one child on the unpatched tree,
# one `verify` child on the applied copy, each asserted over every row.


def table() -> list[tuple[str, bool, bool]]:
    """Every row: (its label, the rule's value, what the unpatched `_AITER_ENABLED and
    _MLA_ENABLED` answers)."""
    rows = [
        (truth.flag_case(variable, gpu, aiter_on, mla), want, aiter_on and mla)
        for variable, gpu, aiter_on, mla, want in truth.FLAG_ROWS
    ]
    rows += [
        (
            truth.variable_case(aiter_variable, variable, gpu),
            want,
            truth.parsed_aiter_flag(aiter_variable) and truth.parsed_mla_flag(variable),
        )
        for aiter_variable, variable, gpu, want in truth.VARIABLE_ROWS
    ]
    return rows


def test_the_table_is_every_combination_with_the_rules_value():
    spellings = len(truth.VALUES)
    assert len(truth.FLAG_ROWS) == spellings * 3 * 2 * 2
    assert len(truth.VARIABLE_ROWS) == len(truth.AITER_VALUES) * spellings * 3
    # Every case of "true" is an explicit "on" as "1" is (a fix judging a few spellings fails).
    assert {"1", "true", "True", "TRUE", "tRuE", "", "yes"} <= set(truth.VALUES)
    assert len({label for label, _, _ in table()}) == len(table())
    rows = {(v, gpu, a, m): want for v, gpu, a, m, want in truth.FLAG_ROWS}
    # SITES.md section 4: unset on gfx942 off; =1 on gfx942 on; =0 (its flag off) off
    # anywhere; unset on gfx950 on; and off whenever a flag is.
    assert rows[None, "gfx942", True, True] is False
    assert rows["1", "gfx942", True, True] is True
    assert not any(want for (v, _, _, m), want in rows.items() if v == "0" and not m)
    assert rows[None, "gfx950", True, True] and rows[None, "gfx90a", True, True]
    assert not any(want for (_, _, a, m), want in rows.items() if not (a and m))
    # The bug shows in one row of each table; every other row is a must-not-break row.
    assert [label for label, want, old in table() if want != old] == [
        "VLLM_ROCM_USE_AITER_MLA=unset gfx942 aiter=1 mla=1",
        "from the variables: VLLM_ROCM_USE_AITER=1 VLLM_ROCM_USE_AITER_MLA=unset gfx942",
        "from the variables: VLLM_ROCM_USE_AITER=True VLLM_ROCM_USE_AITER_MLA=unset gfx942",
    ]


def line(label: str, got: bool, want: bool) -> str:
    return f"{label} -> {got!r}: " + ("ok" if got == want else f"FAILED (expected {want!r})")


PENDING = [*VERSIONS, "fork-a", "fork-b", "fork-c", "fork-d"]


@pytest.mark.wheel
@pytest.mark.verify
@pytest.mark.parametrize("tree", slow_except(PENDING, "0.31.0", "fork-a"))
def test_truth_table_fails_unpatched_and_holds_applied(probed, verified, tree):
    # Both results are shared with the other patches' tests of the same tree (conftest).
    spec = tree.replace("fork-", "fork:")
    before = probed(spec, aiter.PATCH.id)
    assert before["ok"] is False
    assert rows_of(before) == [line(label, old, want) for label, want, old in table()]

    found = verified(spec)
    assert found["apply_rc"] == 0, found["output"]
    check = found["patches"][aiter.PATCH.id]
    assert check["verdict"] == "applied", check
    assert [m["status"] for m in check["modules"]] == ["ok"] * len(check["modules"]), check
    assert check["probe"]["ok"] is True, check["probe"]["summary"]
    assert rows_of(check["probe"]) == [line(label, want, want) for label, want, _ in table()]


def rows_of(probe: dict) -> list[str]:
    """The probe's table rows; its one other line says the tree's envs.py parses as assumed."""
    (parsing,) = [c for c in probe["checks"] if c.startswith("envs.py reads ")]
    assert parsing.endswith(f"for {len(truth.VALUES)} spellings: ok"), parsing
    return [c for c in probe["checks"] if c != parsing]
