"""The mutation rows (tests/mutation_rows/, one table per patch, run by benchmarks/mutants.py) are
well-formed against today's declarations (no tree, no verify): a variant whose anchor moved would
otherwise be found only when someone runs the benchmark."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import mutants  # noqa: E402

PATCHES = ROOT / "patches"


def test_at_least_25_variants_over_all_four_patches():
    assert len(mutants.VARIANTS) >= 25
    assert {v.patch for v in mutants.VARIANTS} == set(mutants.VERIFY_WITH) == set(mutants.TESTS)


def test_one_table_per_patch_holding_only_that_patchs_rows():
    assert set(mutants.TABLES) == set(mutants.VERIFY_WITH)
    for patch, table in mutants.TABLES.items():
        assert table and {v.patch for v in table} == {patch}, patch
        module = patch.replace("-", "_")
        assert (ROOT / "tests" / "mutation_rows" / f"{module}.py").is_file(), patch
    assert mutants.VARIANTS == tuple(v for t in mutants.TABLES.values() for v in t)


def test_issue_28_rows_written_before_the_probes_were_extended():
    """At least 12 new wrong fixes per MoRIIO patch and 4 for each other patch (issue 28)."""
    wanted = {
        "moriio-chunk-gate": 12,
        "moriio-group-routing": 12,
        "kda-gather-diagnostic": 4,
        "aiter-mla-gfx942": 4,
    }
    for patch, table in mutants.TABLES.items():
        new = [v for v in table if v.written == "issue 28"]
        assert len(new) >= wanted.get(patch, 0), patch
    assert {v.written for v in mutants.VARIANTS} == {"issue 19", "issue 28", "issue 28 attack"}


def test_the_attack_rows_in_the_harness_format_join_their_patchs_table():
    """tests/mutation_rows/<folder>_attack.py: its VARIANTS are found (no list names them) and
    counted in the patch's table after the patch's own rows; its TREE_ROWS are not variants."""
    import importlib

    for patch, folder in mutants.FOLDERS.items():
        own = importlib.import_module(f"mutation_rows.{folder}").VARIANTS
        try:
            attack = importlib.import_module(f"mutation_rows.{folder}_attack").VARIANTS
        except ModuleNotFoundError:
            attack = ()
        assert mutants.TABLES[patch] == (*own, *attack), patch
    attack_ids = {v.id for v in mutants.VARIANTS if v.written == "issue 28 attack"}
    assert {"chunk-att-fork-double-n1", "chunk-att-both-strict"} <= attack_ids


def test_variant_ids_are_unique():
    ids = [v.id for v in mutants.VARIANTS]
    assert len(ids) == len(set(ids))


def test_every_substitution_occurs_exactly_once_in_todays_declaration():
    assert mutants.table_errors(PATCHES) == {}


def test_every_variant_changes_the_declaration():
    for variant in mutants.VARIANTS:
        changed = mutants.mutated(PATCHES, variant)
        assert changed and all(
            text != (PATCHES / rel).read_text(encoding="utf-8") for rel, text in changed.items()
        ), variant.id


def test_every_variant_runs_on_a_tree_and_every_declared_survivor_has_a_reason():
    for variant in mutants.VARIANTS:
        assert variant.trees and variant.what, variant.id
        assert variant.equivalent == "" or len(variant.equivalent.split()) >= 8, variant.id


def test_a_moved_anchor_is_a_table_error_not_a_silent_skip(tmp_path):
    variant = mutants.VARIANTS[0]
    declared = tmp_path / variant.subs[0].file
    declared.parent.mkdir(parents=True)
    text = (PATCHES / variant.subs[0].file).read_text(encoding="utf-8")
    declared.write_text(text.replace(variant.subs[0].old, ""), encoding="utf-8")
    assert variant.id in mutants.table_errors(tmp_path, [variant])
    declared.write_text(text + text, encoding="utf-8")  # twice: ambiguous
    assert "found 2 times" in mutants.table_errors(tmp_path, [variant])[variant.id]


def test_a_full_run_keeps_the_recorded_baselines(tmp_path, monkeypatch):
    """A full run rewrites the Mutants section but carries its `### Kept:` subsections over (the
    issue 28 rows' count against the probes of their day), and leaves other sections alone."""
    results = tmp_path / "RESULTS.md"
    results.write_text(
        "# Results\n\n## Speed\n\nfast\n\n## Mutants\n\nold table\n\n"
        "### Kept: issue 28 baseline\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n## Later\n\nstays\n",
        encoding="utf-8",
    )
    monkeypatch.setattr(mutants, "RESULTS", results)
    mutants.write_results(["new table"], "mutants.py", "none")
    text = results.read_text(encoding="utf-8")
    assert "old table" not in text and "new table" in text
    assert "### Kept: issue 28 baseline\n\n| a | b |\n|---|---|\n| 1 | 2 |\n" in text
    assert text.index("new table") < text.index("### Kept:") < text.index("## Later")
    assert "## Speed\n\nfast" in text and "## Later\n\nstays" in text
