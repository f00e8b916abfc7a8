"""moriio-chunk-gate's two sites: classified (the older script's decision chains first, else
the gate in its loop), then rewritten as edits of the file's own lines (k3patch.edits), so every
byte outside the gate headers stays. Each gate header (and the named temporaries that fed it)
is replaced and the gate's body stays where it is: G1 leaves `if new_block_ids is not None:`
for a guard right after it, and since the gate is the last statement of that branch, its body
keeps its depth under the guard's own `if`. The older form is repaired in place (legacy.py)."""

from __future__ import annotations

from k3patch.edits import Edit, SourceText, apply_edits, header_end
from k3patch.model import SiteResult, SourceFile, Verdict

from . import CLASS, G1, G1_TEMPLATE, G2, G2_TEMPLATE, MARKER_G1, MARKER_G2, METHOD
from .gates import Context, Gate, classify_gate, locate, method_of, site_result
from .legacy import classify_chains, repair_edits, site_chains


def classify_sites(src: SourceFile) -> list[SiteResult]:
    if not src.exists:
        why = "no MoRIIO connector in this vLLM (it first ships in 0.14.1)"
        return [site_result(s, Verdict.NOT_APPLICABLE, why) for s in (G1, G2)]
    if method_of(src.tree) is None:
        why = f"moriio_connector.py has no {CLASS}.{METHOD}; the connector was restructured"
        return [site_result(s, Verdict.DRIFTED, why) for s in (G1, G2)]
    context = Context.of(src.tree)
    return [classify_site(src, context, site) for site in (G1, G2)]


def classify_site(src: SourceFile, context: Context, site: str) -> SiteResult:
    chains = site_chains(context, site)
    if chains is not None:
        return classify_chains(context, site, chains)
    gate, why = locate(context, site)
    if gate is None:
        return site_result(site, Verdict.DRIFTED, why, line=context.method.lineno)
    return classify_gate(src, context, gate)


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
