"""The mutation rows, one table per patch, found here and listed nowhere: each module beside this
one named after a patch folder (`<folder>.py`, e.g. aiter_mla_gfx942.py) holds that patch's wrong
fixes as VARIANTS, and `<folder>_attack.py` (issue 28's attacker) adds its VARIANTS to the same
table (its TREE_ROWS stay with benchmarks/attack28.py). benchmarks/mutants.py (the harness) runs
them; the table test (tests/test_mutants_table.py) holds their anchors to today's declarations."""

from __future__ import annotations

import importlib
import pkgutil

from .common import FIRST, ISSUE_28, Sub, Variant

ATTACK_SUFFIX = "_attack"


def _discover() -> tuple[dict[str, tuple[Variant, ...]], dict[str, str]]:
    tables: dict[str, tuple[Variant, ...]] = {}
    folders: dict[str, str] = {}
    # A table's own module before its attack rows (sorted: "x" < "x_attack").
    for name in sorted(info.name for info in pkgutil.iter_modules(__path__)):
        variants = getattr(importlib.import_module(f"{__name__}.{name}"), "VARIANTS", None)
        if variants is None:
            continue  # common.py, attack_common.py: what the tables are made of
        folder = name.removesuffix(ATTACK_SUFFIX)
        patches = {v.patch for v in variants}
        if name != folder:  # attack rows join their patch's table (none: nothing to join)
            patch = next((p for p, f in folders.items() if f == folder), None)
            if patch is None or not patches <= {patch}:
                raise ValueError(f"tests/mutation_rows/{name}.py: rows of no table of {folder}")
            tables[patch] += tuple(variants)
            continue
        if len(patches) != 1 or (patch := patches.pop()) in tables:
            raise ValueError(f"tests/mutation_rows/{name}.py: one table per patch, one patch each")
        tables[patch], folders[patch] = tuple(variants), name
    return tables, folders


# patch id -> its table; patch id -> its folder (the table's module name)
TABLES, FOLDERS = _discover()
VARIANTS: tuple[Variant, ...] = tuple(v for table in TABLES.values() for v in table)

__all__ = ["FIRST", "FOLDERS", "ISSUE_28", "TABLES", "VARIANTS", "Sub", "Variant"]
