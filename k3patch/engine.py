"""The library API under the CLI: apply and revert (scan, the classification, is `scan.py`).

Data flows one way: tree.locate -> read target files -> each patch classifies its sites ->
apply plans the edits in memory, compiles and re-classifies them -> transaction commits them ->
the state record is written in the same transaction. Nothing here prints.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from k3patch.errors import EnvironmentProblem, PatchBug
from k3patch.lock import locked
from k3patch.patch import Patch
from k3patch.registry import all_patches, patch_set_digest
from k3patch.replace import write_atomically
from k3patch.scan import Report, classify, file_hashes, patch_meta, scan, target_files
from k3patch.sources import SourceError, Sources
from k3patch.state import (
    STATE_FILE,
    STATE_REL,
    FileState,
    StateRecord,
    load,
)
from k3patch.transaction import FaultHook, FileEdit, Transaction, sha256
from k3patch.tree import VllmTree
from k3patch.verdicts import SiteResult, Verdict

DEFAULT_LOCK_TIMEOUT = 120.0


def _carried_files(record: StateRecord | None, report: Report) -> dict[str, FileState]:
    """The record's files whose recorded original is still this file's. After an upgrade (another
    vLLM version) or a reinstall (the original is back, or no site of the file reads applied any
    more) the file holds other bytes and k3patch's edit is gone: that original would put an old
    version's file into the new install, so it is dropped. A file edited by hand on top of
    k3patch's edit (same version, a site still applied) keeps it: revert then refuses, naming
    both hashes, instead of silently forgetting the file."""
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


def _state_bytes(tree: VllmTree) -> bytes | None:
    from k3patch.state import read_bytes

    return read_bytes(tree.state_dir)


# ----------------------------------------------------------------------------------------
# apply


@dataclass
class Plan:
    """Every edit of an apply, made in memory and checked before anything is written."""

    before: Report
    after_results: list[SiteResult]
    new_texts: dict[str, str]  # rel -> new text
    old_texts: dict[str, str]
    # Patches left out because their rewrite failed its own checks (a k3patch bug, never the
    # tree's): patch id -> one line saying how. Nothing of them is in `new_texts`.
    bugs: dict[str, str] = field(default_factory=dict)

    def diff(self) -> str:
        chunks: list[str] = []
        for rel, new in self.new_texts.items():
            chunks.extend(
                difflib.unified_diff(
                    self.old_texts[rel].splitlines(keepends=True),
                    new.splitlines(keepends=True),
                    fromfile=f"a/vllm/{rel}",
                    tofile=f"b/vllm/{rel}",
                )
            )
        return "".join(chunks)


def plan(report: Report, refused: Iterable[str] = ()) -> Plan:
    """Rewrite every pending site in memory, compile the results and re-classify them: every
    pending site must now read as applied and no other verdict may change. The patches named
    in `refused` (drifted ones) are not rewritten: each of their sites must keep its verdict,
    so another patch's edit of a shared file cannot have touched them.

    Patch by patch: each is rewritten over the files as the patches before it left them, in
    its own libcst trees, and checked at once. A patch whose rewrite raises, does not compile,
    or does not re-classify as exactly that (a k3patch bug) is left out and named in
    `Plan.bugs`; the files it touched are as the patches before it left them, so it cannot
    poison another patch's edit of a shared file, and the others go on."""
    sources = report.sources or Sources(report.tree.read, report.tree.version)
    skip = frozenset(refused)
    changes: dict[str, str] = {}
    current: Sources = sources
    results = {p.id: report.for_patch(p.id) for p in report.patches}
    rewritten: set[str] = set()
    bugs: dict[str, str] = {}
    for patch in report.patches:
        if patch.id in skip:
            continue
        pending = [r for r in results[patch.id] if r.verdict is Verdict.PENDING]
        if not pending:
            continue
        try:
            mine = _rewrite(patch, current, pending)
            after = current.with_changes(mine)
            checked = _check(report, after, set(mine), rewritten | {patch.id}, skip)
        except PatchBug as exc:
            bugs[patch.id] = str(exc)
            continue
        changes.update(mine)
        current = after
        results.update(checked)
        rewritten.add(patch.id)
    old_texts = {rel: sources[rel].text for rel in changes}
    after_results = [r for p in report.patches for r in results[p.id]]
    return Plan(report, after_results, changes, old_texts, bugs)


def _rewrite(patch: Patch, sources: Sources, pending: list[SiteResult]) -> dict[str, str]:
    """One patch's new file texts (only the files it changed), in its own libcst trees over
    `sources`. Imported here: status and a tree with nothing pending never need libcst."""
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
    report: Report, after: Sources, changed: set[str], rewritten: set[str], refused: frozenset[str]
) -> dict[str, list[SiteResult]]:
    """The new results of every patch whose files are in `changed`, checked: each changed file
    compiles, every pending site of the `rewritten` patches now reads applied and every other
    site keeps its verdict (so the `refused` patches' sites are untouched). A patch none of
    whose files changed keeps its results: its inputs are the same bytes."""
    for rel in changed:
        # Parsed once: the tree feeds both the compile check and the re-classification.
        try:
            compile(after[rel].tree, f"vllm/{rel}", "exec", dont_inherit=True)
        except (SyntaxError, SourceError, ValueError) as exc:
            why = str(exc).removesuffix("; restore it from the wheel")  # the tree's remedy
            raise PatchBug(f"rewritten vllm/{rel} does not compile: {why}") from exc
    before = {(r.patch_id, r.site, r.file): r for r in report.results}
    out: dict[str, list[SiteResult]] = {}
    for patch in report.patches:
        if not set(patch.files) & changed:
            continue
        now = classify(patch, after)
        for result in now:
            old = before.get((result.patch_id, result.site, result.file))
            want = (
                Verdict.APPLIED
                if old and old.patch_id in rewritten and old.verdict is Verdict.PENDING
                else (old and old.verdict)
            )
            if want != result.verdict:
                raise PatchBug(
                    f"after the rewrite {result.site} of {result.patch_id} in vllm/"
                    f"{result.file} reads {result.verdict.value}, expected "
                    f"{want.value if want else 'no such site'}"
                )
        keys = {(r.site, r.file) for r in now}
        if keys != {(r.site, r.file) for r in report.for_patch(patch.id)}:
            raise PatchBug(f"the rewrite changed which sites of {patch.id} exist")
        out[patch.id] = now
    return out


@dataclass
class ApplyOutcome:
    report: Report  # the classification the outcome rests on (after the commit, if any)
    plan: Plan | None = None
    written: list[str] = field(default_factory=list)  # files replaced by this run
    refused: bool = False  # a selected patch drifted: nothing of it was written
    # The drifted patches refused (nothing of them written). Without --all-or-nothing the
    # other patches are still applied in the same run; with it, nothing at all is written.
    refused_patches: list[str] = field(default_factory=list)
    all_or_nothing: bool = False
    recovered: list[str] = field(default_factory=list)
    pycache: list[str] = field(default_factory=list)
    check: bool = False
    # Patches whose rewrite failed its own checks (a k3patch bug): id -> how. Nothing of them
    # is written; the others are, unless --all-or-nothing (then nothing at all). Exit 2.
    bugs: dict[str, str] = field(default_factory=dict)


def _record(
    tree: VllmTree,
    results: list[SiteResult],
    hashes: dict[str, str | None],
    files: dict[str, FileState],
) -> StateRecord:
    return StateRecord(
        patches=patch_meta(all_patches()),
        patch_set=patch_set_digest(),
        vllm_version=tree.version,
        files=files,
        scan=hashes,
        results=results,
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
    """Bring every selected patch to applied (or leave it satisfied / not applicable).

    A patch with a drifted site is refused: nothing of it is written. The other selected
    patches are still applied, in one transaction, so an entrypoint that goes on in warn mode
    starts vLLM with every fix that is safe. With `all_or_nothing`, any drift refuses the whole
    run and nothing is written."""
    patches = all_patches() if patches is None else patches
    # Every patch is classified (the record covers them all); the outcome speaks of `patches`.
    first = scan(tree, all_patches())
    if first.state_problem:
        raise EnvironmentProblem(first.state_problem)  # the record it must keep is unreadable
    report = first.selected(patches)
    refused = _drifted_patches(report)
    if refused and all_or_nothing:
        return _refused(report, refused, check=check, all_or_nothing=True)
    if not report.pending_outside(refused) and report.interrupted is None:
        if not report.from_record and not check:
            _refresh_record(tree, lock_timeout)
        return _refused(report, refused, check=check)
    if check:
        the_plan = plan(report, refused) if report.pending_outside(refused) else None
        outcome = _refused(report, refused, check=True)
        if the_plan is not None:
            outcome.bugs = the_plan.bugs
            outcome.all_or_nothing = outcome.all_or_nothing or bool(
                the_plan.bugs and all_or_nothing
            )
            outcome.plan = None if the_plan.bugs and all_or_nothing else the_plan
        return outcome

    txn = Transaction(tree.package_dir, fault)
    with locked(tree.package_dir, lock_timeout):
        recovered = txn.recover()
        # Another run may have finished the work while we waited for the lock (its record then
        # matches every file); if no file changed since our first look, that look stands.
        now = file_hashes(Sources(tree.read), target_files(all_patches()))
        full = first if now == first.hashes and not recovered else scan(tree, all_patches())
        full.interrupted = None  # recovered above, under the lock: no journal is left
        report = full.selected(patches)
        refused = _drifted_patches(report)
        if refused and all_or_nothing:
            return _refused(report, refused, recovered=recovered, all_or_nothing=True)
        if not report.pending_outside(refused):
            return _refused(report, refused, recovered=recovered)
        the_plan = plan(report, refused)
        if the_plan.bugs and (all_or_nothing or not the_plan.new_texts):
            outcome = _refused(report, refused, recovered=recovered)
            outcome.bugs = the_plan.bugs
            outcome.all_or_nothing = all_or_nothing
            return outcome
        sources = report.sources or Sources(tree.read, tree.version)
        # Damaged or of another schema: stop (exit 3) before its saved originals are pruned.
        old = load(tree.state_dir)
        files = _carried_files(old, full)
        edits = []
        for rel, text in the_plan.new_texts.items():
            before = sources[rel].data
            after = sources[rel].encode(text)
            edits.append(FileEdit(rel, before, after))
            prior = files.get(rel)
            touched = {
                r.patch_id
                for r in the_plan.before.pending
                if r.file == rel and r.patch_id not in refused and r.patch_id not in the_plan.bugs
            }
            files[rel] = FileState(
                original=prior.original if prior else (None if before is None else sha256(before)),
                applied=sha256(after),
                patches=tuple(sorted(touched | set(prior.patches if prior else ()))),
            )
        after_hashes = dict(full.hashes)
        for rel, text in the_plan.new_texts.items():
            after_hashes[rel] = sha256(sources[rel].encode(text))
        record = _record(tree, _recorded_results(full, the_plan, sources), after_hashes, files)
        edits.append(FileEdit(STATE_REL, _state_bytes(tree), record.to_bytes()))
        try:
            pycache = txn.commit(edits, "apply")
        except BaseException:
            _forget_failed_commit(tree, txn, old)
            raise
        txn.prune_blobs({fs.original for fs in files.values() if fs.original})
        final = Report(tree, patches, the_plan.after_results, after_hashes)
        return ApplyOutcome(
            final,
            plan=the_plan,
            written=list(the_plan.new_texts),
            refused=bool(refused),
            refused_patches=refused,
            recovered=recovered,
            pycache=pycache,
            bugs=the_plan.bugs,
        )


def _recorded_results(full: Report, the_plan: Plan, sources: Sources) -> list[SiteResult]:
    """Every patch's results for the record, as the written files now read: the selected
    patches' from the plan; a patch left out (`--only`/`--skip`) keeps its results only when
    none of its files changed, else it is classified again over the new texts (a rewrite of a
    shared file moves its sites' lines, may change its verdict), so that the no-op path answers
    what the full path would."""
    planned = {r.patch_id for r in the_plan.after_results} | {p.id for p in the_plan.before.patches}
    after = sources.with_changes(the_plan.new_texts)
    out: list[SiteResult] = []
    for patch in all_patches():
        if patch.id in planned:
            out += [r for r in the_plan.after_results if r.patch_id == patch.id]
        elif set(patch.files) & set(the_plan.new_texts):
            out += classify(patch, after)
        else:
            out += full.for_patch(patch.id)
    return out


def _drifted_patches(report: Report) -> list[str]:
    """The selected patches with a drifted site, in report order."""
    drifted = {r.patch_id for r in report.drifted}
    return [p.id for p in report.patches if p.id in drifted]


def _refused(
    report: Report,
    refused: list[str],
    *,
    check: bool = False,
    recovered: list[str] | None = None,
    all_or_nothing: bool = False,
) -> ApplyOutcome:
    """An outcome that writes nothing (more), naming the drifted patches it refused."""
    return ApplyOutcome(
        report,
        refused=bool(refused),
        refused_patches=refused,
        all_or_nothing=all_or_nothing and bool(refused),
        recovered=recovered or [],
        check=check,
    )


# ----------------------------------------------------------------------------------------
# revert


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
    if not os.path.lexists(tree.state_dir):
        return RevertOutcome(nothing_recorded=True)
    txn = Transaction(tree.package_dir, fault)
    with locked(tree.package_dir, lock_timeout):
        recovered = txn.recover()
        # Damaged or of another schema: RecordProblem (exit 3), nothing removed.
        record = load(tree.state_dir)
        if record is None and txn.blob_names():
            raise EnvironmentProblem(
                f"{tree.state_dir / STATE_FILE} is missing but saved originals are still in "
                f"{tree.state_dir / 'blobs'}; revert cannot tell which file each belongs to. "
                "Nothing was removed: restore state.json from a backup, or reinstall vLLM and "
                "then remove the .k3patch directory"
            )
        changed = {rel: fs for rel, fs in (record.files.items() if record else []) if fs.applied}
        if record is None or not changed:
            _remove_state_dir(tree, txn)
            return RevertOutcome(nothing_recorded=True, recovered=recovered)
        conflicts = []
        edits = []
        already = []  # put back by a reinstall: original now, nothing to write
        sources = Sources(tree.read)
        for rel, fs in sorted(changed.items()):
            data = sources[rel].data
            current = None if data is None else sha256(data)
            if current == fs.original:
                already.append(rel)
                continue
            if current != fs.applied:
                conflicts.append(
                    f"vllm/{rel} changed since k3patch applied it and is not the recorded "
                    f"original either (now {current and current[:12]}, k3patch wrote "
                    f"{fs.applied and fs.applied[:12]}, original "
                    f"{fs.original and fs.original[:12]})"
                )
                continue
            original = None if fs.original is None else txn.load_blob(fs.original)
            edits.append(FileEdit(rel, data, original))
        if conflicts:
            return RevertOutcome(conflicts=conflicts, recovered=recovered)
        try:
            pycache = txn.commit(edits, "revert")
        except BaseException:
            _forget_failed_commit(tree, txn, record)
            raise
        # The record goes last, after the blobs: a run stopped in between leaves a record whose
        # files are all original again (the next revert just cleans up), never saved originals
        # without a record (which revert must refuse: it cannot tell whose they are).
        _remove_state_dir(tree, txn)
        return RevertOutcome(
            restored=sorted([e.rel for e in edits] + already),
            recovered=recovered,
            pycache=pycache,
        )


def _refresh_record(tree: VllmTree, lock_timeout: float) -> None:
    """After a run with nothing to write, record the classification (only the state record is
    written, never a vLLM file) so the next run, and every waiting concurrent run, takes the no-op
    path. Best effort: a tree that cannot be written keeps no record."""
    if not os.access(tree.package_dir, os.W_OK):
        return
    try:
        with locked(tree.package_dir, lock_timeout):
            full = scan(tree, all_patches())
            if full.from_record or full.pending or full.drifted or full.interrupted:
                return
            old = load(tree.state_dir)
            record = _record(tree, full.results, full.hashes, _carried_files(old, full))
            # One file replaced atomically: no journal needed.
            write_atomically(tree.state_dir / STATE_FILE, record.to_bytes(), root=tree.package_dir)
    except EnvironmentProblem:
        # A damaged record is never overwritten; an empty state dir this run created is
        # removed by the lock's release, which knows whether another run holds it.
        pass


def _forget_failed_commit(tree: VllmTree, txn: Transaction, old: StateRecord | None) -> None:
    """A commit that failed and rolled back leaves no trace: blobs it stored are dropped, and a
    state dir it created is removed. With a journal still there (rollback failed too), keep
    everything: the next run needs it."""
    if txn.pending_journal() is not None:
        return
    if old is None:
        _remove_state_dir(tree, txn)
    else:
        txn.prune_blobs({fs.original for fs in old.files.values() if fs.original})


def _remove_state_dir(tree: VllmTree, txn: Transaction) -> None:
    """A reverted tree carries nothing of k3patch's."""
    txn.prune_blobs(set())
    txn.remove_state_dir()
