"""The library API under the CLI: plan and apply (edits made in memory, compiled and classified
again, then written with the state record in one transaction), and revert. Nothing here prints."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any

from k3patch.changes import file_diff
from k3patch.errors import EnvironmentProblem, PatchBug
from k3patch.lock import locked
from k3patch.patch import Patch
from k3patch.pycache import remove_bytecode
from k3patch.registry import all_patches
from k3patch.replace import write_atomically
from k3patch.safefs import env_error
from k3patch.scan import Report, classify, file_hashes, patch_meta, scan, target_files
from k3patch.sources import SourceError, Sources
from k3patch.state import (
    STATE_FILE,
    STATE_REL,
    FileState,
    RecordProblem,
    StateRecord,
    damaged,
    load,
    patch_set,
    planted_copy,
    read_bytes,
)
from k3patch.transaction import FaultHook, FileEdit, Transaction, sha256
from k3patch.tree import VllmTree
from k3patch.verdicts import SiteResult, Verdict

DEFAULT_LOCK_TIMEOUT = 120.0


def _carried_files(record: StateRecord | None, report: Report) -> dict[str, FileState]:
    """The record's files whose recorded original is still this install's. After an upgrade or
    a reinstall (other bytes: the original is back, or no site of the file reads applied) the
    edit is gone and that original would put an old version's file into the new install: it is
    dropped. A file edited by hand over k3patch's edit (same version, a site still applied) is
    kept, so revert refuses, naming both hashes, instead of silently forgetting it."""
    if record is None:
        return {}
    carried = {}
    for rel, fs in record.files.items():
        now = report.hashes.get(rel)
        ours = any(r.file == rel and r.verdict is Verdict.APPLIED for r in report.results)
        same_install = record.vllm_version == report.tree.version and now != fs.original
        if now == fs.applied or (same_install and ours):
            carried[rel] = fs
    return carried


@dataclass
class Plan:
    """Every edit of an apply, made in memory and checked before anything is written."""

    before: Report
    after_results: list[SiteResult]
    new_texts: dict[str, str]  # rel -> new text
    sources: Sources  # the files as read, before the edits
    # Patches left out because their rewrite failed its own checks (a k3patch bug, never the
    # tree's): patch id -> one line saying how. Nothing of them is in `new_texts`.
    bugs: dict[str, str]

    def diff(self) -> str:
        return "".join(
            line
            for rel, new in self.new_texts.items()
            for line in file_diff(rel, self.sources[rel].text, new)
        )


def plan(report: Report, refused: Collection[str] = ()) -> Plan:
    """Rewrite every pending site in memory, patch by patch over the files as the patches before
    it left them, and check each at once: the files compile, its pending sites now read applied
    and no other verdict changed (so the `refused`, drifted, patches are untouched). A patch that
    fails this (a k3patch bug) is left out and named in `Plan.bugs`, its edits dropped so they
    cannot poison another patch's edit of a shared file, and the others go on."""
    report = report.source_verdicts()  # a stale pyc is removed, never rewritten
    sources = report.sources or Sources(report.tree.read, report.tree.version)
    changes: dict[str, str] = {}
    current = sources
    results = {p.id: report.for_patch(p.id) for p in report.patches}
    bugs: dict[str, str] = {}
    for patch in report.patches:
        pending = [r for r in results[patch.id] if r.verdict is Verdict.PENDING]
        if patch.id in refused or not pending:
            continue
        try:
            mine = _rewrite(patch, current, pending)
            after = current.with_changes(mine)
            results.update(_check(report.patches, results, after, set(mine), patch.id))
        except PatchBug as exc:
            bugs[patch.id] = str(exc)
            continue
        changes.update(mine)
        current = after
    after_results = [r for p in report.patches for r in results[p.id]]
    return Plan(report, after_results, changes, sources, bugs)


def _rewrite(patch: Patch, sources: Sources, pending: list[SiteResult]) -> dict[str, str]:
    """One patch's new file texts (only those it changed). libcst is imported here: status and a
    tree with nothing pending never need it."""
    from k3patch.codemod import Codemods

    try:
        files = Codemods(sources)
        patch.rewrite(sources, pending, files)
        texts = files.texts()
    except Exception as exc:
        raise PatchBug(f"{patch.id}: rewrite failed: {exc!r}") from exc
    changed = {rel: text for rel, text in texts.items() if text != sources[rel].text}
    if not changed:
        raise PatchBug(f"{patch.id}: the rewrite of {len(pending)} pending site(s) changed nothing")
    return changed


def _check(
    patches: tuple[Patch, ...],
    results: dict[str, list[SiteResult]],
    after: Sources,
    changed: set[str],
    rewritten: str,
) -> dict[str, list[SiteResult]]:
    """The new results of every patch that reads a `changed` file, checked against `results`
    (as the patches before left them): each changed file compiles, every pending site of the
    `rewritten` patch reads applied, every other site keeps its verdict. A patch none of whose
    files changed keeps its results (the same bytes)."""
    for rel in changed:
        # Parsed once: the tree feeds both the compile check and the re-classification.
        try:
            compile(after[rel].tree, f"vllm/{rel}", "exec", dont_inherit=True)
        except (SyntaxError, SourceError, ValueError) as exc:
            why = str(exc).removesuffix("; restore it from the wheel")  # the tree's remedy
            raise PatchBug(f"rewritten vllm/{rel} does not compile: {why}") from exc
    out: dict[str, list[SiteResult]] = {}
    for patch in patches:
        if not set(patch.files) & changed:
            continue
        before = {(r.site, r.file): r.verdict for r in results[patch.id]}
        now = classify(patch, after)
        for result in now:
            old = before.get((result.site, result.file))
            mine = patch.id == rewritten and old is Verdict.PENDING
            want = Verdict.APPLIED if mine else old
            if want != result.verdict:
                raise PatchBug(
                    f"after the rewrite {result.site} of {result.patch_id} in vllm/"
                    f"{result.file} reads {result.verdict.value}, expected "
                    f"{want.value if want else 'no such site'}"
                )
        if {(r.site, r.file) for r in now} != before.keys():
            raise PatchBug(f"the rewrite changed which sites of {patch.id} exist")
        out[patch.id] = now
    return out


@dataclass
class ApplyOutcome:
    report: Report  # the classification the outcome rests on (after the commit, if any)
    plan: Plan | None = None
    written: list[str] = field(default_factory=list)  # files replaced by this run
    # The drifted patches refused, nothing of them written. Without --all-or-nothing the other
    # patches are still applied in the same run; with it, nothing at all is written.
    refused_patches: list[str] = field(default_factory=list)
    all_or_nothing: bool = False
    recovered: list[str] = field(default_factory=list)
    pycache: list[str] = field(default_factory=list)
    check: bool = False
    # Patches whose rewrite failed its own checks (a k3patch bug): id -> how. Nothing of them
    # is written; the others are, unless --all-or-nothing (then nothing at all). Exit 2.
    bugs: dict[str, str] = field(default_factory=dict)

    @property
    def refused(self) -> bool:
        """A selected patch drifted: nothing of it was written."""
        return bool(self.refused_patches)


def _record(report: Report, files: dict[str, FileState]) -> StateRecord:
    return StateRecord(
        patches=patch_meta(all_patches()),
        patch_set=patch_set(),
        vllm_version=report.tree.version,
        files=files,
        scan=report.hashes,
        results=report.results,
    )


def apply(
    tree: VllmTree,
    patches: tuple[Patch, ...] | None = None,
    *,
    check: bool = False,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    fault: FaultHook | None = None,
    all_or_nothing: bool = False,
) -> ApplyOutcome:
    """Bring every selected patch to applied (or leave it satisfied / not applicable). A patch
    with a drifted site is refused, nothing of it written; the others are still applied, in one
    transaction, so an entrypoint that goes on in warn mode starts vLLM with every fix that is
    safe. With `all_or_nothing`, any drift or patch bug refuses the whole run."""
    patches = all_patches() if patches is None else patches
    # Every patch is classified (the record covers them all); the outcome speaks of `patches`.
    first = scan(tree, all_patches())
    if first.state_problem:
        raise EnvironmentProblem(first.state_problem)  # the record it must keep is unreadable
    report = first.selected(patches)
    refused = report.drifted
    if check or (refused and all_or_nothing):
        return _planned(report, all_or_nothing, check=check)
    if not report.pending(refused) and report.interrupted is None:
        if not report.from_record:
            _refresh_record(tree, lock_timeout)
        return ApplyOutcome(report, refused_patches=refused)

    txn = Transaction(tree.package_dir, fault)
    with locked(tree.package_dir, lock_timeout):
        recovered = txn.recover()
        # Bytecode that Python runs instead of the source: removed (no journal needed).
        cleared = [a for rel in first.stale_bytecode for a in remove_bytecode(tree.path(rel))]
        # Another run may have finished the work while we waited for the lock (its record then
        # matches every file); if no file changed since our first look, that look stands.
        now = file_hashes(Sources(tree.read), target_files(all_patches()))
        same = now == first.hashes and not recovered and not cleared
        full = first if same else scan(tree, all_patches())
        full.interrupted = None  # recovered above, under the lock: no journal is left
        outcome = _planned(
            full.selected(patches), all_or_nothing, recovered=recovered, pycache=cleared
        )
        the_plan = outcome.plan
        if the_plan is None or not the_plan.new_texts:
            outcome.plan = None  # nothing is written: there is no plan to show
            if cleared and not full.pending() and not full.drifted:
                _refresh_record(tree, lock_timeout)
            return outcome
        sources = the_plan.sources
        # Damaged or of another schema: stop (exit 3) before its saved originals are pruned.
        old = load(tree.state_dir)
        files = _carried_files(old, full)
        after_hashes = dict(full.hashes)
        edits = []
        rewritten = the_plan.before.pending([*outcome.refused_patches, *the_plan.bugs])
        for rel, text in the_plan.new_texts.items():
            before, after = sources[rel].data, sources[rel].encode(text)
            edits.append(FileEdit(rel, before, after))
            after_hashes[rel] = sha256(after)
            current = None if before is None else sha256(before)
            prior = files.get(rel)
            if prior is None or prior.applied != current:
                # Never written by k3patch, or edited by hand since: the file as it is now is
                # what a revert must give back (the wheel's original would drop that edit).
                prior = FileState(current, None, ())
            touched = {r.patch_id for r in rewritten if r.file == rel} | set(prior.patches)
            files[rel] = FileState(prior.original, after_hashes[rel], tuple(sorted(touched)))
        results = _recorded_results(full, the_plan)
        record = _record(Report(tree, all_patches(), results, after_hashes), files)
        edits.append(FileEdit(STATE_REL, read_bytes(tree.state_dir), record.to_bytes()))
        pycache = _commit(txn, edits, "apply", old)
        txn.blobs.prune({fs.original for fs in files.values() if fs.original})
        final = Report(tree, patches, the_plan.after_results, after_hashes)
        written = list(the_plan.new_texts)
        return replace(outcome, report=final, written=written, pycache=cleared + pycache)


def _planned(report: Report, all_or_nothing: bool, **fields: Any) -> ApplyOutcome:
    """The outcome before anything is written: the drifted patches refused, and its plan, if
    there is anything to rewrite and `all_or_nothing` does not stop the run (a drifted patch, or
    a patch bug in the plan)."""
    refused = report.drifted
    stop = bool(refused) and all_or_nothing
    the_plan = None if stop or not report.pending(refused) else plan(report, refused)
    bugs = the_plan.bugs if the_plan else {}
    stop = stop or (bool(bugs) and all_or_nothing)
    return ApplyOutcome(
        report,
        plan=None if stop else the_plan,
        refused_patches=refused,
        all_or_nothing=stop,
        bugs=bugs,
        **fields,
    )


def _recorded_results(full: Report, the_plan: Plan) -> list[SiteResult]:
    """Every patch's results for the record, as the written files now read, so the no-op path
    answers what the full path would: the selected patches' from the plan; a patch left out
    (`--only`/`--skip`) keeps its results unless one of its files changed (a rewrite of a shared
    file moves its sites' lines, may change its verdict): then it is classified again."""
    planned = {p.id for p in the_plan.before.patches}
    after = the_plan.sources.with_changes(the_plan.new_texts)
    out: list[SiteResult] = []
    for patch in all_patches():
        if patch.id in planned:
            out += [r for r in the_plan.after_results if r.patch_id == patch.id]
        elif set(patch.files) & set(the_plan.new_texts):
            out += classify(patch, after)
        else:
            out += full.for_patch(patch.id)
    return out


@dataclass
class RevertOutcome:
    restored: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)  # changed since k3patch wrote them
    nothing_recorded: bool = False
    recovered: list[str] = field(default_factory=list)
    pycache: list[str] = field(default_factory=list)


def revert(
    tree: VllmTree, *, lock_timeout: float = DEFAULT_LOCK_TIMEOUT, fault: FaultHook | None = None
) -> RevertOutcome:
    """Put back the recorded originals, byte for byte, where each file still holds exactly what
    k3patch wrote. Any file changed since: refuse and write nothing."""
    try:  # not os.path.lexists: it reads an I/O error as "nothing recorded", exit 0
        os.lstat(tree.state_dir)
    except (FileNotFoundError, NotADirectoryError):
        return RevertOutcome(nothing_recorded=True)
    except OSError as exc:
        raise env_error("look at", tree.state_dir, exc) from None
    txn = Transaction(tree.package_dir, fault)
    with locked(tree.package_dir, lock_timeout):
        recovered = txn.recover()
        # Damaged or of another schema: RecordProblem (exit 3), nothing removed.
        record = load(tree.state_dir)
        if record is None and txn.blobs.names():
            raise EnvironmentProblem(
                f"{tree.state_dir / STATE_FILE} is missing but saved originals are still in "
                f"{tree.state_dir / 'blobs'}; revert cannot tell which file each belongs to. "
                "Nothing was removed: restore state.json from a backup, or reinstall vLLM and "
                "then remove the .k3patch directory"
            )
        # (Not missing_original: a revert stopped before removing its record leaves one
        # naming copies it already pruned, and the next revert finishes.)
        if why := planted_copy(tree.package_dir, set(txn.blobs.names())):
            raise EnvironmentProblem(why)
        if record is not None and (why := txn.unnamed_original(record)):
            raise damaged(str(tree.state_dir / STATE_FILE), why)
        changed = {rel: fs for rel, fs in (record.files.items() if record else []) if fs.applied}
        if record is None or not changed:
            _remove_state_dir(txn)
            return RevertOutcome(nothing_recorded=True, recovered=recovered)
        conflicts = []
        edits = []
        already = []  # put back by a reinstall: original now, nothing to write
        for rel, fs in sorted(changed.items()):
            data = tree.read(rel)
            current = None if data is None else sha256(data)
            if current == fs.original:
                already.append(rel)
            elif current != fs.applied:
                conflicts.append(
                    f"vllm/{rel} changed since k3patch applied it and is not the recorded "
                    f"original either (now {(current or 'absent')[:12]}, k3patch wrote "
                    f"{(fs.applied or 'nothing')[:12]}, original "
                    f"{(fs.original or 'absent')[:12]})"
                )
            else:
                original = None if fs.original is None else txn.blobs.load(fs.original)
                edits.append(FileEdit(rel, data, original))
        if conflicts:
            return RevertOutcome(conflicts=conflicts, recovered=recovered)
        pycache = _commit(txn, edits, "revert", record)
        # The record goes last, after the blobs: a run stopped in between leaves a record whose
        # files are all original again (the next revert just cleans up), never saved originals
        # without a record (which revert must refuse: it cannot tell whose they are).
        _remove_state_dir(txn)
        restored = sorted([e.rel for e in edits] + already)
        return RevertOutcome(restored, recovered=recovered, pycache=pycache)


def _refresh_record(tree: VllmTree, lock_timeout: float) -> None:
    """After a run with nothing to write, record the classification (the state record only,
    never a vLLM file) so the next run, and every waiting concurrent run, takes the no-op path.
    Best effort: a tree that cannot be written keeps no record."""
    if not os.access(tree.package_dir, os.W_OK):
        return
    # A damaged record is never overwritten. A refresh that fails may leave an empty `.k3patch`
    # (harmless: no record reads as no record; the next revert removes it).
    with contextlib.suppress(EnvironmentProblem), locked(tree.package_dir, lock_timeout):
        full = scan(tree, all_patches())
        if full.from_record or full.pending() or full.drifted or full.interrupted:
            return
        record = _record(full, _carried_files(load(tree.state_dir), full))
        # One file replaced atomically: no journal needed.
        write_atomically(tree.state_dir / STATE_FILE, record.to_bytes(), root=tree.package_dir)


def _commit(txn: Transaction, edits: list[FileEdit], op: str, old: StateRecord | None) -> list[str]:
    """`txn.commit`. One that failed and rolled back leaves no trace: blobs it stored are
    dropped, and a state dir it created is removed. With a journal still there (rollback failed
    too), keep everything: the next run needs it."""
    try:
        return txn.commit(edits, op)
    except RecordProblem:
        raise  # refused before anything was stored: a damaged record keeps every saved copy
    except BaseException:
        # Committed (a sync after the journal's removal failed) or a journal left: no rollback
        # happened, and the record and saved originals are the tree's.
        if txn.committed or txn.pending_journal() is not None:
            raise
        if old is None:
            _remove_state_dir(txn)
        else:
            txn.blobs.prune(old.originals)
        raise


def _remove_state_dir(txn: Transaction) -> None:
    """A reverted tree carries nothing of k3patch's."""
    txn.blobs.prune(set())
    txn.remove_state_dir()
