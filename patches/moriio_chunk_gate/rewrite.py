"""moriio-chunk-gate's rewrite, as edits of the file's own lines (k3patch.edits): every byte
outside the gate headers stays. Each gate header (and the named temporaries that fed it) is
replaced; the gate's body stays where it is. G1 leaves `if new_block_ids is not None:` for a
guard right after it: since the gate is the last statement of that branch, its body keeps its
depth under the guard's own `if`. The older script's form is repaired in place (legacy.py)."""

from __future__ import annotations

from k3patch.edits import Edit, SourceText, apply_edits, header_end
from k3patch.model import SourceFile, Verdict

from . import G1, G1_TEMPLATE, G2_TEMPLATE, MARKER_G1, MARKER_G2
from .gates import Context, Gate, classify_site, locate
from .legacy import repair_edits, site_chains


def rewrite_sites(src: SourceFile, pending: list[str]) -> str:
    context = Context.of(src.tree)
    text = SourceText(src.text)
    edits: list[Edit] = []
    for site in pending:
        if classify_site(src, context, site).verdict is not Verdict.PENDING:
            raise ValueError(f"{site} is no longer pending")
        chains = site_chains(context, site)
        if chains is not None:
            edits += repair_edits(text, chains)
            continue
        gate, _ = locate(context, site)
        assert gate is not None
        edits.append(_gate_edit(text, gate))
    return apply_edits(src.text, edits)


def _header(template: str) -> str:
    """A template's statements without the `pass` that stands for the gate's own body."""
    return template.strip("\n").rsplit("\n", 1)[0]


def _gate_edit(src: SourceText, gate: Gate) -> Edit:
    """The gate's header, and the temporaries that fed it, replaced by the new header. The
    comment lines right above the gate stay with it; those above a dropped temporary go."""
    first = gate.block.index(gate.temps[0] if gate.temps else gate.node)
    above = gate.block[first - 1].end_lineno if first else None
    start = src.after_line(above) if above else src.starts[gate.block[first].lineno - 1]
    leading = src.starts[gate.node.lineno - 1]
    kept = src.text[
        src.after_line(gate.temps[-1].end_lineno or 0) if gate.temps else start : leading
    ]
    indent = src.indent_of(gate.node)
    if gate.site == G1:
        guard, rebind, inner = _header(G1_TEMPLATE).split("\n", 2)
        outer = src.indent_of(gate.conditions[0])
        new = src.block("\n".join([*MARKER_G1, guard, rebind]), outer)
        new += kept + src.block(inner, indent)
    else:
        new = kept + src.block("\n".join([*MARKER_G2, _header(G2_TEMPLATE)]), indent)
    return Edit(start, header_end(src, gate.node), new[: -len(src.newline)])
