"""The mutation rows, one table per patch, found here and listed nowhere: each module beside this
one named after a patch folder (`<folder>.py`, e.g. aiter_mla_gfx942.py) holds that patch's wrong
fixes as VARIANTS. benchmarks/mutants.py (the harness) runs them; the table test
(tests/test_mutants_table.py) holds their anchors to today's declarations."""

from __future__ import annotations

import importlib
import pkgutil

from .common import FIRST, ISSUE_28, Sub, Variant


def _discover() -> tuple[dict[str, tuple[Variant, ...]], dict[str, str]]:
    tables: dict[str, tuple[Variant, ...]] = {}
    folders: dict[str, str] = {}
    for name in sorted(info.name for info in pkgutil.iter_modules(__path__)):
        variants = getattr(importlib.import_module(f"{__name__}.{name}"), "VARIANTS", None)
        if variants is None:
            continue  # common.py: what the tables are made of
        patches = {v.patch for v in variants}
        if len(patches) != 1 or (patch := patches.pop()) in tables:
            raise ValueError(f"tests/mutation_rows/{name}.py: one table per patch, one patch each")
        tables[patch], folders[patch] = tuple(variants), name
    return tables, folders


# patch id -> its table; patch id -> its folder (the table's module name)
TABLES, FOLDERS = _discover()
VARIANTS: tuple[Variant, ...] = tuple(v for table in TABLES.values() for v in table)

__all__ = ["FIRST", "FOLDERS", "ISSUE_28", "TABLES", "VARIANTS", "Sub", "Variant"]
