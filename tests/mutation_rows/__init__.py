"""The mutation rows, one table per patch (issue 28): each module beside this one holds the wrong
fixes of one patch as VARIANTS. benchmarks/mutants.py (the harness) runs them; the table test
(tests/test_mutants_table.py) holds their anchors to today's declarations."""

from __future__ import annotations

from . import aiter_mla_gfx942, kda_gather_diagnostic, moriio_chunk_gate, moriio_group_routing
from .common import AITER, CHUNK, FIRST, ISSUE_28, KDA, ROUTING, Sub, Variant

# patch id -> its table
TABLES: dict[str, tuple[Variant, ...]] = {
    AITER: aiter_mla_gfx942.VARIANTS,
    CHUNK: moriio_chunk_gate.VARIANTS,
    ROUTING: moriio_group_routing.VARIANTS,
    KDA: kda_gather_diagnostic.VARIANTS,
}
VARIANTS: tuple[Variant, ...] = tuple(v for table in TABLES.values() for v in table)

__all__ = ["FIRST", "ISSUE_28", "TABLES", "VARIANTS", "Sub", "Variant"]
