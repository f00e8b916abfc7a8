"""What every patch's mutation table is made of (benchmarks/mutants.py runs them).

A row is a wrong fix written as text substitutions in a patch's declared post-image: the text
`apply` writes, which is also the shape `status` reads as k3patch's. Each substitution must occur
exactly once in today's declaration file (a moved anchor is a table error, never a silent skip).
"""

from __future__ import annotations

from dataclasses import dataclass

AITER, CHUNK, ROUTING, KDA = (
    "aiter-mla-gfx942",
    "moriio-chunk-gate",
    "moriio-group-routing",
    "kda-gather-diagnostic",
)
# The declaration files, relative to patches/.
AITER_DECL = "aiter_mla_gfx942/__init__.py"
CHUNK_DECL = "moriio_chunk_gate/sites.py"
CHUNK_LEGACY = "moriio_chunk_gate/gates.py"
ROUTING_FORMS = "moriio_group_routing/forms.py"
ROUTING_DECL = "moriio_group_routing/__init__.py"
KDA_DECL = "kda_gather_diagnostic/sites.py"
KDA_REWRITE = "kda_gather_diagnostic/__init__.py"
KDA_SYNCS = "kda_gather_diagnostic/syncs.py"

# When a row was written: "issue 19" (the first table), "issue 28" (written before issue 28's
# probes were extended, against the probes of that day, by someone who had not read them).
FIRST, ISSUE_28 = "issue 19", "issue 28"


@dataclass(frozen=True)
class Sub:
    file: str  # relative to patches/
    old: str
    new: str


@dataclass(frozen=True)
class Variant:
    id: str
    patch: str
    what: str
    subs: tuple[Sub, ...]
    trees: tuple[str, ...]
    equivalent: str = ""  # why it behaves as the real fix, if it is expected to survive
    written: str = FIRST
