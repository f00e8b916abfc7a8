"""moriio-chunk-gate: the MoRIIO WRITE producer sends a request's KV after its final prefill chunk.

`build_connector_meta`'s two gates (SITES.md 2) call a chunk final by block count: K3's
~5,760-token blocks hold the prompt after chunk 1 (recall dies at 2,048 tokens), and G1 runs only
when a block was allocated (a request can hang). Both gates decide on compute progress, no slack.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from k3patch.patch import Patch, ProbeOutcome
from k3patch.sources import Sources
from k3patch.verdicts import SiteResult

from .sites import CLASS, FILE, G1, G1_TEMPLATE, G2, G2_TEMPLATE, METHOD, MODULE, PATCH_ID

if TYPE_CHECKING:
    from k3patch.codemod import Codemods

__all__ = ["CLASS", "FILE", "G1", "G1_TEMPLATE", "G2", "G2_TEMPLATE", "METHOD", "MODULE", "PATCH"]


class MoriioChunkGate(Patch):
    id = PATCH_ID
    title = "MoRIIO WRITE producer sends the KV after the final prefill chunk (compute progress)"
    files = (FILE,)
    modules = (MODULE,)
    caveat = (
        "MoRIIO WRITE-mode producers only; the older k3-chunk-gate form is repaired in place "
        "(its helper and progress map stay, unused by the gates)"
    )

    def classify(self, sources: Sources) -> list[SiteResult]:
        from .gates import classify_sites

        return classify_sites(sources[FILE])

    def rewrite(self, sources: Sources, pending: list[SiteResult], files: Codemods) -> None:
        from .gates import rewrite_sites

        rewrite_sites(sources[FILE], [r.site for r in pending], files[FILE])

    def probe(self) -> ProbeOutcome:
        from .probe import probe_chunk_gate

        return probe_chunk_gate()


PATCH = MoriioChunkGate()
