"""Issue 28's attack rows (tests/mutation_rows/<patch>_attack.py): wrong fixes written by an
independent attacker, before reading the probes or these tables, in two forms.

- VARIANTS (common.Variant): substitutions in a patch's declared post-image, the format of
  benchmarks/mutants.py; apply writes the mutant and reads it back as applied, so what is left
  to judge it is verify's probe. The harness imports only the tables named in
  mutation_rows/__init__.py; benchmarks/attack28.py runs these through the harness's own
  functions.
- TREE_ROWS (TreeRow): an edit made by hand to a tree, the way an operator or a vendor edits an
  image: `base` "applied" is a cached tree after `k3patch apply`, "pristine" the cached tree as
  it comes (nothing of k3patch in it: a hand port). Each is judged by `k3patch status` (does it
  still read applied or satisfied?) and then `k3patch verify` (does a probe fail?).
  `recorded` is what the attacker measured on 2026-12-05 (benchmarks/ATTACK-28.md);
  benchmarks/attack28.py re-measures.
"""

from __future__ import annotations

from dataclasses import dataclass

ATTACK = "issue 28 attack"


@dataclass(frozen=True)
class TreeRow:
    id: str
    patch: str
    what: str
    tree: str  # "0.31.0", "0.33.0" (a wheel) or "fork-a", "fork-b", "fork-d" (tests/forktree)
    base: str  # "applied" or "pristine"
    file: str  # relative to the site-packages dir
    # (before, after): `before` occurs exactly once; or (first, last, after): the span from the
    # one line `first` to the next line `last` (a block of vLLM's own code, never copied here)
    edits: tuple[tuple[str, ...], ...]
    recorded: str  # "status" (killed by status), "verify" (killed by a probe) or "SURVIVED"
    recorded_detail: str = ""
    equivalent: str = ""  # why a survivor behaves as the real fix (empty: a real bug)
