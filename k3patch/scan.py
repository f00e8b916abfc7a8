"""Classify a tree: read the target files, let each patch judge its sites, or reuse a fresh
state record without parsing anything. Nothing here writes or prints."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterable
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

from k3patch import formats, lock
from k3patch.astkit import AmbiguousDefinition
from k3patch.errors import EnvironmentProblem
from k3patch.patch import Patch
from k3patch.pycache import imported_instead, instead_why, stale_bytecode
from k3patch.registry import all_patches
from k3patch.sources import SourceError, Sources
from k3patch.state import RecordProblem, fresh, load, missing_original
from k3patch.transaction import Transaction, sha256
from k3patch.tree import VllmTree
from k3patch.verdicts import SiteResult, Verdict, summarise


@dataclass
class Report:
    """The classification of every selected patch's sites in one tree."""

    tree: VllmTree
    patches: tuple[Patch, ...]
    results: list[SiteResult]
    hashes: dict[str, str | None]  # every target file read -> sha256 (None: absent)
    from_record: bool = False
    interrupted: str | None = None  # an interrupted commit's journal is present
    # Why k3patch's own state cannot be read here (`.k3patch` a file or a link, the record or
    # journal not a regular file or unreadable by this user): the verdicts still come from the
    # code, but apply could not run, and status says so (exit 3).
    state_problem: str | None = None
    # Target files whose unchecked-hash pyc (where this interpreter loads it) holds other code:
    # rel -> that pyc. Python runs that code, so no site of such a file reads applied or
    # satisfied; apply removes the pyc.
    stale_bytecode: dict[str, str] = field(default_factory=dict)
    # The sites read pending for that reason alone: (patch, site, file) -> the source's verdict.
    run_from_bytecode: dict[tuple[str, str, str], Verdict] = field(default_factory=dict)
    # The files as read for this report, parsed trees cached: plan() reuses them.
    sources: Sources | None = field(default=None, repr=False, compare=False)

    def selected(self, patches: tuple[Patch, ...]) -> Report:
        """The same classification restricted to `patches`."""
        wanted = {p.id for p in patches}
        results = [r for r in self.results if r.patch_id in wanted]
        return replace(self, patches=patches, results=results)

    def source_verdicts(self) -> Report:
        """The classification of the source alone (the bytecode Python runs left aside): what
        a rewrite works from."""
        if not self.run_from_bytecode:
            return self
        results = [
            r._replace(verdict=v, detail="")
            if (v := self.run_from_bytecode.get((r.patch_id, r.site, r.file)))
            else r
            for r in self.results
        ]
        return replace(self, results=results, run_from_bytecode={})

    def for_patch(self, patch_id: str) -> list[SiteResult]:
        return [r for r in self.results if r.patch_id == patch_id]

    def verdicts(self) -> dict[str, Verdict]:
        return {p.id: summarise(r.verdict for r in self.for_patch(p.id)) for p in self.patches}

    def pending(self, refused: Iterable[str] = ()) -> list[SiteResult]:
        """The pending sites of every patch not in `refused` (what an apply will rewrite)."""
        skip = set(refused)
        return [r for r in self.results if r.verdict is Verdict.PENDING and r.patch_id not in skip]

    @property
    def drifted(self) -> list[str]:
        """The patches with a drifted site, in report order."""
        ids = {r.patch_id for r in self.results if r.verdict is Verdict.DRIFTED}
        return [p.id for p in self.patches if p.id in ids]

    @property
    def digest(self) -> str:
        """One value two nodes can compare: vLLM version, every target file's hash, verdicts."""
        results = [r.to_json() for r in self.results]
        return formats.state_digest(
            self.tree.version, self.hashes, results, self.interrupted, bool(self.state_problem)
        )

    def to_json(self) -> dict[str, Any]:
        payload = formats.report_json(
            self.tree.info,
            self.digest,
            self.from_record,
            self.interrupted,
            patch_meta(self.patches),
            [r.to_json() for r in self.results],
        )
        if self.state_problem:
            payload["error"] = self.state_problem
        return payload


def patch_meta(patches: Iterable[Patch]) -> list[dict[str, str]]:
    return [{"id": p.id, "title": p.title, "caveat": p.caveat} for p in patches]


def target_files(patches: Iterable[Patch]) -> list[str]:
    return list(dict.fromkeys(rel for patch in patches for rel in patch.files))


def _drift(
    patch: Patch, rel: str, detail: str, site: str = "(file)", line: int | None = None
) -> SiteResult:
    return SiteResult.drift(patch.id, site, rel, detail, line)


def _unreadable(patch: Patch, sources: Sources) -> list[SiteResult]:
    """One drifted result per present file of the patch that is not Python source (syntax error,
    binary junk, not UTF-8, nested past the parser's limits) or holds no code (an empty target is
    never vLLM's): a patch must not answer "not applicable" or "satisfied" from one file past
    another it cannot read. An absent file is the patch's to judge."""
    out = []
    for rel in patch.files:
        if not sources[rel].exists:
            continue
        try:
            if not sources[rel].tree.body:
                empty = f"{rel}: holds no code (empty); restore it from the wheel"
                out.append(_drift(patch, rel, empty))
        except SourceError as exc:
            out.append(_drift(patch, rel, str(exc)))
    return out


def classify(patch: Patch, sources: Sources) -> list[SiteResult]:
    unreadable = _unreadable(patch, sources)
    if unreadable:
        return unreadable
    try:
        return patch.classify(sources)
    except AmbiguousDefinition as exc:
        rel = next(
            (
                rel
                for rel in patch.files
                if sources[rel].exists
                and any(node is exc.scope for node in ast.walk(sources[rel].tree))
            ),
            patch.files[0],
        )
        return [_drift(patch, rel, str(exc), exc.name, exc.lines[-1])]
    except SourceError as exc:
        return [_drift(patch, str(exc).split(":", 1)[0], str(exc))]
    except (RecursionError, MemoryError):
        # It parsed, but is nested deeper than the analysis can follow (a recursive copy or
        # unparse of an expression hundreds of operators deep): the deepest of the patch's
        # files is the one, whichever file the patch happened to be reading.
        rel = max(patch.files, key=lambda rel: sources[rel].depth())
        why = (
            f"{rel}: code nested too deeply to analyse ({sources[rel].depth()} levels; a "
            "generated or hostile file?); restore it from the wheel"
        )
        return [_drift(patch, rel, why)]


def file_hashes(sources: Sources, files: Iterable[str]) -> dict[str, str | None]:
    read = {rel: sources[rel].data for rel in files}
    return {rel: None if data is None else sha256(data) for rel, data in read.items()}


def scan(
    tree: VllmTree,
    patches: tuple[Patch, ...] | None = None,
    *,
    use_record: bool = True,
    wait_for_live: float | None = None,
) -> Report:
    """Classify every site of `patches` (default: all). With a state record whose file hashes
    all match, its classification is reused without parsing anything. `wait_for_live`: seconds
    to wait for a live run (status; 0: not at all): every file is read after it, under the lock,
    shared."""
    patches = all_patches() if patches is None else patches
    sources = Sources(tree.read, tree.version)
    targets = target_files(all_patches())
    # A live writer first, then every read: a status must never report files read half way
    # through another run's commit, nor that run's journal as an interrupted one.
    with nullcontext() if wait_for_live is None else lock.shared(tree.package, wait_for_live):
        interrupted, problem = _interrupted(tree)
        hashes = file_hashes(sources, targets)
        stale = {
            rel: pyc
            for rel in targets
            if (pyc := stale_bytecode(tree.package_dir / rel, sources[rel].data)) is not None
        }
        # A target whose import loads other code (an extension module, a sourceless pyc): the
        # patch cannot be judged or applied from the source, so it drifts, never "applied" nor
        # "not applicable" (an absent .py beside its .pyc is not an absent feature).
        instead = {rel: path for rel in targets if (path := imported_instead(tree.path(rel)))}
        record = None
        try:
            # Damaged, of another schema or naming a saved original that is gone: no revert
            # could use it, so no run may pass the tree as whole (status, apply and verify: 3).
            record = load(tree.state_dir)
            if record is not None:
                problem = problem or missing_original(record, tree.package_dir)
        except EnvironmentProblem as exc:
            problem = problem or str(exc)
    cached = record if use_record and not os.environ.get("K3PATCH_NO_FASTPATH") else None
    quiet = interrupted is None and problem is None and not stale and not instead
    if cached is not None and quiet and fresh(cached, hashes):
        return Report(tree, patches, cached.results, hashes, from_record=True).selected(patches)
    results = []
    run_from: dict[tuple[str, str, str], Verdict] = {}
    judged = (
        [_drift(p, rel, instead_why(rel, instead[rel])) for rel in p.files if rel in instead]
        or classify(p, sources)
        for p in patches
    )
    for result in (r for results_of in judged for r in results_of):
        if result.file in stale and result.verdict in (Verdict.APPLIED, Verdict.SATISFIED):
            # A good site whose file Python does not run: status must not call it good.
            run_from[(result.patch_id, result.site, result.file)] = result.verdict
            result = result._replace(
                verdict=Verdict.PENDING,
                detail=f"{result.verdict.value} in the source, but Python runs the "
                f"unchecked-hash bytecode {stale[result.file]}, compiled from other code; "
                "`k3patch apply` removes it",
            )
        results.append(result)
    return Report(
        tree,
        patches,
        results,
        hashes,
        interrupted=interrupted,
        sources=sources,
        state_problem=problem,
        stale_bytecode=stale,
        run_from_bytecode=run_from,
    )


def _interrupted(tree: VllmTree) -> tuple[str | None, str | None]:
    """The op of an interrupted commit's journal (or None), and why no journal could be read
    (or None)."""
    try:
        journal = Transaction(tree.package_dir).pending_journal()
    except RecordProblem:
        return "unknown (damaged journal)", None
    except EnvironmentProblem as exc:
        return None, str(exc)  # apply and revert stop on it; status names it
    return (str(journal["op"]) if journal else None), None
