"""What a patch module provides: the `Patch` base class and what its probe returns."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from k3patch.verdicts import SiteResult, Verdict

if TYPE_CHECKING:
    from k3patch.codemod import Codemods
    from k3patch.sources import Sources


class ProbeOutcome(NamedTuple):
    """What a behaviour probe found on the real (patched) code."""

    ok: bool
    summary: str
    checks: tuple[str, ...] = ()


class Patch:
    """Base class of every module in `patches/` (each defines one subclass and `PATCH`): it
    reads its sites with `ast` (classification never needs libcst) and rewrites pending ones
    through libcst codemods. The engine knows no patch by name."""

    id: str = ""
    title: str = ""
    # Paths of every file the patch reads, relative to the `vllm` package dir.
    files: tuple[str, ...] = ()
    # Dotted module names that `verify` imports once the patch is in place.
    modules: tuple[str, ...] = ()
    # One line for `status --help`-like listings: what the patch does not cover.
    caveat: str = ""
    # Ids of patches whose rewrite must run before this one's (and whose probe's names this
    # one may rely on). The registry orders patches by these, then by id; a cycle or an unknown
    # id is a bug in the patch set and fails at load.
    after: tuple[str, ...] = ()

    def classify(self, sources: Sources) -> list[SiteResult]:
        raise NotImplementedError

    def rewrite(self, sources: Sources, pending: list[SiteResult], files: Codemods) -> None:
        """Rewrite the `pending` sites as libcst codemods on `files[rel]` (k3patch/codemod.py):
        the engine parses each file once, prints it once, then compiles and re-classifies."""
        raise NotImplementedError

    def probe(self) -> ProbeOutcome | None:
        """Exercise the patched behaviour in the verify child (vLLM importable, no GPU)."""
        return None

    def result(
        self, site: str, file: str, verdict: Verdict, detail: str = "", shape: str = ""
    ) -> SiteResult:
        return SiteResult(self.id, site, file, verdict, detail=detail, shape=shape)
